"""Many coordinators, one after the other, against one long-lived cluster.

A `psclient serve` task outlives the coordinators it serves. Each coordinator
creates an eager context on every task (its functions, resource handles,
executor threads); this benchmark shows whether the tasks give that back:

  shutdown  each coordinator connects with `psclient.ParameterServerStrategy`,
            runs --steps scheduled steps (a variable on the ps, a small matmul
            on the worker), checks every result, calls `shutdown()` and exits
  kill      the same, but the coordinator SIGKILLs itself after the steps:
            nothing tells the tasks, only the keep-alive expiring frees them

For each mode: one fresh `LocalCluster` (--workers, --ps), then --coordinators
coordinators in a row, each its own subprocess; after each, and --settle
seconds later, the resident memory and thread count of every task. Reported:
first and last samples, the least-squares slope per coordinator (all samples,
and the second half alone: a plateau has a slope near 0 there), and in kill
mode one more sample after the keep-alive has run out.

--keep-alive sets the keep-alive TensorFlow asks the tasks for (its default,
600 s, is what psclient uses; TF-internal `context._KEEP_ALIVE_SECS`): a task
is meant to drop a coordinator's context that long after its last request.
--pause-check N stops one coordinator for N s after its steps (SIGSTOP), resumes
it and runs a step: it fails, or psclient counts a failure, if the tasks
dropped its context meanwhile.

--recycle-when-idle S starts the tasks with `psclient serve --recycle-when-idle S`
(each restarts itself in place once idle with leftovers); every coordinator
then waits for those restarts before the sample.

Usage:
  python benchmarks/serve_churn.py [--coordinators 50] [--mode both] [--keep-alive 600] > churn.json
  python benchmarks/serve_churn.py --recycle-when-idle 2 --keep-alive 5 > recycled.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import psutil

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common

CHILD_TIMEOUT = 240.0


# ------------------------------------------------------------------ child
def child_main(args: argparse.Namespace) -> None:
    _common.exit_with_parent()
    import numpy as np
    import tensorflow as tf

    import psclient
    if args.keep_alive is not None:
        # TF-internal: the keep-alive TF's context applies when a server def
        # set before its initialization (psclient's connect) takes effect.
        from tensorflow.python.eager import context

        context._KEEP_ALIVE_SECS = args.keep_alive
        # It applies only if nothing initialized the context before psclient connects.
        keep_alive_applied = context.context()._context_handle is None
    else:
        keep_alive_applied = None
    started = time.monotonic()
    cluster = psclient.Cluster(json.loads(args.cluster))
    strategy = psclient.ParameterServerStrategy(cluster, connect_timeout=120)
    with strategy.scope():
        total = tf.Variable(0.0)
        kernel = tf.Variable(tf.ones((64, args.width)))

    @tf.function
    def step(x):
        y = tf.reduce_sum(tf.matmul(x, kernel[:, :64]))
        total.assign_add(1.0)
        return y

    x = np.ones((8, 64), np.float32)
    futures = [strategy.schedule(step, args=(x,)) for _ in range(args.steps)]
    strategy.join()
    values = [f.result() for f in futures]
    wrong = sum(1 for v in values if abs(float(v) - 8 * 64 * 64) > 1e-3)
    result = {"steps": args.steps, "wrong_results": wrong, "total": float(total.numpy()),
              "keep_alive_applied": keep_alive_applied}
    result["wall_s"] = round(time.monotonic() - started, 2)
    if args.mode == "pause":
        # Stopped by ourselves; the parent resumes us after the keep-alive ran out.
        os.kill(os.getpid(), signal.SIGSTOP)
        try:
            after = strategy.schedule(step, args=(x,))
            strategy.join()
            result["after_pause_ok"] = abs(float(after.result()) - 8 * 64 * 64) < 1e-3
            stats = strategy.stats()
            result["after_pause_stats"] = {
                "workers": [{k: w.get(k) for k in ("failures", "rejoins")} for w in stats["workers"]],
                "ps": [{k: p.get(k) for k in ("failures", "recoveries")} for p in stats["ps"]]}
        except Exception as error:  # noqa: BLE001 - reported, this is the measurement
            result["after_pause_error"] = f"{type(error).__name__}: {str(error)[:300]}"
    if args.mode == "kill":
        sys.stdout.write(json.dumps(result) + "\n")
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    strategy.shutdown()
    _common.child_exit(result)


def run_coordinator(argv: list[str], *, kill: bool) -> dict:
    """One coordinator subprocess; its JSON result. A killed one must end by SIGKILL."""
    if not kill:
        return _common.run_child(argv, timeout=CHILD_TIMEOUT, env=_common.quiet_tf_env())
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        child = subprocess.Popen([sys.executable, *argv], stdin=subprocess.PIPE, stdout=out,
                                 stderr=err, env=_common.quiet_tf_env())
        try:
            rc = child.wait(CHILD_TIMEOUT)
        except subprocess.TimeoutExpired:
            raise _common.ChildError(f"timed out after {CHILD_TIMEOUT:.0f} s") from None
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
            child.stdin.close()
        out.seek(0)
        lines = [line for line in out.read().splitlines() if line.strip()]
        if rc != -signal.SIGKILL or not lines:
            err.seek(0)
            raise _common.ChildError(f"exited with status {rc}, expected SIGKILL: {err.read()[-2000:]}")
        return json.loads(lines[-1])


# ----------------------------------------------------------------- parent
def sample(task_pids: dict[str, int]) -> dict:
    per_task = {name: _common.task_usage([pid]) for name, pid in task_pids.items()}
    return {
        "rss_mib": round(sum(t["rss_mib"] for t in per_task.values()), 1),
        "threads": sum(t["threads"] for t in per_task.values()),
        "per_task": per_task,
    }


def slope(ys: list[float]) -> float | None:
    """Least-squares slope of ys against 0, 1, 2, ... (per coordinator)."""
    n = len(ys)
    if n < 2:
        return None
    mean_x, mean_y = (n - 1) / 2, sum(ys) / n
    num = sum((i - mean_x) * (y - mean_y) for i, y in enumerate(ys))
    den = sum((i - mean_x) ** 2 for i in range(n))
    return round(num / den, 3)


def summarize(samples: list[dict]) -> dict:
    out = {}
    for key in ("rss_mib", "threads"):
        ys = [s[key] for s in samples]
        half = ys[len(ys) // 2:]
        out[key] = {
            "before_first": ys[0], "after_first": ys[1] if len(ys) > 1 else None, "last": ys[-1],
            "max": max(ys), "slope_per_coordinator": slope(ys[1:]),
            "slope_per_coordinator_second_half": slope(half),
        }
    return out


def _ready_lines(log_dir: str, task: str) -> int:
    """How often task "job:index" has said it is ready (once per start or restart in place)."""
    job, index = task.split(":")
    with open(os.path.join(log_dir, f"{job}-{index}.log"), errors="replace") as log:
        return sum(" ready at " in line for line in log)


def _wait_restarted(log_dir: str, before: dict[str, int], timeout: float) -> float:
    """Waits until every task has restarted in place since `before`; the seconds it took."""
    started = time.monotonic()
    while any(_ready_lines(log_dir, task) <= count for task, count in before.items()):
        if time.monotonic() - started > timeout:
            raise _common.ChildError(f"the tasks did not restart in place within {timeout:.0f} s")
        time.sleep(0.2)
    return time.monotonic() - started


def run_mode(mode: str, args: argparse.Namespace) -> dict:
    _common.log(f"{mode}: starting a cluster of {args.workers} workers and {args.ps} ps"
                + (f", recycled after {args.recycle_when_idle:g} s idle" if args.recycle_when_idle else ""))
    options = {"recycle_when_idle": args.recycle_when_idle} if args.recycle_when_idle else {}
    keep_alive = args.keep_alive if args.keep_alive is not None else _default_keep_alive()
    with tempfile.TemporaryDirectory(prefix="serve-churn-logs-") as log_dir, \
            _common.local_cluster(args.workers, args.ps, log_dir=log_dir, **options) as (cluster, task_pids):
        base = [os.path.abspath(__file__), "--child", "--mode", mode, "--steps", str(args.steps),
                "--width", str(args.width),
                "--cluster", json.dumps(cluster.jobs), "--task-pids", json.dumps(task_pids)]
        if args.keep_alive is not None:
            base += ["--keep-alive", str(args.keep_alive)]
        samples = [sample(task_pids)]  # before any coordinator
        walls, wrong, applied, restart_waits = [], 0, set(), []
        started = time.monotonic()
        for i in range(args.coordinators):
            if args.recycle_when_idle:
                ready_before = {task: _ready_lines(log_dir, task) for task in task_pids}
            result = run_coordinator(base, kill=mode == "kill")
            wrong += result["wrong_results"] + (result["total"] != args.steps)
            applied.add(result["keep_alive_applied"])
            walls.append(result["wall_s"])
            if args.recycle_when_idle:
                # A killed coordinator's tasks keep talking to each other for its
                # context until the keep-alive runs out: only then are they idle.
                restart_waits.append(_wait_restarted(
                    log_dir, ready_before, timeout=keep_alive + args.recycle_when_idle + 300))
            time.sleep(args.settle)  # the tasks' settle time before sampling (a measurement)
            samples.append(sample(task_pids))
            _common.log(f"{mode}: coordinator {i + 1}/{args.coordinators}: tasks "
                        f"{samples[-1]['rss_mib']} MiB, {samples[-1]['threads']} threads")
        out = {
            "coordinators": args.coordinators,
            "wrong_results": wrong,
            "keep_alive_applied": sorted(applied, key=str),
            "elapsed_s": round(time.monotonic() - started, 1),
            "median_coordinator_wall_s": _common.median(walls),
            **summarize(samples),
        }
        if restart_waits:
            out["restarts_in_place"] = {
                "median_s_from_coordinator_end_to_ready": round(_common.median(restart_waits), 2),
                "max_s": round(max(restart_waits), 2)}
        if mode == "kill" and keep_alive + 5 <= args.max_release_wait:
            wait = keep_alive + 5
            _common.log(f"{mode}: waiting {wait} s for the last keep-alives to run out")
            time.sleep(wait)  # the keep-alive window itself is what is measured
            after = sample(task_pids)
            out["after_keep_alive"] = {"waited_s": wait, "rss_mib": after["rss_mib"],
                                       "threads": after["threads"]}
        out["samples"] = [{"rss_mib": s["rss_mib"], "threads": s["threads"]} for s in samples]
        out["per_task_first_last"] = {name: {"after_first": samples[1]["per_task"][name],
                                             "last": samples[-1]["per_task"][name]}
                                      for name in task_pids} if len(samples) > 1 else {}
        return out


def pause_check(args: argparse.Namespace) -> dict:
    """One coordinator stopped (SIGSTOP) for --pause-check s after its steps, then resumed.

    If the tasks dropped its context (keep-alive run out), its next step fails
    or makes psclient count a failure; the result says which.
    """
    with _common.local_cluster(args.workers, args.ps) as (cluster, task_pids):
        argv = [sys.executable, os.path.abspath(__file__), "--child", "--mode", "pause", "--steps", "5",
                "--width", str(args.width), "--cluster", json.dumps(cluster.jobs),
                "--task-pids", json.dumps(task_pids)]
        if args.keep_alive is not None:
            argv += ["--keep-alive", str(args.keep_alive)]
        with tempfile.TemporaryFile("w+") as out:
            child = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=out, stderr=subprocess.DEVNULL,
                                     env=_common.quiet_tf_env())
            try:
                deadline = time.monotonic() + CHILD_TIMEOUT
                while psutil.Process(child.pid).status() != psutil.STATUS_STOPPED:  # bounded by the deadline
                    if child.poll() is not None or time.monotonic() > deadline:
                        raise _common.ChildError("the pause-check coordinator never stopped itself")
                    time.sleep(0.2)
                _common.log(f"pause check: coordinator stopped; resuming it in {args.pause_check:g} s")
                time.sleep(args.pause_check)  # the pause is the measurement
                os.kill(child.pid, signal.SIGCONT)
                rc = child.wait(CHILD_TIMEOUT)
            finally:
                if child.poll() is None:
                    child.kill()
                    child.wait()
                child.stdin.close()
            out.seek(0)
            lines = [line for line in out.read().splitlines() if line.strip()]
        if rc != 0 or not lines:
            raise _common.ChildError(f"the pause-check coordinator exited with status {rc}")
        result = json.loads(lines[-1])
        return {"paused_s": args.pause_check, **{k: v for k, v in result.items() if k.startswith(
            ("after_pause", "keep_alive"))}}


def _default_keep_alive() -> int:
    return 600  # TensorFlow's (tensorflow/python/eager/context.py); psclient sets none


def parent_main(args: argparse.Namespace, argv: list[str]) -> int:
    output = {"config": {**_common.environment(argv), **{k: v for k, v in vars(args).items()
                                                         if k not in ("child", "cluster", "task_pids")},
                         "keep_alive_s": args.keep_alive if args.keep_alive is not None
                         else _default_keep_alive()}}
    with _common.stop_on_sigterm():
        modes = ("shutdown", "kill") if args.mode == "both" else (args.mode,)
        for mode in modes:
            output[mode] = run_mode(mode, args)
        if args.pause_check:
            output["pause_check"] = pause_check(args)
    _common.print_json(output)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--coordinators", type=int, default=50)
    parser.add_argument("--mode", choices=("shutdown", "kill", "both", "pause"), default="both")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--ps", type=int, default=1)
    parser.add_argument("--keep-alive", type=int, default=None,
                        help="keep-alive (s) the coordinators ask the tasks for (default: TF's 600, as psclient)")
    parser.add_argument("--settle", type=float, default=1.0)
    parser.add_argument("--max-release-wait", type=float, default=120.0,
                        help="in kill mode, wait for the keep-alive to run out if it is this short")
    parser.add_argument("--width", type=int, default=64,
                        help="columns of the coordinator's (64, width) float32 variable on the ps")
    parser.add_argument("--pause-check", type=float, default=0.0, metavar="SECONDS",
                        help="also: one coordinator SIGSTOPped this long, then resumed and run again")
    parser.add_argument("--recycle-when-idle", type=float, default=None, metavar="SECONDS",
                        help="tasks restart in place after this idle time (psclient serve "
                        "--recycle-when-idle); each coordinator then waits for those restarts")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--cluster", help=argparse.SUPPRESS)
    parser.add_argument("--task-pids", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child_main(args)
        return 0
    if args.mode == "pause":
        parser.error("Invalid value for argument `--mode`. Received: pause (internal). "
                     "Expected shutdown, kill or both; see --pause-check.")
    for name in ("coordinators", "steps", "workers", "width"):
        if getattr(args, name) < 1:
            parser.error(f"Invalid value for argument `--{name}`. Received: {getattr(args, name)}. "
                         "Expected an integer >= 1.")
    return _common.run_parent(parent_main, args, __file__, argv)


if __name__ == "__main__":
    sys.exit(main())
