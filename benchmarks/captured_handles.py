"""What each resource handle a scheduled function captures costs a call, per process.

A `tf.function` that uses variables passes every variable's handle it captured as an input of
each call: the coordinator writes them into the call, the worker reads them and resolves each.
A step of 26 `DynamicEmbedding` layers captures 636 handles on the ps tasks, the same model
with the hashing trick 114 (docs/dynamic_embeddings.md, "What a step's captured handles cost").
Here a tiny function (one `assign_add` on a ps) captures K more variable handles, each passed to
an identity on the worker and used by no op on a ps, and is scheduled `--calls` times per K on
`LocalCluster(1, 2)`; CPU per call of every process, K in rounds (each K once a round).

    python benchmarks/captured_handles.py --counts 0,100,400,800 --rounds 2

Prints one JSON object (progress on stderr). Ratios count within a run.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import ProcessCPU, environment, log, median, print_json  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--counts", default="0,100,400,800", help="comma-separated numbers of extra handles, 0..4096")
    parser.add_argument("--calls", type=int, default=300, help="timed calls per count and round")
    parser.add_argument("--rounds", type=int, default=2, help="rounds over every count (figures: medians)")
    args = parser.parse_args(argv)
    try:
        counts = [int(c) for c in args.counts.split(",") if c]
    except ValueError:
        parser.error(f"--counts must be comma-separated integers, got {args.counts!r}")
    if not counts or any(not 0 <= c <= 4096 for c in counts):
        parser.error(f"--counts must name numbers between 0 and 4096, got {args.counts!r}")
    if args.calls < 10 or args.rounds < 1:
        parser.error(f"--calls must be >= 10 and --rounds >= 1, got {args.calls} and {args.rounds}")

    import tensorflow as tf

    import psclient

    result = {"args": vars(args), "environment": environment(sys.argv), "runs": []}
    with psclient.LocalCluster(num_workers=1, num_ps=2, start_timeout=300) as local:
        pids = {"coordinator": os.getpid(), **{f"{job}:{i}": local.pid(job, i) for job, i, _ in local.cluster.tasks()}}
        meter = ProcessCPU(pids)
        strategy = psclient.ParameterServerStrategy(local.cluster)
        try:
            with strategy.scope():
                held = [tf.Variable(tf.zeros([4]), name=f"held_{i}") for i in range(max(counts))]
                counter = tf.Variable(0.0)
            for round_ in range(args.rounds):
                for count in counts:
                    result["runs"].append(_measure(tf, strategy, meter, counter, held[:count], args.calls))
                    log(f"round {round_ + 1}, {count} handles: {result['runs'][-1]}")
        finally:
            strategy.shutdown()
    by_count = {}
    for run in result["runs"]:
        by_count.setdefault(run["extra_handles"], []).append(run)
    result["by_extra_handles"] = {
        str(count): {key: median([run[key] for run in runs]) for key in ("calls_per_s", "coordinator_ms", "worker_ms",
                                                                          "ps_ms")}
        for count, runs in by_count.items()}
    low, high = str(min(counts)), str(max(counts))
    if high != low:
        added = max(counts) - min(counts)
        result["us_per_handle"] = {
            role: round(1000 * (result["by_extra_handles"][high][f"{role}_ms"]
                                - result["by_extra_handles"][low][f"{role}_ms"]) / added, 2)
            for role in ("coordinator", "worker", "ps")}
    print_json(result)
    return 0


def _measure(tf, strategy, meter, counter, held: list, calls: int) -> dict:
    @tf.function
    def call():
        touched = [tf.identity(variable.handle) for variable in held]  # captured; placed on the worker
        with tf.control_dependencies(touched[:1]):
            counter.assign_add(1.0)
        return tf.constant(1)

    captured = len(call.get_concrete_function().captured_inputs)
    strategy.schedule(call).result(timeout=300)  # traced and registered before the timing
    before = meter.read()
    for _ in range(calls):
        strategy.schedule(call)
    strategy.join(timeout=600)
    after = meter.read()
    by_process = meter.per_step(before, after, calls)["cpu_ms_per_step"]["by_process"]
    return {"extra_handles": len(held), "captured_inputs": captured,
            "calls_per_s": round(calls / (after["wall"] - before["wall"]), 1),
            "coordinator_ms": by_process["coordinator"], "worker_ms": by_process["worker:0"],
            "ps_ms": round(by_process["ps:0"] + by_process["ps:1"], 3)}


if __name__ == "__main__":
    sys.exit(main())
