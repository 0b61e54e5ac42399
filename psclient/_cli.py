"""The `psclient` command line.

- `psclient serve`: one TensorFlow task server (a worker or ps task; in
  `_cluster/serve_command.py`).
- `psclient launch`: a local cluster plus a training script, as one job.
- `psclient evaluate`: the sidecar evaluator, as a job of its own.
- `psclient k8s`: Kubernetes manifests for one job, printed as YAML.
- `psclient demo`: the main example, end to end, offline.

Nothing heavy is imported here: `psclient --help` answers without loading
TensorFlow; each command imports what it needs when it runs.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence
from typing import Any

from psclient._cluster.serve_command import add_serve_parser
from psclient._core.checks import as_option, check_port, check_positive
from psclient._core.metrics import MetricsServer, evaluator_families

_MAIN_EPILOG = """\
example:
  # See it all work on this machine (offline; 12-13 s on 2 idle cores):
  psclient demo

  # Train with your script on a local cluster of 2 workers and 1 ps:
  psclient launch --workers 2 --ps 1 -- python train.py --epochs 3

  # Start worker 0 of the cluster described in cluster.json:
  psclient serve --job worker --index 0 --cluster cluster.json

  # Run a job of 4 workers and 2 ps on Kubernetes:
  psclient k8s --name mnist --image registry.example.com/train:1 --workers 4 --ps 2 \\
      -- python train.py | kubectl apply -f -

Run `psclient COMMAND --help` for a command's options.
"""

_EVALUATE_EPILOG = """\
example:
  $ cat myjob.py
  def model():      # the training model's architecture, compiled with the metrics to report
      m = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10)])
      m.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
      return m
  def data():       # what model.evaluate takes: a tf.data.Dataset, or an (x, y) tuple
      return x_test, y_test
  $ psclient evaluate --checkpoint-dir /tmp/ckpts --model myjob:model --data myjob:data

MODULE is a module name importable from the current directory, or a path
to a .py file (path/to/myjob.py:model). The evaluator never connects to the
training cluster: it only reads the checkpoint directory. It stops when
training writes its final marker (psclient.write_final_marker), after
--max-evaluations, or after --idle-timeout seconds without a new checkpoint.
Metrics go to DIR/eval (TensorBoard summaries and evaluations.jsonl) unless
--log-dir says otherwise. Exit status: 0 when it stopped by one of those
rules, 1 when the model does not match the checkpoints.
"""


def _add_evaluate_parser(commands: argparse._SubParsersAction) -> None:
    evaluate = commands.add_parser(
        "evaluate",
        help="evaluate each new checkpoint of a training job (the sidecar evaluator)",
        description="Evaluate each new checkpoint that training writes, in this process, "
        "without connecting to the training cluster.",
        epilog=_EVALUATE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    evaluate.add_argument("--checkpoint-dir", required=True, metavar="DIR",
                          help="the directory training writes checkpoints to")
    evaluate.add_argument("--model", required=True, metavar="MODULE:FN",
                          help="a function returning the built, compiled Keras model")
    evaluate.add_argument("--data", required=True, metavar="MODULE:FN",
                          help="a function returning the evaluation data")
    evaluate.add_argument("--steps", type=int, metavar="N", help="batches per evaluation (default: all of the data)")
    evaluate.add_argument("--max-evaluations", type=int, metavar="N", help="stop after N evaluations")
    evaluate.add_argument("--idle-timeout", type=float, default=600.0, metavar="S",
                          help="stop after S seconds without a new checkpoint; 0 waits forever (default: 600)")
    evaluate.add_argument("--settle-time", type=float, default=2.0, metavar="S",
                          help="seconds a Keras checkpoint file must stay unchanged before it is read (default: 2)")
    evaluate.add_argument("--poll-interval", type=float, default=1.0, metavar="S",
                          help="seconds between scans of the directory (default: 1)")
    evaluate.add_argument("--log-dir", metavar="DIR", help="where metrics go (default: CHECKPOINT_DIR/eval)")
    evaluate.add_argument("--model-key", default="model", metavar="KEY",
                          help="the model's key in tf.train.Checkpoint checkpoints (default: model)")
    evaluate.add_argument("--export-best", metavar="PATH.keras", help="save the best model there")
    evaluate.add_argument("--best-metric", default="loss", metavar="NAME",
                          help="the metric that picks the best model (default: loss)")
    evaluate.add_argument("--best-mode", choices=("auto", "max", "min"), default="auto",
                          help="auto: max for accuracy-like metrics, else min")
    evaluate.add_argument("--metrics-port", type=int, metavar="PORT",
                          help="serve Prometheus metrics on this port of every interface: evaluations, the "
                          "newest one's step and metrics, the process's memory (docs/metrics.md)")
    evaluate.set_defaults(handler=_run_evaluate, command_parser=evaluate)


def load_callable(spec: str, *, name: str) -> Callable[..., Any]:
    """The function named by `spec` = "module.path:fn" or "path/to/file.py:fn".

    `name` is the command-line option, for error messages.
    """
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"Invalid value for {name}. Received: {spec!r}. Expected MODULE:FUNCTION, "
                         "e.g. myjob:build_model or path/to/myjob.py:build_model.")
    try:
        if module_name.endswith(".py") or os.sep in module_name:
            location = importlib.util.spec_from_file_location(
                os.path.splitext(os.path.basename(module_name))[0], module_name)
            if location is None or not os.path.isfile(module_name):
                raise ImportError(f"no such file: {module_name}")
            module = importlib.util.module_from_spec(location)
            location.loader.exec_module(module)
        else:
            if os.getcwd() not in sys.path:  # As `python -m` does: the current directory's modules.
                sys.path.insert(0, os.getcwd())
            module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"Invalid value for {name}. Received: {spec!r}; cannot import "
                         f"{module_name!r}: {e}. Expected an importable module or a .py file.") from e
    function = getattr(module, attr, None)
    if not callable(function):
        raise ValueError(f"Invalid value for {name}. Received: {spec!r}; {module_name!r} has no "
                         f"function {attr!r}. Expected MODULE:FUNCTION naming a callable.")
    return function


def _stop_on_signals(stop: Callable[[], None]) -> None:
    """First SIGTERM/SIGINT: stop cleanly; a second SIGINT interrupts at once."""
    def handler(signum, frame):
        print(f"psclient evaluate: {signal.Signals(signum).name}: stopping after the current "
              "evaluation", file=sys.stderr, flush=True)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        stop()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def _run_evaluate(args: argparse.Namespace) -> int:
    parser = args.command_parser
    from psclient._sidecar.evaluator_config import EvaluatorConfig, check_watch  # No TensorFlow in it.

    # Checked first: a bad option is refused in a fraction of a second, before --model's module is
    # imported (it imports TensorFlow, as the evaluator does) and before --model and --data are built
    # (perhaps a dataset's download).
    try:
        check_port("metrics_port", args.metrics_port)
        check_watch(args.checkpoint_dir, args.steps, args.max_evaluations)
        config = EvaluatorConfig(
            log_dir=args.log_dir, idle_timeout=args.idle_timeout or None, settle_time=args.settle_time,
            poll_interval=args.poll_interval, model_key=args.model_key, export_best=args.export_best,
            best_metric=args.best_metric, best_mode=args.best_mode)
    except ValueError as e:
        parser.error(as_option(str(e)))
    try:
        build_model = load_callable(args.model, name="--model")
        build_data = load_callable(args.data, name="--data")
    except ValueError as e:
        parser.error(str(e))
    logging.basicConfig(level=logging.INFO, format="psclient evaluate: %(message)s", stream=sys.stderr)
    from psclient._sidecar.evaluator import SidecarEvaluator  # Imports TensorFlow.
    from psclient._sidecar.formats import CheckpointMismatchError

    try:
        evaluator = SidecarEvaluator(build_model(), build_data(), args.checkpoint_dir, steps=args.steps,
                                     max_evaluations=args.max_evaluations, config=config)
    except ValueError as e:  # Messages name the argument; say it as the option.
        parser.error(as_option(str(e)))
    _stop_on_signals(evaluator.stop)
    metrics = None if args.metrics_port is None else MetricsServer(
        args.metrics_port, lambda: evaluator_families(evaluator.report) if evaluator.report else [])
    try:
        report = evaluator.start()
    except CheckpointMismatchError as e:
        print(f"psclient evaluate: error: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        if metrics is not None:
            metrics.close()
    print(f"psclient evaluate: done: {len(report.evaluations)} evaluation(s), "
          f"{len(report.skipped)} skipped, {len(report.unreadable)} unreadable; {report.stop_reason}",
          file=sys.stderr, flush=True)
    return 0


_LAUNCH_EPILOG = """\
example:
  # 2 workers and 1 ps on 127.0.0.1, the script as coordinator, an evaluator beside:
  psclient launch --workers 2 --ps 1 \\
      --evaluator "psclient evaluate --checkpoint-dir /tmp/ckpts --model train:model --data train:data" \\
      -- python train.py --checkpoint-dir /tmp/ckpts

The script finds the cluster in TF_CONFIG:
  strategy = psclient.ParameterServerStrategy(psclient.Cluster.from_env())

Every line of output is prefixed with its process: worker:0, ps:0, chief (the
script), evaluator, launch. Ctrl-C is forwarded to the script and the
evaluator; a second Ctrl-C kills them. Everything is torn down when the script
exits, and launch exits with the script's exit status. After a script that
succeeded, the evaluator may run on (it stops at training's final marker) for
at most --evaluator-timeout seconds; after one that failed, it is stopped.
Task servers accept unauthenticated RPCs and TensorFlow binds ALL network
interfaces: on Linux the tasks' ports (and the coordinator's, if the script
uses psclient) drop every packet that does not come over loopback; other
users of this machine can still reach them.
"""


def _add_command(parser: argparse.ArgumentParser, whose: str) -> None:
    """The trailing command line of `launch` and `k8s` (after --)."""
    parser.add_argument("command", nargs=argparse.REMAINDER, metavar="-- COMMAND ...",
                        help=f"{whose} command line, after --")


def _command(args: argparse.Namespace, expected: str) -> list[str]:
    """The command line given after --; a usage error saying `expected` when there is none."""
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        args.command_parser.error(f"No training command given. Expected {expected}")
    return command


def _add_launch_parser(commands: argparse._SubParsersAction) -> None:
    launch = commands.add_parser(
        "launch",
        help="run a training script on a local cluster (with an optional evaluator)",
        description="Start a local cluster of worker and ps tasks on 127.0.0.1, run a training "
        "script as its coordinator, and tear everything down when the script exits.",
        epilog=_LAUNCH_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    launch.add_argument("--workers", type=int, default=2, metavar="N", help="worker tasks (default: 2)")
    launch.add_argument("--ps", type=int, default=1, metavar="M", help="ps tasks (default: 1)")
    launch.add_argument("--evaluator", metavar="CMD", help="a command to run beside training, e.g. psclient evaluate ...")
    launch.add_argument("--evaluator-timeout", type=float, default=300.0, metavar="S",
                        help="how long the evaluator may run after the script exits (default: 300)")
    launch.add_argument("--restart-failed", action="store_true", help="restart worker/ps tasks that exit")
    launch.add_argument("--max-restarts", type=int, default=3, metavar="K",
                        help="restarts per task with --restart-failed (default: 3)")
    launch.add_argument("--log-dir", metavar="DIR", help="keep the task logs there (default: a temporary directory)")
    _add_command(launch, "the training script's")
    launch.set_defaults(handler=_run_launch, command_parser=launch)


def _run_launch(args: argparse.Namespace) -> int:
    from psclient._cluster.launch import LaunchConfig, launch
    from psclient._core.errors import TaskUnreachableError

    parser = args.command_parser
    command = _command(args, "it after --, e.g. psclient launch --workers 2 --ps 1 -- python train.py")
    try:
        check_positive("workers", args.workers, integer=True)
        check_positive("ps", args.ps, integer=True)
        check_positive("max_restarts", args.max_restarts, integer=True, allow_zero=True)
        check_positive("evaluator_timeout", args.evaluator_timeout, unit="seconds")
    except ValueError as e:
        parser.error(as_option(str(e)))
    if args.evaluator is not None and not args.evaluator.strip():
        parser.error("Invalid value for --evaluator. Received: ''. Expected a command line.")
    config = LaunchConfig(
        command=command, num_workers=args.workers, num_ps=args.ps, evaluator=args.evaluator,
        restart_failed=args.restart_failed, max_restarts=args.max_restarts, log_dir=args.log_dir,
        evaluator_timeout=args.evaluator_timeout,
    )
    try:
        return launch(config)
    except TaskUnreachableError as e:  # A task that cannot start; names it, with its log.
        print(f"psclient launch: error: {e}", file=sys.stderr, flush=True)
        return 1
    except OSError as e:  # The command after -- (or --evaluator's) cannot be run.
        print(f"psclient launch: error: cannot run {e.filename!r}: {e.strerror}. Expected an "
              "executable on PATH or a path to one, e.g. -- python train.py", file=sys.stderr, flush=True)
        return 127


_K8S_EPILOG = """\
example:
  psclient k8s --name mnist --image registry.example.com/train:1 --workers 4 --ps 2 \\
      --evaluator --evaluator-model train:model --evaluator-data train:data \\
      --evaluator-checkpoint-dir /checkpoints/model \\
      -- python train.py --checkpoint-dir '$(PSCLIENT_CHECKPOINT_DIR)/model' > mnist.yaml
  kubectl apply -n NAMESPACE -f mnist.yaml

Objects (all labelled app.kubernetes.io/instance=NAME): a headless Service
NAME (every pod's DNS name, NAME-ROLE-I.NAME, is its address in TF_CONFIG),
StatefulSets NAME-ps and NAME-worker running `psclient serve`, a Job
NAME-chief running COMMAND (restarted on failure, up to --chief-restarts), an
optional Job NAME-evaluator running `psclient evaluate`, the checkpoint
volume claim NAME-checkpoints mounted at /checkpoints (PSCLIENT_CHECKPOINT_DIR)
in the chief and the evaluator, and a NetworkPolicy NAME-tasks that admits
only the job's chief, ps and worker pods to the task port. The image must hold
psclient and your code. Needs Kubernetes 1.28 or later (each StatefulSet pod
reads its index from its apps.kubernetes.io/pod-index label). COMMAND runs
without a shell; Kubernetes replaces $(VAR) in it by the container's
variables. Task servers accept unauthenticated RPCs: each ps and worker pod's
`psclient serve` drops packets from all but the job's chief, ps and worker
pods (--peer-hosts: their DNS names, resolved again as pods move), whatever
the network plugin; the NetworkPolicy works only where the plugin enforces
NetworkPolicies.
"""


def _add_k8s_parser(commands: argparse._SubParsersAction) -> None:
    from psclient._cluster.k8s import DEFAULT_PORT, DEFAULT_RESOURCES

    k8s = commands.add_parser(
        "k8s",
        help="print the Kubernetes manifests of a job (YAML, for kubectl apply)",
        description="Print, as one multi-document YAML on stdout, the Kubernetes manifests of "
        "one psclient job: ps and worker tasks, the chief running COMMAND, an optional "
        "evaluator, a checkpoint volume and a NetworkPolicy.",
        epilog=_K8S_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    k8s.add_argument("--name", required=True, help="the job's name, a DNS label; prefixes every object")
    k8s.add_argument("--image", required=True, help="the container image of every pod (psclient and your code)")
    k8s.add_argument("--workers", required=True, type=int, metavar="N", help="worker tasks")
    k8s.add_argument("--ps", required=True, type=int, metavar="M", help="ps tasks")
    k8s.add_argument("--max-workers", type=int, metavar="K",
                     help="the most worker pods the worker StatefulSet may be scaled to (default: "
                          "--workers); the chief may then list the job's pods (psclient.kubernetes_workers)")
    k8s.add_argument("--evaluator", action="store_true", help="also run psclient evaluate on the checkpoints")
    k8s.add_argument("--evaluator-model", metavar="MODULE:FN", help="with --evaluator: psclient evaluate's --model")
    k8s.add_argument("--evaluator-data", metavar="MODULE:FN", help="with --evaluator: psclient evaluate's --data")
    k8s.add_argument("--evaluator-checkpoint-dir", default="/checkpoints", metavar="DIR",
                     help="with --evaluator: the directory it evaluates, on the volume (default: /checkpoints)")
    k8s.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"every task's port (default: {DEFAULT_PORT})")
    k8s.add_argument("--metrics-port", type=int, metavar="PORT",
                     help="serve Prometheus metrics on this port of every pod (tasks and evaluator; the chief's "
                     "script gets it as PSCLIENT_METRICS_PORT) and annotate the pods for scraping")
    k8s.add_argument("--checkpoint-size", default="10Gi", metavar="QTY",
                     help="the checkpoint volume's size (default: 10Gi)")
    k8s.add_argument("--storage-class", metavar="CLASS",
                     help="its StorageClass (default: the cluster's); ReadWriteMany with --evaluator")
    k8s.add_argument("--recycle-when-idle", type=float, metavar="S",
                     help="ps and worker tasks restart in place once idle S seconds after a coordinator "
                          "(psclient serve --recycle-when-idle; default: never)")
    k8s.add_argument("--chief-restarts", type=int, default=6, metavar="K",
                     help="restarts of a failing chief (or evaluator) before the Job fails (default: 6)")
    for role, (cpu, memory) in DEFAULT_RESOURCES.items():
        k8s.add_argument(f"--{role}-cpu", default=cpu, metavar="QTY", help=f"CPU request per {role} (default: {cpu})")
        k8s.add_argument(f"--{role}-memory", default=memory, metavar="QTY",
                         help=f"memory request and limit per {role} (default: {memory})")
    _add_command(k8s, "the chief's (coordinator's)")
    k8s.set_defaults(handler=_run_k8s, command_parser=k8s)


def _run_k8s(args: argparse.Namespace) -> int:
    from psclient._cluster.k8s import K8sJob, manifests, to_yaml

    parser = args.command_parser
    command = _command(args, "the chief's command after --, e.g. "
                       "psclient k8s --name mnist --image IMAGE --workers 2 --ps 1 -- python train.py")
    fields = {f: getattr(args, f) for f in (
        "name", "image", "workers", "ps", "evaluator", "evaluator_model", "evaluator_data",
        "evaluator_checkpoint_dir", "port", "checkpoint_size", "storage_class", "chief_restarts",
        "max_workers", "recycle_when_idle", "metrics_port", *(f"{role}_{what}" for role in ("worker", "ps", "chief", "evaluator") for what in ("cpu", "memory")),
    )}
    try:
        job = K8sJob(command=command, **fields)
    except ValueError as e:
        parser.error(as_option(str(e)))
    header = (f"# psclient k8s: job {job.name}, {job.workers} worker(s), {job.ps} ps"
              f"{', an evaluator' if job.evaluator else ''}. kubectl apply -f this file.\n")
    try:
        text = to_yaml(manifests(job), header=header)
    except ImportError as e:  # PyYAML, an extra: say how to get it.
        print(f"psclient k8s: error: {e}", file=sys.stderr, flush=True)
        return 1
    sys.stdout.write(text)
    sys.stdout.flush()
    return 0


_DEMO_EPILOG = """\
example:
  pip install -e ".[examples]" && psclient demo

It starts a local cluster (2 workers, 1 ps on 127.0.0.1), trains a Keras 3
classifier with model.fit on scikit-learn's bundled digits (offline), runs
the sidecar evaluator beside it in its own process, and prints the test
accuracy and where the checkpoints and TensorBoard logs are. About a minute
on 2 cores. Task servers accept unauthenticated RPCs; on Linux, its ports
drop every packet that does not come over loopback, but other users of this
machine can still reach them.
"""


def _add_demo_parser(commands: argparse._SubParsersAction) -> None:
    demo = commands.add_parser(
        "demo",
        help="train on a local cluster with a sidecar evaluator, end to end (offline)",
        description="psclient's main example, end to end: fit on a local cluster, evaluate beside it.",
        epilog=_DEMO_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    demo.add_argument("--epochs", type=int, default=8, metavar="N", help="training epochs (default: 8)")
    demo.add_argument("--workdir", metavar="DIR",
                      help="where checkpoints and logs go (default: a new directory under the temp dir)")
    demo.set_defaults(handler=_run_demo, command_parser=demo)


def _run_demo(args: argparse.Namespace) -> int:
    try:
        check_positive("epochs", args.epochs, integer=True)
    except ValueError as e:
        args.command_parser.error(as_option(str(e)))
    from psclient._demo import run

    try:
        return run(epochs=args.epochs, workdir=args.workdir)
    except KeyboardInterrupt:
        print("psclient demo: interrupted; everything it started is stopped", file=sys.stderr, flush=True)
        sys.stdout.flush()
        # Everything it started is stopped (each wait on the way had a deadline).
        # What is left is the interpreter's own exit, whose final garbage
        # collection over TensorFlow's and Keras's objects took 20-40 s on a
        # loaded 2-core machine (py-spy: gc_collect_main, no Python frame):
        # an interrupted user waits for nothing of theirs there.
        os._exit(130)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="psclient",
        description="Parameter-server training for TensorFlow 2 and Keras 3.",
        epilog=_MAIN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(title="commands", dest="command", metavar="COMMAND")
    _add_demo_parser(commands)
    add_serve_parser(commands)
    _add_launch_parser(commands)
    _add_evaluate_parser(commands)
    _add_k8s_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `psclient` command; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    return args.handler(args)
