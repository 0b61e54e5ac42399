"""Where each variable lives: byte-balanced placement across ps tasks.

Pure bookkeeping, no TensorFlow. The strategy's variable creator asks
`Placer.choose(nbytes)` for a ps task, creates the variable there, and records
it. Placement is online greedy by size: every new variable goes to the ps task
holding the fewest bytes so far. Round robin (TF's default) balances *counts*,
so a model of kernel/bias pairs ends with every kernel on one ps and every bias
on the other; greedy by bytes keeps the load (memory and bandwidth) even.

A partitioned variable is recorded shard by shard (`part`, `rows`, `of`
say which shard of what); `psclient._core.partitioning` decides its shards'
tasks.

Variables whose ps task is already decided, such as an optimizer's slot that
must sit beside its variable, or a user's explicit `tf.device("/job:ps/task:K")`,
are recorded with `record(...)` so the balance accounts for them.
"""

from __future__ import annotations

import dataclasses
import threading

__all__ = ["VariablePlacement", "Placer"]


@dataclasses.dataclass(frozen=True)
class VariablePlacement:
    """One variable on one ps task."""

    name: str
    shape: tuple
    dtype: str
    nbytes: int
    ps_index: int
    #: Why it is there: "balanced" (the least-loaded task) or "requested" (the
    #: caller chose the task, e.g. `tf.device("/job:ps/task:K")`).
    reason: str = "balanced"
    #: For a shard of a partitioned variable: (index, number of shards), its
    #: rows (start, stop) of the full variable, and the full variable's name.
    part: tuple | None = None
    rows: tuple | None = None
    of: str | None = None


class Placer:
    """Online greedy placement of variables by bytes across `num_ps` tasks."""

    def __init__(self, num_ps: int):
        if not isinstance(num_ps, int) or num_ps < 1:
            raise ValueError(
                f"Invalid value for argument `num_ps`. Received: num_ps={num_ps!r}. "
                "Expected an integer >= 1."
            )
        self._num_ps = num_ps
        self._bytes = [0] * num_ps
        self._placements: list[VariablePlacement] = []
        # Variables may be created from several threads (e.g. per-worker setup).
        self._lock = threading.Lock()

    @property
    def num_ps(self) -> int:
        return self._num_ps

    def choose(self, nbytes: int) -> int:
        """The ps task that should receive a new variable of `nbytes` bytes.

        The least-loaded task; ties go to the lowest index so placement is
        deterministic for a given creation order.
        """
        if nbytes < 0:
            raise ValueError(
                f"Invalid value for argument `nbytes`. Received: nbytes={nbytes!r}. "
                "Expected an integer >= 0."
            )
        with self._lock:
            return min(range(self._num_ps), key=lambda k: (self._bytes[k], k))

    def record(
        self,
        name: str,
        shape,
        dtype: str,
        nbytes: int,
        ps_index: int,
        reason: str = "balanced",
        *,
        part: tuple | None = None,
        rows: tuple | None = None,
        of: str | None = None,
    ) -> VariablePlacement:
        """Account for a variable (or one shard of a partitioned one) now living on `ps_index`."""
        if not 0 <= ps_index < self._num_ps:
            raise ValueError(
                f"Variable {name!r} was placed on ps task {ps_index}, but the cluster "
                f"has ps tasks 0..{self._num_ps - 1}."
            )
        placement = VariablePlacement(
            name=name,
            shape=tuple(shape),
            dtype=str(dtype),
            nbytes=int(nbytes),
            ps_index=ps_index,
            reason=reason,
            part=None if part is None else tuple(part),
            rows=None if rows is None else tuple(rows),
            of=of,
        )
        with self._lock:
            self._bytes[ps_index] += placement.nbytes
            self._placements.append(placement)
        return placement

    def bytes_per_ps(self) -> list[int]:
        with self._lock:
            return list(self._bytes)

    def report(self) -> dict:
        """A plain-data summary: every variable's task and the bytes per task."""
        with self._lock:
            return {
                "variables": [dataclasses.asdict(p) for p in self._placements],
                "bytes_per_ps": list(self._bytes),
            }
