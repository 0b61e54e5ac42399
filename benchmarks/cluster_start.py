"""What starting and restarting a LocalCluster's tasks costs, forked from a fork server or each spawned.

`LocalCluster(start_method="forkserver")` forks each task from one process that imported
TensorFlow once; `"spawn"` starts `python -m psclient serve` for each, which imports it again
(as every task of a real cluster does). Both in this one process, interleaved, `--repeats`
rounds of: start `LocalCluster(--workers, --ps)`, restart worker 0, close. Per start method:
wall seconds until every task serves (the start, the restart), and CPU seconds the task processes
had used by then (user + system, from /proc), medians over the rounds; and, for the fork server,
its own CPU (the one import it makes, paid once per process and environment).

    python benchmarks/cluster_start.py                 # 5 rounds of 2 workers + 1 ps: about 2 minutes
    python benchmarks/cluster_start.py --repeats 3 --workers 4 --ps 2

Prints one JSON object (progress on stderr).
"""

from __future__ import annotations

import argparse
import sys
import time

import _common

METHODS = ("forkserver", "spawn")


def one_round(psclient, method: str, workers: int, ps: int) -> dict:
    started = time.monotonic()
    with psclient.LocalCluster(num_workers=workers, num_ps=ps, start_method=method, start_timeout=300) as local:
        start_s = time.monotonic() - started
        pids = [local.pid(job, index) for job, index, _ in local.cluster.tasks()]
        start_cpu = _common.cpu_seconds(pids)
        started = time.monotonic()
        local.restart("worker", 0)
        restart_s = time.monotonic() - started
        restart_cpu = _common.cpu_seconds([local.pid("worker", 0)])
    return {"start_s": start_s, "start_task_cpu_s": start_cpu, "restart_s": restart_s,
            "restart_task_cpu_s": restart_cpu}


def main(args: argparse.Namespace, command: list[str]) -> int:
    import psclient
    from psclient._cluster import forkserver

    runs: dict[str, list[dict]] = {method: [] for method in METHODS}
    fork_server_cpu = None
    for round_index in range(args.repeats):
        for method in METHODS:
            runs[method].append(one_round(psclient, method, args.workers, args.ps))
            _common.log(f"round {round_index + 1}/{args.repeats} {method}: {runs[method][-1]}")
            if method == "forkserver" and fork_server_cpu is None:
                servers = [server for server in forkserver._servers.values() if not server.gone]
                fork_server_cpu = _common.cpu_seconds([server.pid for server in servers])
    figures = {}
    for method, rounds in runs.items():
        figures[method] = {key: round(_common.median([r[key] for r in rounds]), 3) for key in rounds[0]}
        figures[method]["first_start_s"] = round(rounds[0]["start_s"], 3)
    figures["forkserver"]["fork_server_cpu_s"] = None if fork_server_cpu is None else round(fork_server_cpu, 3)
    ratios = {f"{key}_forkserver_over_spawn": round(figures["forkserver"][key] / figures["spawn"][key], 3)
              for key in ("start_s", "start_task_cpu_s", "restart_s", "restart_task_cpu_s")}
    _common.print_json({"benchmark": "cluster_start", "config": {**_common.environment(command), **vars(args)},
                        "medians": figures, "ratios": ratios, "runs": runs}, also_to=args.output)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="rounds of each start method, interleaved")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--ps", type=int, default=1)
    parser.add_argument("--output", help="also write the JSON here")
    args = parser.parse_args()
    sys.exit(_common.run_parent(main, args, __file__, sys.argv[1:]))
