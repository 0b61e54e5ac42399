"""`kubernetes_workers`: the worker pods of a `psclient k8s` job, as a `WorkerWatcher` source.

The job's workers are the pods of its worker StatefulSet, found by the
labels `psclient k8s` gives them. A pod counts once it runs, is Ready and is
not being deleted; its address is its stable DNS name under the job's
headless Service (`NAME-worker-<i>.NAME:<port>`), the name TF_CONFIG uses.
Scaling the StatefulSet up or down then adds or removes workers.

Needs the `kubernetes` package (not a dependency of psclient; pass `api` to
use another client) and, in the coordinator's pod, a service account
allowed to list pods in the namespace: `psclient k8s --max-workers K`
grants the chief that (and only that); without it the manifests keep the API
token out of every pod (docs/kubernetes.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["kubernetes_workers", "worker_labels"]

_NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


def worker_labels(name: str) -> dict[str, str]:
    """The labels `psclient k8s` gives job `name`'s worker pods (k8s.py `K8sJob.labels`)."""
    return {"app.kubernetes.io/name": "psclient", "app.kubernetes.io/instance": name,
            "app.kubernetes.io/component": "worker"}


def _default_api() -> Any:
    try:
        import kubernetes
    except ImportError as e:
        raise ImportError(
            "kubernetes_workers needs the `kubernetes` package, which is not installed. Expected "
            "it installed (pip install kubernetes), or pass api= with a client that has "
            "list_namespaced_pod(namespace, label_selector=...).") from e
    try:
        kubernetes.config.load_incluster_config()
    except kubernetes.config.ConfigException:  # not in a pod: the user's kubeconfig
        kubernetes.config.load_kube_config()
    return kubernetes.client.CoreV1Api()


def _default_namespace() -> str:
    try:
        with open(_NAMESPACE_FILE, encoding="utf-8") as f:
            return f.read().strip() or "default"
    except OSError:
        return "default"


def _ready(pod: Any) -> bool:
    if getattr(pod.metadata, "deletion_timestamp", None) is not None:
        return False  # terminating: it is leaving
    status = pod.status
    if status is None or status.phase != "Running":
        return False
    return any(c.type == "Ready" and c.status == "True" for c in (status.conditions or []))


def _ordinal(pod: Any) -> tuple[int, str]:
    tail = pod.metadata.name.rsplit("-", 1)[-1]
    return (int(tail) if tail.isdigit() else -1, pod.metadata.name)


def kubernetes_workers(name: str, *, namespace: str | None = None, port: int = 2222,
                       api: Any = None) -> Callable[[], list[str]]:
    """A source for `WorkerWatcher`: the ready worker pods of job `name`, as addresses.

    Args:
        name: the job's name (`psclient k8s --name`).
        namespace: where it runs; the pod's own namespace (or "default") when None.
        port: the task port (`psclient k8s --port`).
        api: a Kubernetes CoreV1Api (or anything with its `list_namespaced_pod`);
            made from the in-cluster (or kubeconfig) configuration when None.

    Raises:
        ImportError: `api` is None and the `kubernetes` package is not installed.
        ValueError: `name` or `port` is invalid.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"Invalid value for argument `name`. Received: name={name!r}. "
                         "Expected the job's name, as given to `psclient k8s --name`.")
    if not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 65535:
        raise ValueError(f"Invalid value for argument `port`. Received: port={port!r}. "
                         "Expected an integer in 1..65535.")
    api = _default_api() if api is None else api
    namespace = _default_namespace() if namespace is None else namespace
    selector = ",".join(f"{key}={value}" for key, value in worker_labels(name).items())

    def workers() -> list[str]:
        pods = api.list_namespaced_pod(namespace, label_selector=selector).items
        return [f"{pod.metadata.name}.{name}:{port}" for pod in sorted(pods, key=_ordinal) if _ready(pod)]

    workers.__name__ = f"kubernetes_workers({name!r}, namespace={namespace!r})"
    return workers
