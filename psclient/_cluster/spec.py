"""`Cluster`: an immutable, validated description of a parameter-server cluster.

A cluster maps job names ("worker", "ps", optionally "chief" and "evaluator")
to the "host:port" addresses of their tasks. Every other way TensorFlow spells
a cluster (a dict, a `tf.train.ClusterSpec`, a cluster resolver, the TF_CONFIG
environment variable) is converted into a `Cluster` at the edge, so the rest of
psclient sees one checked type and users see mistakes where they made them.

This module is pure Python: TensorFlow is imported only by `to_cluster_spec`.
ClusterSpecs and resolvers are recognised by their methods, so `Cluster.coerce`
never pays for importing TensorFlow.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

from psclient._core.errors import ClusterConfigError

# Jobs TensorFlow's own tools treat as singletons.
_SINGLE_TASK_JOBS = ("chief", "evaluator")
_JOB_ORDER = ("chief", "worker", "ps", "evaluator")
_ADDRESS_EXPECTED = "Expected 'host:port' with a port in 1..65535"
_HOSTNAME = re.compile(r"^[A-Za-z0-9_]([A-Za-z0-9_\-]*[A-Za-z0-9_])?$")


def _is_decimal(text: str) -> bool:
    return text.isascii() and text.isdigit()  # str.isdigit() alone accepts '²'.


def _address_problem(address: Any) -> str | None:
    """Returns why `address` is not a valid 'host:port' string, or None."""
    if not isinstance(address, str):
        return f"its type is {type(address).__name__}, not str"
    host, sep, port = address.rpartition(":")
    if not sep:
        return "it has no ':port' part"
    if not host:
        return "it has no host"
    if not _is_decimal(port) or not 1 <= int(port) <= 65535:
        return f"port {port!r} is not an integer in 1..65535"
    if host.startswith("["):
        if not host.endswith("]"):
            return f"IPv6 host {host!r} has no closing ']'"
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            return f"{host!r} is not a valid IPv6 address"
        return None
    if ":" in host:
        return "an IPv6 host must be written in brackets, like '[::1]:2222'"
    if all(_is_decimal(part) for part in host.split(".")):
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            return f"{host!r} is not a valid IPv4 address"
        return None
    if not all(_HOSTNAME.match(label) for label in host.split(".")):
        return f"{host!r} is not a valid hostname"
    return None


#: Why an address is not a valid 'host:port' string, or None (for other modules' messages).
address_problem = _address_problem


def _check_address(job: str, index: int, address: Any) -> str:
    problem = _address_problem(address)
    if problem is not None:
        raise ClusterConfigError(
            f"Invalid address for task {job}:{index}. Received: {address!r} "
            f"({problem}). {_ADDRESS_EXPECTED}."
        )
    return address


def _dense_indices(job: str, tasks: Mapping[Any, Any]) -> list[Any]:
    """Orders a sparse {index: address} job, which must cover 0..n-1 exactly."""
    by_index = {}
    for key, address in tasks.items():
        index = key
        if isinstance(key, str) and _is_decimal(key):  # JSON object keys are strings.
            index = int(key)
        if not isinstance(index, int) or isinstance(index, bool):
            raise ClusterConfigError(
                f"Invalid task index in job {job!r}. Received: {key!r}. "
                "Expected an integer index."
            )
        if index in by_index:
            raise ClusterConfigError(
                f"Duplicate task index {index} in job {job!r}. Received: {dict(tasks)!r}."
            )
        by_index[index] = address
    if sorted(by_index) != list(range(len(by_index))):
        raise ClusterConfigError(
            f"Invalid task indices for job {job!r}. Received: {sorted(by_index)}. "
            f"Expected the indices 0..{len(by_index) - 1} with none missing: psclient "
            "addresses tasks by position."
        )
    return [by_index[i] for i in range(len(by_index))]


def _normalise_job(job: Any, tasks: Any) -> tuple[str, ...]:
    if not isinstance(job, str) or not job:
        raise ClusterConfigError(
            f"Invalid job name. Received: {job!r}. Expected a non-empty string "
            "such as 'worker' or 'ps'."
        )
    if isinstance(tasks, Mapping):
        tasks = _dense_indices(job, tasks)
    elif isinstance(tasks, (str, bytes)) or not isinstance(tasks, Sequence):
        raise ClusterConfigError(
            f"Invalid tasks for job {job!r}. Received: {tasks!r}. Expected a list "
            "of 'host:port' strings or a dict {index: 'host:port'}."
        )
    if not tasks:
        raise ClusterConfigError(
            f"Job {job!r} has no tasks. Received: {job}={list(tasks)!r}. "
            "Expected at least one 'host:port' address."
        )
    if job in _SINGLE_TASK_JOBS and len(tasks) != 1:
        raise ClusterConfigError(
            f"Job {job!r} must have exactly one task. Received: {job}={list(tasks)!r}."
        )
    return tuple(_check_address(job, i, a) for i, a in enumerate(tasks))


def _job_sort_key(job: str) -> tuple[int, str]:
    return (_JOB_ORDER.index(job) if job in _JOB_ORDER else len(_JOB_ORDER), job)


class Cluster:
    """An immutable cluster description: job name -> tuple of 'host:port' addresses.

    A cluster needs at least one "worker" and one "ps" task; "chief" (the
    coordinator's own address) and "evaluator" are optional and have one task
    each. Every address is a distinct 'host:port' string.

    Example:

    >>> c = Cluster({"worker": ["w0:2222", "w1:2222"], "ps": ["p0:2222"]})
    >>> c.num_workers, c.ps
    (2, ('p0:2222',))

    Raises:
        ClusterConfigError: the description is malformed; the message names
            the job and task, quotes the bad value, and says what was expected.
    """

    __slots__ = ("_jobs",)

    def __init__(self, jobs: Mapping[str, Sequence[str] | Mapping[int, str]]):
        if not isinstance(jobs, Mapping):
            raise ClusterConfigError(
                f"Invalid cluster. Received: {jobs!r}. Expected a dict mapping job "
                "names to lists of 'host:port' addresses (Cluster.coerce also takes "
                "ClusterSpecs and cluster resolvers)."
            )
        normalised = {job: _normalise_job(job, tasks) for job, tasks in jobs.items()}
        for required in ("worker", "ps"):
            if required not in normalised:
                raise ClusterConfigError(
                    f"The cluster has no {required!r} job. Received jobs: "
                    f"{sorted(normalised)}. Expected at least one 'worker' and one 'ps' task."
                )
        self._check_unique(normalised)
        self._jobs = {job: normalised[job] for job in sorted(normalised, key=_job_sort_key)}

    @staticmethod
    def _check_unique(jobs: Mapping[str, tuple[str, ...]]) -> None:
        owner: dict[str, str] = {}
        for job, addresses in jobs.items():
            for index, address in enumerate(addresses):
                task = f"{job}:{index}"
                if address in owner:
                    raise ClusterConfigError(
                        f"Duplicate address {address!r} for tasks {owner[address]} and "
                        f"{task}. Expected every task to have its own address."
                    )
                owner[address] = task

    # Constructors ---------------------------------------------------------

    @classmethod
    def from_dict(cls, jobs: Mapping[str, Any]) -> Cluster:
        """Builds a cluster from a dict of jobs, e.g. TF_CONFIG's "cluster" value."""
        return cls(jobs)

    @classmethod
    def from_cluster_spec(cls, spec: Any) -> Cluster:
        """Builds a cluster from a `tf.train.ClusterSpec`."""
        return cls(spec.as_dict())

    @classmethod
    def from_resolver(cls, resolver: Any) -> Cluster:
        """Builds a cluster from any `tf.distribute.cluster_resolver.ClusterResolver`."""
        return cls.from_cluster_spec(resolver.cluster_spec())

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Cluster:
        """Builds a cluster from the TF_CONFIG environment variable.

        Args:
            environ: the environment to read; `os.environ` when None.

        Raises:
            ClusterConfigError: TF_CONFIG is not set, is not valid JSON, has no
                usable "cluster" object, or holds a bad address.
        """
        return cluster_from_config(read_tf_config(environ), source="TF_CONFIG")

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> Cluster:
        """Builds a cluster from a JSON file: TF_CONFIG-style {"cluster": ...}, or the jobs alone.

        The file an operator rewrites as workers come and go (`WorkerWatcher`,
        `psclient serve --peers-file`).

        Raises:
            ClusterConfigError: the file cannot be read, is not JSON, or holds a bad cluster.
        """
        source = f"cluster file {os.fspath(path)!r}"
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise ClusterConfigError(f"Cannot read {source}: {e.strerror}. Expected a readable JSON file.") from e
        config = parse_config_json(text, source=source)
        if isinstance(config, dict) and "cluster" in config:
            return cluster_from_config(config, source=source)
        if not isinstance(config, dict):
            raise ClusterConfigError(f"Invalid {source}. Received: {_truncate(text)!r}. Expected a JSON object.")
        try:
            return cls(config)
        except ClusterConfigError as e:
            raise ClusterConfigError(f"Invalid {source}: {e}") from e

    @classmethod
    def coerce(cls, cluster: Any) -> Cluster:
        """Converts a Cluster, LocalCluster, dict, `tf.train.ClusterSpec` or cluster resolver."""
        if isinstance(cluster, Cluster):
            return cluster
        if isinstance(getattr(cluster, "cluster", None), Cluster):
            return cluster.cluster  # a LocalCluster: the cluster of its tasks
        if isinstance(cluster, Mapping):
            return cls.from_dict(cluster)
        if callable(getattr(cluster, "cluster_spec", None)):
            return cls.from_resolver(cluster)
        if callable(getattr(cluster, "as_dict", None)):
            return cls.from_cluster_spec(cluster)
        raise TypeError(
            f"Invalid type for argument `cluster`. Received: {type(cluster).__name__} "
            f"({cluster!r}). Expected a psclient.Cluster or LocalCluster, a dict of jobs, a "
            "tf.train.ClusterSpec or a tf.distribute.cluster_resolver.ClusterResolver."
        )

    # Accessors ------------------------------------------------------------

    @property
    def workers(self) -> tuple[str, ...]:
        return self._jobs["worker"]

    @property
    def ps(self) -> tuple[str, ...]:
        return self._jobs["ps"]

    @property
    def num_workers(self) -> int:
        return len(self._jobs["worker"])

    @property
    def num_ps(self) -> int:
        return len(self._jobs["ps"])

    @property
    def chief(self) -> str | None:
        """The coordinator's address, or None when the cluster names no chief."""
        return self._jobs.get("chief", (None,))[0]

    @property
    def evaluator(self) -> str | None:
        return self._jobs.get("evaluator", (None,))[0]

    @property
    def jobs(self) -> dict[str, list[str]]:
        """A fresh, JSON-ready copy of every job, evaluator included."""
        return {job: list(addresses) for job, addresses in self._jobs.items()}

    def address(self, job: str, index: int) -> str:
        """The address of task `job:index`.

        Raises:
            ValueError: the cluster has no job `job`.
            IndexError: `index` is not a task of that job.
        """
        if job not in self._jobs:
            raise ValueError(
                f"Invalid value for argument `job`. Received: job={job!r}. "
                f"Expected one of {list(self._jobs)}."
            )
        count = len(self._jobs[job])
        if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < count:
            raise IndexError(
                f"Invalid value for argument `index`. Received: index={index!r}. "
                f"Expected an integer in 0..{count - 1} (job {job!r} has {count} tasks)."
            )
        return self._jobs[job][index]

    def tasks(self) -> list[tuple[str, int, str]]:
        """(job, index, address) of every worker and ps task: the task servers."""
        return [
            (job, index, address)
            for job in ("worker", "ps")
            for index, address in enumerate(self._jobs[job])
        ]

    # Conversions ----------------------------------------------------------

    def training_spec(self) -> dict[str, list[str]]:
        """The jobs to give TensorFlow for training: every job but "evaluator".

        An "evaluator" job in the spec that servers and coordinator share makes
        TensorFlow's training hang (the runtime waits for a task that never
        joins training), so it is dropped here. The chief stays.
        """
        return {job: list(a) for job, a in self._jobs.items() if job != "evaluator"}

    def to_cluster_spec(self) -> Any:
        """A `tf.train.ClusterSpec` of `training_spec()`. Imports TensorFlow."""
        # Here, not at the top: Cluster itself is pure Python (`import psclient` is cheap).
        import tensorflow as tf

        return tf.train.ClusterSpec(self.training_spec())

    def to_tf_config(self, task_type: str, task_index: int) -> str:
        """A TF_CONFIG JSON string for task `task_type:task_index`.

        Unlike `training_spec()`, "cluster" keeps the evaluator when there is one:
        TF_CONFIG requires the task's own job in "cluster", so the evaluator
        process needs its entry, and every task should see the same cluster.
        Consumers strip it again before training (`psclient serve` does).
        """
        self.address(task_type, task_index)  # Validates both arguments.
        return json.dumps(
            {"cluster": self.jobs, "task": {"type": task_type, "index": task_index}}
        )

    # Value semantics ------------------------------------------------------

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Cluster):
            return NotImplemented
        return self._jobs == other._jobs

    def __hash__(self) -> int:
        return hash(frozenset(self._jobs.items()))

    def __repr__(self) -> str:
        return f"Cluster({self.jobs!r})"


# TF_CONFIG parsing ------------------------------------------------------------


def _truncate(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def parse_config_json(text: str, *, source: str) -> Any:
    """`json.loads(text)`, with an error that quotes the text around the mistake.

    `source` names where the text came from ("TF_CONFIG", a file path).
    """
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        start, end = max(0, e.pos - 30), e.pos + 30
        near = ("..." if start else "") + text[start:end] + ("..." if end < len(text) else "")
        raise ClusterConfigError(
            f"{source} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}, "
            f"near: {near!r}. Expected a JSON object like "
            '{"cluster": {"worker": ["host:port"], "ps": ["host:port"]}}.'
        ) from e


def read_tf_config(environ: Mapping[str, str] | None = None) -> Any:
    """The parsed TF_CONFIG of `environ` (default `os.environ`)."""
    environ = os.environ if environ is None else environ
    text = environ.get("TF_CONFIG")
    if text is None or not text.strip():
        raise ClusterConfigError(
            "TF_CONFIG is not set. Expected the environment variable TF_CONFIG to hold "
            'a JSON object like {"cluster": {"worker": ["host:port"], "ps": ["host:port"]}}.'
        )
    return parse_config_json(text, source="TF_CONFIG")


def cluster_from_config(config: Any, *, source: str) -> Cluster:
    """The `Cluster` of a parsed TF_CONFIG-style object {"cluster": ..., "task": ...}.

    `source` names where the object came from; errors quote the bad part.
    """
    if not isinstance(config, dict):
        raise ClusterConfigError(
            f"{source} must be a JSON object. Received: {_truncate(repr(config))}."
        )
    if "cluster" not in config:
        raise ClusterConfigError(
            f"{source} has no 'cluster' key. Received keys: {sorted(config)}. "
            'Expected {"cluster": {"worker": [...], "ps": [...]}, "task": {...}}.'
        )
    jobs = config["cluster"]
    if not isinstance(jobs, dict):
        raise ClusterConfigError(
            f"Invalid {source}['cluster']. Received: {_truncate(repr(jobs))}. "
            "Expected a JSON object mapping job names to lists of 'host:port' addresses."
        )
    try:
        return Cluster(jobs)
    except ClusterConfigError as e:
        raise ClusterConfigError(f"Invalid {source}['cluster']: {e}") from e


def task_from_config(config: Any, *, source: str) -> tuple[str, int] | None:
    """(type, index) of a parsed TF_CONFIG-style object's "task", or None if absent.

    A missing "index" means 0, as in TensorFlow's TFConfigClusterResolver.
    """
    task = config.get("task") if isinstance(config, dict) else None
    if not task:
        return None
    index = task.get("index", 0) if isinstance(task, dict) else None
    if (
        not isinstance(task, dict)
        or not isinstance(task.get("type"), str)
        or not isinstance(index, int)
        or isinstance(index, bool)
        or index < 0
    ):
        raise ClusterConfigError(
            f"Invalid {source}['task']. Received: {_truncate(repr(task))}. "
            'Expected an object like {"type": "worker", "index": 0}.'
        )
    return task["type"], index


def task_from_env(environ: Mapping[str, str] | None = None) -> tuple[str, int] | None:
    """(type, index) from TF_CONFIG's "task", or None when TF_CONFIG has no task.

    Raises:
        ClusterConfigError: TF_CONFIG is set but malformed, or its "task" is.
    """
    environ = os.environ if environ is None else environ
    if not environ.get("TF_CONFIG", "").strip():
        return None
    return task_from_config(read_tf_config(environ), source="TF_CONFIG")
