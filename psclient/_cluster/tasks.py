"""Tasks by name and by address, without TensorFlow: device names, TCP reachability.

The coordinator names a task's device the way TF does, and checks that a task
accepts connections before TF's own connect (which can wait far longer).
"""

from __future__ import annotations

import concurrent.futures
import re
import socket
import time

from psclient._cluster.spec import Cluster
from psclient._core.errors import TaskUnreachableError
from psclient._core.tcp_state import TcpState

__all__ = ["ps_device", "ps_index_of", "tcp_reachable", "tcp_state", "wait_reachable", "worker_device"]

_PS_DEVICE = re.compile(r"/job:ps/(?:replica:\d+/)?task:(\d+)")


def worker_device(index: int) -> str:
    return f"/job:worker/replica:0/task:{index}"


def ps_device(index: int) -> str:
    return f"/job:ps/replica:0/task:{index}/device:CPU:0"


def ps_index_of(device: str | None) -> int | None:
    """The ps task index named by a device string, or None if it names no ps task."""
    if not device:
        return None
    match = _PS_DEVICE.search(device)
    return int(match.group(1)) if match else None


def tcp_state(address: str, timeout: float) -> TcpState:
    """What a TCP connect to `address` ("host:port") gets within `timeout`.

    OPEN: something accepts connections. CLOSED: a definite no (refused,
    unreachable): the process is gone. SILENT: no answer at all, as from a
    host cut off by the network; like a hung task, it may answer again.
    """
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            return TcpState.OPEN
    except TimeoutError:  # socket.timeout: the connect got no answer in time
        return TcpState.SILENT
    except OSError:
        return TcpState.CLOSED


def tcp_reachable(address: str, timeout: float) -> bool:
    """Whether something accepts TCP connections at `address` ("host:port")."""
    return tcp_state(address, timeout) is TcpState.OPEN


def wait_reachable(cluster: Cluster, timeout: float) -> None:
    """Wait until every worker and ps task accepts connections, or raise.

    TF's own connect can wait for a missing task far longer than anyone wants
    (gRPC keeps retrying), so the coordinator checks reachability itself first,
    all tasks in parallel, against one deadline.
    """
    deadline = time.monotonic() + timeout
    tasks = cluster.tasks()

    def wait_one(address: str) -> bool:
        while True:
            left = deadline - time.monotonic()
            if tcp_reachable(address, timeout=max(0.05, min(1.0, left))):
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            # Back off briefly between attempts; the task may still be starting.
            time.sleep(min(0.2, left))

    with concurrent.futures.ThreadPoolExecutor(max_workers=min(32, len(tasks))) as pool:
        reachable = list(pool.map(lambda t: wait_one(t[2]), tasks))
    missing = [t for t, ok in zip(tasks, reachable) if not ok]
    if missing:
        job, index, address = missing[0]
        names = ", ".join(f"{j}:{i} at {a}" for j, i, a in missing)
        raise TaskUnreachableError(
            f"Cannot reach task {job}:{index} at {address}: nothing accepted a connection "
            f"within connect_timeout={timeout:g} s (unreachable: {names}). Check that "
            "`psclient serve` runs there and that the address and port are right.",
            task=f"{job}:{index}",
            address=address,
        )
