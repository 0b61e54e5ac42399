"""Where a training step's CPU goes: every process of the cluster, psclient against TF's stack.

On one `psclient.LocalCluster` (2 workers, 1 ps; `--workers`, `--ps`) each
configuration runs on both stacks, each in its own coordinator subprocess,
psclient and TF's stack in turn (interleaved, so they see the same load):

  psclient   Keras 3 `fit` with the model built in psclient's strategy scope, or
             `strategy.schedule` + `strategy.join()`
  tf         tf_keras `fit` with tf.distribute.experimental.ParameterServerStrategy,
             or TF's ClusterCoordinator `schedule` + `join()` (TF's tutorial)

Configurations (`--configs`):

  fit_adam_spe1, fit_adam_spe10, fit_sgd_spe1, fit_sgd_spe10
      benchmarks/keras_fit.py's model and data (784-512-512-10 ReLU MLP,
      batch 128, one random batch repeated; Adam(1e-4) or SGD(0.01)) at
      steps_per_execution 1 and 10; a step is one batch.
  fit_adam_keras_ops_spe1, fit_sgd_keras_ops_spe1
      fit_adam_spe1 and fit_sgd_spe1 with the optimizer a subclass of Adam
      or SGD: psclient then keeps Keras's element-wise ops on the ps (it
      applies Keras's own Adam and SGD classes with one TF kernel per
      weight); TF's stack is unchanged by it. An A/B of those kernels in
      one run.
  fit_sgd_momentum_spe1, fit_sgd_momentum_keras_ops_spe1
      The same with SGD(0.01, momentum=0.9), Keras's class and a subclass.
  schedule_tiny
      benchmarks/dispatch.py's "tiny" function (one assign_add on an int64
      counter on each ps, returning a scalar constant), scheduled
      `--tiny-steps` times and joined; a step is one scheduled call. The
      user fetches no result, but psclient copies every call's outputs to the
      coordinator when the call finishes (its futures hold numpy values), while
      TF's ClusterCoordinator leaves them on the worker until `fetch()`. After
      the run every counter must equal the number of calls scheduled (each ran
      exactly once).
  schedule_tiny_fetched
      The same, and TF's stack also fetches every call's result (`fetch()` of
      each RemoteValue after `join()`): both stacks copy each result once.
  schedule_tiny_noresult
      The same function returning nothing: neither stack copies anything back.

Around the timed section (after `--warmup` untimed steps, which trace) the
child reads the user + system CPU seconds of every process with psutil: its
own (the coordinator, all its threads), each worker's and each ps's (the
LocalCluster's task pids; both stacks run on the same task processes), and
the machine's busy CPU seconds, whose rest ("other") is what processes outside
the cluster used (other jobs on a shared machine). CPU seconds per step are
less sensitive than steps/s to such load; the load average is recorded.

Usage:
  python benchmarks/step_cpu.py [--steps 300] [--tiny-steps 600] [--repeats 1] [--configs ...]

With `--op-counts`, each run also records the op types of the train function its stack traced
(`train_function_ops`: per graph, op types and counts, those pinned to a ps task, captured inputs):
what a worker and a ps run per step, compared op for op.

Prints one JSON object (progress on stderr) and saves it under
benchmarks/results/step_cpu-<date>[-<tag>].json. Exits 0 when every run
finished, 1 if any failed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.dirname(_HERE)]  # _common, and the psclient of this checkout
import _common  # noqa: E402

STACKS = ("psclient", "tf")
# name: (kind, optimizer, steps_per_execution)
CONFIGS = {
    "fit_adam_spe1": ("fit", "adam", 1),
    "fit_adam_spe10": ("fit", "adam", 10),
    # Adam through a subclass: Keras's element-wise ops on psclient's ps too (psclient fuses
    # Keras's own Adam class only), for an A/B of the one-kernel update in one run.
    "fit_adam_keras_ops_spe1": ("fit", "adam_keras_ops", 1),
    "fit_sgd_keras_ops_spe1": ("fit", "sgd_keras_ops", 1),
    "fit_sgd_momentum_spe1": ("fit", "sgd_momentum", 1),
    "fit_sgd_momentum_keras_ops_spe1": ("fit", "sgd_momentum_keras_ops", 1),
    "fit_sgd_spe1": ("fit", "sgd", 1),
    "fit_sgd_spe10": ("fit", "sgd", 10),
    "schedule_tiny": ("schedule", None, 1),
    "schedule_tiny_fetched": ("schedule", None, 1),
    "schedule_tiny_noresult": ("schedule", None, 1),
}
DEFAULT_WORKERS, DEFAULT_PS = 2, 1


# ----------------------------------------------------------------------------
# The paths, in the coordinator subprocess. Each returns (run, check):
# run(n) runs n steps and waits for them; check() -> dict or None, a
# correctness check after the timed steps.
def setup_fit(stack: str, cluster, optimizer: str, spe: int):
    import keras_fit  # the same model, data and fit as benchmarks/keras_fit.py

    fit = keras_fit.setup("psclient_keras3" if stack == "psclient" else "tf_keras_pss", cluster, spe, optimizer)
    losses = []

    def run(n: int) -> None:
        losses.append(fit(n))

    def check() -> dict:
        # Sanity: the model trains (the loss after the timed steps is below the first warm-up fit's).
        return {"loss_after_warmup": round(losses[0], 4), "loss_last": round(losses[-1], 4),
                "loss_fell": losses[-1] < losses[0]}

    run.keep = fit  # psclient's owners hold the strategy weakly: keep it alive
    return run, check


def setup_schedule(stack: str, cluster, config: str):
    import dispatch  # the tiny step of benchmarks/dispatch.py
    import tensorflow as tf

    def make_tiny(counters):
        if config != "schedule_tiny_noresult":
            return dispatch.make_tiny_step(counters)

        @tf.function
        def tiny_noresult():  # dispatch.py's tiny step without its output: nothing to copy back
            for counter in counters:
                counter.assign_add(1)

        return tiny_noresult

    if stack == "psclient":
        import psclient

        strategy = psclient.ParameterServerStrategy(cluster)
        with strategy.scope():
            counters = dispatch.make_counters(cluster.num_ps)
        tiny = make_tiny(counters)
        schedule, join = (lambda: strategy.schedule(tiny)), strategy.join
    else:
        resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
            tf.train.ClusterSpec(cluster.training_spec()), task_type="chief", task_id=0, rpc_layer="grpc"
        )
        strategy = tf.distribute.experimental.ParameterServerStrategy(resolver)
        coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
        with strategy.scope():  # TF places variables round-robin over the ps tasks
            counters = dispatch.make_counters(cluster.num_ps)
        tiny = make_tiny(counters)

        @tf.function
        def tiny_step():
            return strategy.run(tiny)

        if config == "schedule_tiny_fetched":
            # Each result copied to the coordinator once, as psclient's futures do.
            results = []

            def schedule():
                results.append(coordinator.schedule(tiny_step))

            def join():
                coordinator.join()
                coordinator.fetch(results)
                results.clear()
        else:
            schedule, join = (lambda: coordinator.schedule(tiny_step)), coordinator.join
    scheduled = [0]

    def run(n: int) -> None:
        for _ in range(n):
            schedule()
        join()
        scheduled[0] += n

    def check() -> dict:
        values = [int(c.numpy()) for c in counters]
        return {"counters": values, "closures_scheduled": scheduled[0],
                "every_closure_once": all(v == scheduled[0] for v in values)}

    run.keep = strategy
    return run, check


def child_main(args: argparse.Namespace) -> None:
    """One coordinator subprocess: one stack, one configuration; prints one JSON line."""
    _common.exit_with_parent()
    import psutil

    import psclient

    cluster = psclient.Cluster(json.loads(args.cluster))
    task_pids = json.loads(args.task_pids)
    kind, optimizer, spe = CONFIGS[args.config]
    if kind == "fit":
        run, check = setup_fit(args._child, cluster, optimizer, spe)
    else:
        run, check = setup_schedule(args._child, cluster, args.config)
    processes = {"coordinator": psutil.Process(), **{t: psutil.Process(p) for t, p in task_pids.items()}}

    def cpu() -> dict[str, float]:
        return {name: sum(process.cpu_times()[:2]) for name, process in processes.items()}

    run(args.warmup)
    load0 = os.getloadavg()[0]
    cpu0, busy0, t0 = cpu(), _common.machine_busy_seconds(), time.perf_counter()
    run(args.steps)
    seconds = time.perf_counter() - t0
    cpu1, busy1 = cpu(), _common.machine_busy_seconds()
    used = {name: cpu1[name] - cpu0[name] for name in cpu0}
    steps = args.steps
    per_step_us = lambda s: round(s / steps * 1e6, 1)  # noqa: E731
    by_role = {
        "coordinator": used["coordinator"],
        "workers": sum(s for n, s in used.items() if n.startswith("worker:")),
        "ps": sum(s for n, s in used.items() if n.startswith("ps:")),
    }
    other = (busy1 - busy0) - sum(used.values())
    _common.child_exit({
        "steps": steps,
        "seconds": round(seconds, 3),
        "steps_per_s": round(steps / seconds, 1),
        "cpu_us_per_step": {
            "by_process": {name: per_step_us(s) for name, s in used.items()},
            "by_role": {role: per_step_us(s) for role, s in by_role.items()},
            "all": per_step_us(sum(used.values())),
        },
        # Of the CPUs' capacity over the timed section: our processes, and everything else.
        "cluster_cpu_share": round(sum(used.values()) / (seconds * (os.cpu_count() or 1)), 3),
        "other_processes_cpu_share": round(max(0.0, other) / (seconds * (os.cpu_count() or 1)), 3),
        "load_average_1min": {"before": round(load0, 2), "after": round(os.getloadavg()[0], 2)},
        "coordinator_pid": os.getpid(),
        "check": check(),
        **({"train_function_ops": train_function_ops()} if args.op_counts else {}),
    })


def train_function_ops() -> dict:
    """Op types of the train functions this process traced (`--op-counts`), each stack's own.

    Every `tf.function` alive whose traced graph's name has "train" in it (psclient's kept step
    functions, tf_keras's train function): per graph, its op types and counts, the ops pinned to a ps
    task (the optimizer's update, placed there at trace time; the rest is placed by TF at run time,
    resource reads beside their variable), the inputs it captures and the nested functions' ops.
    """
    import collections
    import gc

    import tensorflow as tf

    found = {}
    for function in gc.get_objects():
        # isinstance first: a getattr on some objects gc holds (lazy modules) imports them.
        # Traced ones only: listing an untraced function with an input signature traces it.
        if not isinstance(function, tf.types.experimental.PolymorphicFunction) or \
                not function.experimental_get_tracing_count():
            continue
        for concrete in function._list_all_concrete_functions():
            graph = concrete.graph
            if "train" not in graph.name:
                continue
            graph_def = graph.as_graph_def()
            types = collections.Counter(node.op for node in graph_def.node)
            on_ps = collections.Counter(node.op for node in graph_def.node if "/job:ps/" in node.device)
            found[graph.name] = {
                "ops": sum(types.values()), "op_types": dict(types.most_common()),
                "ops_on_ps": sum(on_ps.values()), "op_types_on_ps": dict(on_ps.most_common()),
                "captured_inputs": len(concrete.captured_inputs),
                "nested_functions": {f.signature.name: len(f.node_def) for f in graph_def.library.function},
            }
    return found


# ----------------------------------------------------------------------------
def summarize(runs: dict) -> dict:
    """Medians per configuration and stack, and the ratios psclient / tf."""
    summary = {}
    for config, per_stack in runs.items():
        entry: dict = {}
        for stack, results in per_stack.items():
            ok = [r for r in results if "error" not in r]
            if not ok:
                entry[stack] = None
                continue
            roles = ok[0]["cpu_us_per_step"]["by_role"].keys()
            entry[stack] = {
                "steps_per_s": _common.median([r["steps_per_s"] for r in ok]),
                "cpu_us_per_step": {
                    **{role: _common.median([r["cpu_us_per_step"]["by_role"][role] for r in ok]) for role in roles},
                    "all": _common.median([r["cpu_us_per_step"]["all"] for r in ok]),
                },
                "cpu_us_per_step_by_process": {
                    name: _common.median([r["cpu_us_per_step"]["by_process"][name] for r in ok])
                    for name in ok[0]["cpu_us_per_step"]["by_process"]},
                "runs": len(ok),
                "failed_runs": len(results) - len(ok),
            }
        ours, theirs = entry.get("psclient"), entry.get("tf")
        if ours and theirs:
            ratio = lambda a, b: round(a / b, 3) if b else None  # noqa: E731
            entry["psclient/tf"] = {
                "steps_per_s": ratio(ours["steps_per_s"], theirs["steps_per_s"]),
                "cpu_us_per_step": {k: ratio(v, theirs["cpu_us_per_step"][k])
                                    for k, v in ours["cpu_us_per_step"].items()},
            }
            # psclient's CPU per step minus TF's, per role: where the difference is.
            entry["psclient-tf_cpu_us_per_step"] = {
                k: round(v - theirs["cpu_us_per_step"][k], 1) for k, v in ours["cpu_us_per_step"].items()}
        summary[config] = entry
    return summary


def parent_main(args: argparse.Namespace, argv: list[str]) -> int:
    configs = args.configs.split(",")
    stacks = args.stacks.split(",")
    output = {"config": {
        **_common.environment(argv),
        "num_workers": args.workers, "num_ps": args.ps, "repeats": args.repeats,
        "warmup_steps": args.warmup, "timed_steps": {c: steps_of(c, args) for c in configs},
        "configs": {c: dict(zip(("kind", "optimizer", "steps_per_execution"), CONFIGS[c])) for c in configs},
        "stacks": stacks, "order": "per repeat, per configuration, each stack in turn",
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
    }}
    runs = {c: {s: [] for s in stacks} for c in configs}
    env = _common.quiet_tf_env(GRPC_FAIL_FAST="use_caller")
    started = time.perf_counter()
    with _common.stop_on_sigterm():
        _common.log(f"starting a LocalCluster ({args.workers} workers, {args.ps} ps)")
        # Generous: task start-up on a machine loaded by other jobs took over 60 s.
        with _common.local_cluster(args.workers, args.ps, start_timeout=300) as (cluster, task_pids):
            output["config"]["cluster"] = cluster.jobs
            _common.log("cluster up: " + ", ".join(f"{t} pid {pid}" for t, pid in task_pids.items()))
            for repeat in range(args.repeats):
                for config in configs:
                    steps = steps_of(config, args)
                    for stack in stacks:
                        child = [os.path.abspath(__file__), "--_child", stack, "--config", config,
                                 "--cluster", json.dumps(cluster.jobs), "--task-pids", json.dumps(task_pids),
                                 "--steps", str(steps), "--warmup", str(args.warmup)] + \
                            (["--op-counts"] if args.op_counts else [])
                        tag = f"repeat {repeat + 1}/{args.repeats} {config:15} {stack:8}"
                        try:
                            # Generous: TF start-up, tracing, and the steps at 5 steps/s.
                            result = _common.run_child(child, timeout=180 + steps / 5, env=env)
                        except _common.ChildError as error:
                            _common.log(f"{tag} FAILED: {error}")
                            result = {"error": str(error)}
                        else:
                            per = result["cpu_us_per_step"]
                            _common.log(
                                f"{tag} {result['steps_per_s']:7.1f} steps/s, CPU us/step: all "
                                f"{per['all']:.0f} = " + ", ".join(f"{n} {v:.0f}" for n, v in
                                                                   per["by_process"].items())
                                + f"; other processes {result['other_processes_cpu_share']:.0%} of the CPUs")
                        runs[config][stack].append(result)
    output["config"]["wall_s"] = round(time.perf_counter() - started, 1)
    output["config"]["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    output["results"] = summarize(runs)
    output["runs"] = runs
    name = f"step_cpu-{time.strftime('%Y-%m-%d')}" + (f"-{args.tag}" if args.tag else "") + ".json"
    saved = os.path.join(_HERE, "results", name)
    os.makedirs(os.path.dirname(saved), exist_ok=True)
    _common.print_json(output, also_to=saved)
    _common.log(f"saved {os.path.relpath(saved, os.path.dirname(_HERE))}")
    failed = any("error" in r for per in runs.values() for rs in per.values() for r in rs)
    return 1 if failed else 0


def steps_of(config: str, args: argparse.Namespace) -> int:
    return args.tiny_steps if CONFIGS[config][0] == "schedule" else args.steps


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300, help="timed fit steps per run (a multiple of 10)")
    parser.add_argument("--tiny-steps", type=int, default=600, help="timed schedule_tiny calls per run")
    parser.add_argument("--warmup", type=int, default=30, help="untimed steps first (tracing; a multiple of 10)")
    parser.add_argument("--repeats", type=int, default=1, help="runs of every stack and configuration (medians)")
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated subset of {','.join(CONFIGS)}")
    parser.add_argument("--stacks", default=",".join(STACKS), help=f"comma-separated subset of {','.join(STACKS)}")
    parser.add_argument("--workers", type=int, default=DEFAULT_WORKERS, help="workers of the LocalCluster")
    parser.add_argument("--ps", type=int, default=DEFAULT_PS, help="ps tasks of the LocalCluster")
    parser.add_argument("--tag", default="", help="appended to the saved file's name")
    parser.add_argument("--op-counts", action="store_true",
                        help="also record the op types of each stack's traced train function (fit configurations)")
    parser.add_argument("--_child", choices=STACKS, help=argparse.SUPPRESS)
    parser.add_argument("--config", choices=list(CONFIGS), help=argparse.SUPPRESS)
    parser.add_argument("--cluster", help=argparse.SUPPRESS)
    parser.add_argument("--task-pids", default="{}", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args._child:
        try:
            child_main(args)  # exits the process
        except BaseException:
            traceback.print_exc()
            _common.child_exit(None, status=1)
    for flag, given, known in (("--configs", args.configs, CONFIGS), ("--stacks", args.stacks, STACKS)):
        if not set(given.split(",")) <= set(known):
            parser.error(f"{flag} must be a comma-separated subset of {list(known)}. Received: {given!r}.")
    for flag, value in (("--steps", args.steps), ("--warmup", args.warmup)):
        if value < 10 or value % 10:
            parser.error(f"{flag} must be a positive multiple of 10 (steps_per_execution 10). Received: {value}.")
    for flag, value in (("--repeats", args.repeats), ("--tiny-steps", args.tiny_steps),
                        ("--workers", args.workers), ("--ps", args.ps)):
        if value < 1:
            parser.error(f"{flag} must be >= 1. Received: {value}.")
    _common.require_tf_keras(parser, "tf" in args.stacks.split(",") and any(
        CONFIGS[c][0] == "fit" for c in args.configs.split(",")), "--stacks tf with a fit configuration")
    return _common.run_parent(parent_main, args, __file__, argv)


if __name__ == "__main__":
    sys.exit(main())
