"""Kubernetes manifests for one psclient job: the body of `psclient k8s`.

`manifests(K8sJob(...))` returns the objects of one job as plain dicts, in the
order to apply them; `to_yaml` prints them as one multi-document YAML. Nothing
here talks to a cluster or imports TensorFlow.

The shape of a job named NAME:
- one headless Service NAME (publishing pods before they are ready, since
  task servers must find each other while starting) that gives every pod a
  stable DNS name `NAME-<role>-<i>.NAME`: the addresses in TF_CONFIG;
- StatefulSets NAME-ps and NAME-worker running `psclient serve`. A
  StatefulSet's pod template is shared by its replicas, so each pod reads its
  own ordinal from the `apps.kubernetes.io/pod-index` label (Kubernetes 1.28+)
  into PSCLIENT_TASK_INDEX, which Kubernetes substitutes into TF_CONFIG's
  task index (`$(VAR)` in an env value names an earlier variable);
- a Job NAME-chief running the user's command as the coordinator, restarted
  on failure, with the checkpoint volume at /checkpoints;
- optionally a Job NAME-evaluator running `psclient evaluate` on that volume;
- the PersistentVolumeClaim NAME-checkpoints;
- a NetworkPolicy: only the job's chief, ps and worker pods may reach the task
  port of any pod of the job (task servers take unauthenticated RPCs). Where
  the network plugin ignores NetworkPolicies, `psclient serve`'s own socket
  filter still admits only those pods (by their DNS names, `--peer-hosts`).
"""

from __future__ import annotations

import dataclasses
import json
import posixpath
import re
import types
from collections.abc import Sequence
from typing import Any

from psclient._cluster.spec import Cluster
from psclient._core.checks import check_positive

CHECKPOINT_MOUNT = "/checkpoints"
CHECKPOINT_ENV = "PSCLIENT_CHECKPOINT_DIR"
#: With --metrics-port: the port the chief's script passes as StrategyConfig(metrics_port=...).
METRICS_PORT_ENV = "PSCLIENT_METRICS_PORT"
INDEX_ENV = "PSCLIENT_TASK_INDEX"
POD_INDEX_LABEL = "apps.kubernetes.io/pod-index"
TASK_ROLES = ("chief", "ps", "worker")  # the pods that serve the task port
ROLES = ("chief", "ps", "worker", "evaluator")
DEFAULT_PORT = 2222
DEFAULT_RESOURCES = types.MappingProxyType({  # role: (cpu, memory) requests; memory is also the limit
    "worker": ("2", "4Gi"),
    "ps": ("1", "4Gi"),
    "chief": ("1", "2Gi"),
    "evaluator": ("1", "2Gi"),
})

# A Service name is a DNS-1035 label (a letter first). 45 characters at most:
# a StatefulSet's pods carry the label `controller-revision-hash: <set>-<hash
# of up to 10>`, whose value must fit 63 characters, and the longest set is
# NAME-worker.
MAX_NAME_LENGTH = 45
_NAME = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
# Kubernetes quantities: a decimal number, then a binary (Ki..Ei) or decimal
# (n, u, m, k, M..E) suffix, or a decimal exponent.
_QUANTITY = re.compile(r"^(\d+(\.\d*)?|\.\d+)(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E|[eE][-+]?\d+)?$")
_CALLABLE = re.compile(r"^[^\s:]+:[A-Za-z_][A-Za-z0-9_]*$")


def _invalid(name: str, value: Any, expected: str) -> ValueError:
    return ValueError(f"Invalid value for argument `{name}`. Received: {name}={value!r}. Expected {expected}.")


def _check_quantity(name: str, value: Any) -> None:
    match = isinstance(value, str) and _QUANTITY.match(value)
    if not match or float(match.group(1)) <= 0:
        raise _invalid(name, value, "a positive Kubernetes quantity such as 500m, 2, 4Gi or 512Mi")


@dataclasses.dataclass(frozen=True)
class K8sJob:
    """What `psclient k8s` deploys; every field is checked when it is made.

    Field names are the command's options (`worker_cpu` is `--worker-cpu`),
    so errors name the option the user typed.
    """

    name: str
    image: str
    command: Sequence[str]
    workers: int
    ps: int
    evaluator: bool = False
    evaluator_model: str | None = None
    evaluator_data: str | None = None
    evaluator_checkpoint_dir: str = CHECKPOINT_MOUNT
    port: int = DEFAULT_PORT
    checkpoint_size: str = "10Gi"
    storage_class: str | None = None
    chief_restarts: int = 6
    max_workers: int | None = None
    recycle_when_idle: float | None = None
    #: Prometheus metrics on this port of every pod (scrape annotations added); None: none.
    metrics_port: int | None = None
    worker_cpu: str = DEFAULT_RESOURCES["worker"][0]
    worker_memory: str = DEFAULT_RESOURCES["worker"][1]
    ps_cpu: str = DEFAULT_RESOURCES["ps"][0]
    ps_memory: str = DEFAULT_RESOURCES["ps"][1]
    chief_cpu: str = DEFAULT_RESOURCES["chief"][0]
    chief_memory: str = DEFAULT_RESOURCES["chief"][1]
    evaluator_cpu: str = DEFAULT_RESOURCES["evaluator"][0]
    evaluator_memory: str = DEFAULT_RESOURCES["evaluator"][1]

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.match(self.name) or len(self.name) > MAX_NAME_LENGTH:
            raise _invalid("name", self.name, (
                f"a DNS-1035 label of at most {MAX_NAME_LENGTH} characters: lower-case letters, digits "
                "and '-', starting with a letter and ending with a letter or digit, e.g. mnist-1 "
                "(it names the job's Service, and its pods' DNS names are built from it)"))
        if not isinstance(self.image, str) or not self.image or any(c.isspace() for c in self.image):
            raise _invalid("image", self.image, "a container image reference without spaces, "
                           "e.g. registry.example.com/train:1.0, with psclient and your code in it")
        if isinstance(self.command, str) or not self.command or not all(
                isinstance(a, str) for a in self.command) or not self.command[0]:
            raise ValueError(f"Invalid training command. Received: {self.command!r}. Expected the "
                             "chief's command line after --, e.g. -- python train.py")
        object.__setattr__(self, "command", tuple(self.command))  # frozen: no list to change later
        check_positive("workers", self.workers, integer=True)
        check_positive("ps", self.ps, integer=True)
        check_positive("chief_restarts", self.chief_restarts, integer=True, allow_zero=True)
        if self.max_workers is not None:
            check_positive("max_workers", self.max_workers, integer=True)
            if self.max_workers < self.workers:
                raise _invalid("max_workers", self.max_workers,
                               f"at least --workers ({self.workers}): the most worker pods the job may scale to")
        if self.recycle_when_idle is not None:
            check_positive("recycle_when_idle", self.recycle_when_idle, unit="seconds")
        for name in ("port", "metrics_port"):
            value = getattr(self, name)
            if (value is not None or name == "port") and (
                    not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 65535):
                raise _invalid(name, value, "an integer in 1..65535")
        if self.metrics_port is not None and self.metrics_port == self.port:
            raise _invalid("metrics_port", self.metrics_port, f"another port than --port ({self.port})")
        _check_quantity("checkpoint_size", self.checkpoint_size)
        if self.storage_class is not None and not re.match(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
                                                           self.storage_class):
            raise _invalid("storage_class", self.storage_class, "the name of a StorageClass of your cluster")
        for role in ROLES:
            _check_quantity(f"{role}_cpu", getattr(self, f"{role}_cpu"))
            _check_quantity(f"{role}_memory", getattr(self, f"{role}_memory"))
        self._check_evaluator()

    def _check_evaluator(self) -> None:
        for option in ("evaluator_model", "evaluator_data"):
            value = getattr(self, option)
            if not self.evaluator and value is not None:
                raise _invalid(option, value, "it only together with argument `evaluator` "
                               "(without it no evaluator is deployed)")
            if self.evaluator and value is None:
                raise ValueError(f"Missing argument `{option}`: argument `evaluator` needs both "
                                 "argument `evaluator_model` and argument `evaluator_data`. Expected "
                                 "MODULE:FUNCTION importable in the image, e.g. train:model.")
            if self.evaluator and not (isinstance(value, str) and _CALLABLE.match(value)):
                raise _invalid(option, value, "MODULE:FUNCTION importable in the image (what "
                               "`psclient evaluate` takes), e.g. train:model or /app/train.py:data")
        directory = self.evaluator_checkpoint_dir
        if not isinstance(directory, str) or posixpath.normpath(directory) != directory or not (
                directory == CHECKPOINT_MOUNT or directory.startswith(CHECKPOINT_MOUNT + "/")):
            raise _invalid("evaluator_checkpoint_dir", directory,
                           f"a normalised path on the checkpoint volume: {CHECKPOINT_MOUNT} or under it")
        if not self.evaluator and directory != CHECKPOINT_MOUNT:
            raise _invalid("evaluator_checkpoint_dir", directory,
                           "it only together with argument `evaluator`")

    # Names ----------------------------------------------------------------

    def host(self, role: str, index: int) -> str:
        """The stable DNS name of a pod (resolvable in the job's namespace)."""
        return f"{self.name}-{role}-{index}.{self.name}"

    @property
    def elastic(self) -> bool:
        """Whether worker pods may be added beyond `workers` (up to `max_workers`)."""
        return self.max_workers is not None and self.max_workers > self.workers

    def cluster(self, *, worker_slots: int | None = None) -> Cluster:
        """The cluster every pod's TF_CONFIG names (with `worker_slots` workers: a
        worker pod's own, so that one scaled up to that many finds its index)."""
        jobs = {
            "chief": [f"{self.host('chief', 0)}:{self.port}"],
            "worker": [f"{self.host('worker', i)}:{self.port}" for i in range(worker_slots or self.workers)],
            "ps": [f"{self.host('ps', i)}:{self.port}" for i in range(self.ps)],
        }
        if self.evaluator:
            jobs["evaluator"] = [f"{self.host('evaluator', 0)}:{self.port}"]
        return Cluster(jobs)

    def labels(self, role: str | None = None) -> dict[str, str]:
        labels = {"app.kubernetes.io/name": "psclient", "app.kubernetes.io/instance": self.name}
        if role is not None:
            labels["app.kubernetes.io/component"] = role
        return labels


# Pieces -------------------------------------------------------------------


def _metadata(job: K8sJob, name: str, role: str | None = None) -> dict[str, Any]:
    return {"name": name, "labels": job.labels(role)}


def _resources(job: K8sJob, role: str) -> dict[str, Any]:
    cpu, memory = getattr(job, f"{role}_cpu"), getattr(job, f"{role}_memory")
    # No CPU limit: throttling a task stalls every step that waits on it.
    # A memory limit equal to the request: a task that grows past it is
    # restarted alone, not its neighbours on the node.
    return {"requests": {"cpu": cpu, "memory": memory}, "limits": {"memory": memory}}


def _tf_config_env(job: K8sJob, role: str) -> list[dict[str, Any]]:
    """TF_CONFIG for a pod of `role`: a fixed index for the singletons; for a
    StatefulSet, the pod's ordinal, substituted by Kubernetes."""
    if role in ("chief", "evaluator"):
        return [{"name": "TF_CONFIG", "value": job.cluster().to_tf_config(role, 0)}]
    placeholder = "__psclient_task_index__"
    # A worker pod names every worker slot up to --max-workers, so one the
    # StatefulSet was scaled up to still finds itself; the coordinator's
    # cluster starts with --workers, and adds the others as they appear
    # (psclient.WorkerWatcher with psclient.kubernetes_workers).
    slots = job.max_workers if role == "worker" and job.elastic else None
    text = json.dumps({"cluster": job.cluster(worker_slots=slots).jobs, "task": {"type": role, "index": placeholder}})
    return [
        {"name": INDEX_ENV,
         "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{POD_INDEX_LABEL}']"}}},
        {"name": "TF_CONFIG", "value": text.replace(f'"{placeholder}"', f"$({INDEX_ENV})")},
    ]


def _container(job: K8sJob, role: str, command: Sequence[str], *, checkpoints: bool) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": role,
        "image": job.image,
        "command": list(command),
        "env": _tf_config_env(job, role),
        "resources": _resources(job, role),
    }
    if role in TASK_ROLES:
        container["ports"] = [{"name": "grpc", "containerPort": job.port, "protocol": "TCP"}]
    if job.metrics_port is not None:
        container.setdefault("ports", []).append(
            {"name": "metrics", "containerPort": job.metrics_port, "protocol": "TCP"})
        if role == "chief":  # the script passes it on: StrategyConfig(metrics_port=...)
            container["env"].append({"name": METRICS_PORT_ENV, "value": str(job.metrics_port)})
    if checkpoints:
        container["env"].append({"name": CHECKPOINT_ENV, "value": CHECKPOINT_MOUNT})
        container["volumeMounts"] = [{"name": "checkpoints", "mountPath": CHECKPOINT_MOUNT}]
    return container


def _pod_spec(job: K8sJob, container: dict[str, Any], *, checkpoints: bool) -> dict[str, Any]:
    spec: dict[str, Any] = {
        # A task server runs any op it is sent, file reads included: keep the
        # service account's API token out of its pod.
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "containers": [container],
    }
    if checkpoints:
        spec["volumes"] = [{"name": "checkpoints",
                            "persistentVolumeClaim": {"claimName": f"{job.name}-checkpoints"}}]
    return spec


def _service(job: K8sJob) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(job, job.name),
        "spec": {
            "clusterIP": "None",  # headless: DNS names for the pods themselves
            # Tasks resolve each other (and `psclient serve` its own name) while starting.
            "publishNotReadyAddresses": True,
            "selector": job.labels(),
            "ports": [{"name": "grpc", "port": job.port, "targetPort": job.port, "protocol": "TCP"}],
        },
    }


def _network_policy(job: K8sJob) -> dict[str, Any]:
    peers = dict(job.labels())
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _metadata(job, f"{job.name}-tasks"),
        "spec": {
            "podSelector": {"matchLabels": job.labels()},  # every pod of the job
            "policyTypes": ["Ingress"],
            "ingress": [{
                # The evaluator reads checkpoints only; it never talks to a task.
                "from": [{"podSelector": {
                    "matchLabels": peers,
                    "matchExpressions": [{"key": "app.kubernetes.io/component", "operator": "In",
                                          "values": list(TASK_ROLES)}],
                }}],
                "ports": [{"protocol": "TCP", "port": job.port}],
            }] + ([{
                # Prometheus scrapes from its own namespace: the metrics port (reads
                # only) is open to any pod; the task port stays the job's own.
                "ports": [{"protocol": "TCP", "port": job.metrics_port}],
            }] if job.metrics_port is not None else []),
        },
    }


def _volume_claim(job: K8sJob) -> dict[str, Any]:
    spec: dict[str, Any] = {
        # The chief writes and the evaluator reads at once, maybe from two nodes.
        "accessModes": ["ReadWriteMany" if job.evaluator else "ReadWriteOnce"],
        "resources": {"requests": {"storage": job.checkpoint_size}},
    }
    if job.storage_class is not None:
        spec["storageClassName"] = job.storage_class
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
            "metadata": _metadata(job, f"{job.name}-checkpoints"), "spec": spec}


def peer_hosts(job: K8sJob) -> list[str]:
    """The DNS names of every pod that may talk to a task: the chief's, each ps's and
    each worker slot's (up to --max-workers), under the job's headless Service."""
    return [job.host("chief", 0), *(job.host("ps", i) for i in range(job.ps)),
            *(job.host("worker", i) for i in range(job.max_workers or job.workers))]


def _task_set(job: K8sJob, role: str, replicas: int) -> dict[str, Any]:
    # `psclient serve` closes the task port to all but loopback and these pods
    # (a socket filter: it holds where the network plugin ignores the
    # NetworkPolicy). A pod that does not exist yet, or a worker slot not
    # scaled to, is admitted once its name resolves; names are resolved again
    # while the task runs, so a pod rescheduled at another IP gets back in.
    serve = ["psclient", "serve", "--peer-hosts", ",".join(peer_hosts(job))]
    if job.recycle_when_idle is not None:  # tasks that outlive many coordinators (see server.py)
        serve += ["--recycle-when-idle", f"{job.recycle_when_idle:g}"]
    if job.metrics_port is not None:
        serve += ["--metrics-port", str(job.metrics_port)]
    container = _container(job, role, serve, checkpoints=False)
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": _metadata(job, f"{job.name}-{role}", role),
        "spec": {
            "serviceName": job.name,
            "replicas": replicas,
            "podManagementPolicy": "Parallel",  # no task waits for another to start
            "selector": {"matchLabels": job.labels(role)},
            "template": {"metadata": _pod_metadata(job, role),
                         "spec": _pod_spec(job, container, checkpoints=False)},
        },
    }


def _pod_reader(job: K8sJob) -> list[dict[str, Any]]:
    """With --max-workers: a service account for the chief that may read the
    job's pods (what `kubernetes_workers` lists), and nothing else."""
    name = f"{job.name}-chief"
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _metadata(job, name, "chief"),
         "automountServiceAccountToken": False},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
         "metadata": _metadata(job, f"{job.name}-pod-reader", "chief"),
         "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
         "metadata": _metadata(job, f"{job.name}-pod-reader", "chief"),
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": f"{job.name}-pod-reader"},
         "subjects": [{"kind": "ServiceAccount", "name": name}]},
    ]


def _singleton_job(job: K8sJob, role: str, command: Sequence[str]) -> dict[str, Any]:
    pod = _pod_spec(job, _container(job, role, command, checkpoints=True), checkpoints=True)
    if role == "chief" and job.elastic:
        # Only the chief gets a token, and it can only read the job's pods:
        # it follows the worker StatefulSet as it is scaled.
        pod.update({"serviceAccountName": f"{job.name}-chief", "automountServiceAccountToken": True})
    pod.update({
        "restartPolicy": "OnFailure",
        # The stable name in TF_CONFIG, under the job's headless Service.
        "hostname": f"{job.name}-{role}-0",
        "subdomain": job.name,
    })
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": _metadata(job, f"{job.name}-{role}", role),
        "spec": {
            "backoffLimit": job.chief_restarts,
            # A replacement pod starts only once the old one is gone: never two
            # pods with the same name at once.
            "podReplacementPolicy": "Failed",
            "template": {"metadata": _pod_metadata(job, role), "spec": pod},
        },
    }


def evaluator_command(job: K8sJob) -> list[str]:
    command = ["psclient", "evaluate", "--checkpoint-dir", job.evaluator_checkpoint_dir,
               "--model", job.evaluator_model, "--data", job.evaluator_data]
    return command + (["--metrics-port", str(job.metrics_port)] if job.metrics_port is not None else [])


def _pod_metadata(job: K8sJob, role: str) -> dict[str, Any]:
    """A pod template's labels, and with --metrics-port the annotations Prometheus's
    Kubernetes service discovery reads (the common `prometheus.io/*` convention)."""
    metadata: dict[str, Any] = {"labels": job.labels(role)}
    if job.metrics_port is not None:
        metadata["annotations"] = {"prometheus.io/scrape": "true", "prometheus.io/port": str(job.metrics_port),
                                   "prometheus.io/path": "/metrics"}
    return metadata


def manifests(job: K8sJob) -> list[dict[str, Any]]:
    """Every object of the job, in the order to apply them (the policy before any pod)."""
    docs = [
        _network_policy(job),
        _service(job),
        _volume_claim(job),
        _task_set(job, "ps", job.ps),
        _task_set(job, "worker", job.workers),
        *(_pod_reader(job) if job.elastic else []),
        _singleton_job(job, "chief", job.command),
    ]
    if job.evaluator:
        docs.append(_singleton_job(job, "evaluator", evaluator_command(job)))
    return docs


def to_yaml(docs: Sequence[dict[str, Any]], *, header: str = "") -> str:
    """One multi-document YAML (PyYAML, imported here: only this command needs it)."""
    try:
        import yaml
    except ImportError as e:
        raise ImportError("psclient k8s writes YAML with PyYAML, which is not installed. "
                          "Expected it installed: pip install 'psclient[k8s]' (or pip install pyyaml).") from e
    body = yaml.safe_dump_all(docs, sort_keys=False, default_flow_style=False, width=2**16,
                              explicit_start=True)
    return header + body
