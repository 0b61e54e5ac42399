"""`psclient serve`: its options, the cluster it reads (a file or TF_CONFIG), and its restart command.

The command-line face of `server.serve`; `psclient._cli` adds it to the
`psclient` command.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

from psclient._cluster import server as _server
from psclient._cluster.spec import (
    Cluster,
    cluster_from_config,
    parse_config_json,
    read_tf_config,
    task_from_config,
)
from psclient._core.checks import as_option, check_port, check_positive
from psclient._core.metrics import MetricsServer, task_families
from psclient._core.errors import ClusterConfigError

_SERVE_EPILOG = """\
example:
  $ cat cluster.json
  {"worker": ["10.0.0.1:2222", "10.0.0.2:2222"], "ps": ["10.0.0.3:2222"], "chief": ["10.0.0.4:2222"]}
  $ psclient serve --job worker --index 0 --cluster cluster.json

  # Or, with TF_CONFIG naming the cluster and this task:
  $ TF_CONFIG='{"cluster": {...}, "task": {"type": "ps", "index": 0}}' psclient serve

The task runs until SIGTERM or SIGINT, then exits with status 0.
Task servers accept unauthenticated RPCs and TensorFlow binds ALL network
interfaces. So the task's port drops every packet that comes neither over
loopback nor from the cluster's hosts (all jobs but "evaluator"; the cluster
must name the coordinator as "chief"). Linux only: elsewhere, and for a port
open to any host, pass --allow-any-host.
"""


def add_serve_parser(commands: argparse._SubParsersAction) -> None:
    serve = commands.add_parser(
        "serve",
        help="run one worker or ps task server",
        description="Run one TensorFlow task server (a worker or ps task) of a "
        "psclient cluster, until SIGTERM or SIGINT.",
        epilog=_SERVE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    serve.add_argument("--job", choices=("worker", "ps"), help="the task's job (default: TF_CONFIG's task)")
    serve.add_argument("--index", type=int, help="the task's index in its job (default: TF_CONFIG's task)")
    serve.add_argument(
        "--cluster",
        metavar="FILE.json",
        help="JSON file: a dict of jobs, or a TF_CONFIG-style object with a "
        '"cluster" key (default: the TF_CONFIG environment variable)',
    )
    serve.add_argument(
        "--inter-op-threads",
        type=int,
        metavar="N",
        help="TensorFlow inter-op threads, at least 2 (default: max(CPU count, workers + 1))",
    )
    who_gets_in = serve.add_mutually_exclusive_group()
    who_gets_in.add_argument(
        "--allow-any-host",
        action="store_true",
        help="leave this task's port open to every host that reaches it (a warning says so). By "
        "default it drops every packet that comes neither over loopback nor from the cluster's "
        'hosts (all jobs but "evaluator", names resolved again every few seconds; the cluster '
        'must name a "chief", the coordinator). The default needs Linux; no privilege',
    )
    who_gets_in.add_argument(
        "--restrict-to-peers",
        action="store_true",
        help="the default (kept for command lines written when it was an option)",
    )
    serve.add_argument(
        "--peers-file",
        metavar="FILE.json",
        help="also admit the hosts of this JSON cluster file (same format as --cluster), read "
        "again whenever it changes, for workers that join later from other hosts (the file a "
        "psclient.WorkerWatcher follows)",
    )
    serve.add_argument(
        "--peer-hosts",
        metavar="HOST,...",
        help="also admit these hosts, each once it resolves: names that may not resolve yet "
        "(Kubernetes pods not yet scheduled; psclient k8s passes the job's pod names). A cluster "
        "host named here may resolve late too",
    )
    serve.add_argument(
        "--recycle-when-idle",
        type=float,
        metavar="S",
        help="restart this task in place (same pid and port) once no connection has been open to "
        "its port for S seconds after a coordinator used it: TensorFlow keeps part of every "
        "coordinator's context (threads, memory) for good, and only a fresh process gives it back. "
        "Linux only (default: never)",
    )
    serve.add_argument(
        "--metrics-port",
        type=int,
        metavar="PORT",
        help="serve Prometheus metrics on this port of every interface (the task's resident memory "
        "and CPU, which task it is; docs/metrics.md). The port is not filtered: it answers reads only",
    )
    # Used by LocalCluster only: see psclient._cluster.server.serve.
    serve.add_argument("--ready-fd", type=int, help=argparse.SUPPRESS)
    # LocalCluster's starter of tasks (psclient/_cluster/forkserver.py): its control socket.
    serve.add_argument("--fork-server", type=int, metavar="FD", help=argparse.SUPPRESS)
    serve.add_argument("--parent-fd", type=int, help=argparse.SUPPRESS)
    serve.set_defaults(handler=_run_serve, command_parser=serve)


def _load_config_file(path: str) -> tuple[Cluster, tuple[str, int] | None]:
    """The cluster (and task, if named) of a cluster file."""
    source = f"cluster file {path!r}"
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ClusterConfigError(
            f"Cannot read --cluster {path!r}: {e.strerror}. Expected a readable JSON file."
        ) from e
    config = parse_config_json(text, source=source)
    if isinstance(config, dict) and "cluster" in config:
        return cluster_from_config(config, source=source), task_from_config(config, source=source)
    if not isinstance(config, dict):
        raise ClusterConfigError(
            f"Invalid {source}. Received: {text[:200]!r}. Expected a JSON object of jobs "
            'like {"worker": ["host:port"], "ps": ["host:port"]}.'
        )
    try:
        return Cluster(config), None
    except ClusterConfigError as e:
        raise ClusterConfigError(f"Invalid {source}: {e}") from e


def _load_tf_config() -> tuple[Cluster, tuple[str, int] | None]:
    if not os.environ.get("TF_CONFIG", "").strip():
        raise ClusterConfigError(
            "No cluster given: pass --cluster FILE.json or set the TF_CONFIG "
            "environment variable (TF_CONFIG is not set)."
        )
    config = read_tf_config()
    return cluster_from_config(config, source="TF_CONFIG"), task_from_config(config, source="TF_CONFIG")


def resolve_task(
    args: argparse.Namespace, cluster: Cluster, task: tuple[str, int] | None
) -> tuple[str, int]:
    """--job and --index, defaulting to the configuration's task."""
    job, index = args.job, args.index
    if job is None:
        if task is None:
            raise ValueError("--job is required when the configuration names no task.")
        if task[0] not in ("worker", "ps"):
            raise ValueError(
                f"The configuration's task is {task[0]}:{task[1]}, but psclient serve runs "
                "only 'worker' and 'ps' tasks. Expected --job worker or --job ps."
            )
        job = task[0]
    if index is None:
        if task is None or task[0] != job:
            raise ValueError(f"--index is required: the configuration names no {job} task.")
        index = task[1]
    count = len(cluster.jobs[job])
    if not 0 <= index < count:
        raise ValueError(
            f"Invalid value for --index. Received: {index}. Expected an integer in "
            f"0..{count - 1}: the cluster has {count} {job} task(s)."
        )
    return job, index


def serve_main(options: list[str]) -> int:
    """`psclient serve` with these options (a task forked by a fork server runs this)."""
    parser = argparse.ArgumentParser(prog="psclient")
    add_serve_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", *options])
    return args.handler(args)


def _run_serve(args: argparse.Namespace) -> int:
    if args.fork_server is not None:
        from psclient._cluster import fork_serving

        return fork_serving.serve_forks(args.fork_server, _server._import_tensorflow, serve_main)
    try:
        if args.inter_op_threads is not None:
            _server.check_inter_op_threads(args.inter_op_threads, name="--inter-op-threads")
        check_positive("recycle_when_idle", args.recycle_when_idle, optional=True, unit="seconds")
        cluster, task = _load_config_file(args.cluster) if args.cluster else _load_tf_config()
        job, index = resolve_task(args, cluster, task)
        later = peer_hosts_option(args.peer_hosts)
        for option, value in (("--peers-file", args.peers_file), ("--peer-hosts", args.peer_hosts)):
            if value is not None and args.allow_any_host:
                raise ValueError(f"Invalid value for {option}. Received: {value!r} with --allow-any-host, "
                                 "which admits every host. Expected one or the other.")
        check_port("metrics_port", args.metrics_port)
    except ValueError as e:  # ClusterConfigError is a ValueError.
        args.command_parser.error(as_option(str(e)))  # Prints usage and the message; exits 2.
    metrics = None if args.metrics_port is None else MetricsServer(
        args.metrics_port, functools.partial(task_families, job, index))
    try:
        return _serve(args, cluster, job, index, later)
    finally:
        if metrics is not None:
            metrics.close()


def _serve(args: argparse.Namespace, cluster: Cluster, job: str, index: int, later: list[str]) -> int:
    return _server.serve(
        cluster,
        job,
        index,
        inter_op_threads=args.inter_op_threads,
        ready_fd=args.ready_fd,
        parent_fd=args.parent_fd,
        allow_any_host=args.allow_any_host,
        peer_hosts_later=later,
        peers_file=args.peers_file,
        recycle_when_idle=args.recycle_when_idle,
        restart_argv=serve_again_argv(args, job, index) if args.recycle_when_idle is not None else None,
    )


def peer_hosts_option(value: str | None) -> list[str]:
    """The hosts of --peer-hosts ("a,b,c"), each checked to be a host name or address."""
    if value is None:
        return []
    hosts = [host.strip() for host in value.split(",") if host.strip()]
    for host in hosts:
        # One colon is a port ("host:2222"); IPv6 addresses have more.
        if host.count(":") == 1 or any(c.isspace() or c in "/@" for c in host):
            raise ValueError(f"Invalid value for --peer-hosts. Received: {value!r}. Expected host "
                             "names or addresses separated by commas, without ports, e.g. "
                             "job-ps-0.job,job-worker-0.job")
    if not hosts:
        raise ValueError(f"Invalid value for --peer-hosts. Received: {value!r}. Expected at least "
                         "one host name or address, e.g. job-ps-0.job,job-worker-0.job")
    return hosts


def serve_again_argv(args: argparse.Namespace, job: str, index: int) -> list[str]:
    """The command that serves the same task again, for a restart in place:
    no --ready-fd (nobody waits for that one), paths made absolute."""
    argv = [sys.executable, "-m", "psclient", "serve", "--job", job, "--index", str(index)]
    if args.cluster:
        argv += ["--cluster", os.path.abspath(args.cluster)]
    if args.inter_op_threads is not None:
        argv += ["--inter-op-threads", str(args.inter_op_threads)]
    if args.allow_any_host:
        argv.append("--allow-any-host")
    if args.peers_file is not None:
        argv += ["--peers-file", os.path.abspath(args.peers_file)]
    if args.peer_hosts is not None:
        argv += ["--peer-hosts", args.peer_hosts]
    if args.parent_fd is not None:
        argv += ["--parent-fd", str(args.parent_fd)]
    if args.metrics_port is not None:
        argv += ["--metrics-port", str(args.metrics_port)]
    return argv + ["--recycle-when-idle", repr(args.recycle_when_idle)]
