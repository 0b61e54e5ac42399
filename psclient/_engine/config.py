"""`StrategyConfig`: what `ParameterServerStrategy` is asked to do, checked once.

A frozen dataclass of the strategy's keyword arguments. Every value is
checked in `__post_init__`, so a bad one fails where the config is made,
with the message the strategy's keyword argument gives. What depends on the
cluster (`replicas_to_aggregate` against the number of workers, "auto"
partitioning against the number of ps tasks) is checked when the strategy
connects (`check_for`). Pure: no TensorFlow.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable

from psclient._core.checks import check_port, check_positive
from psclient._core.checks import with_overrides as replaced
from psclient._core.part_recovery import resolve_ps_recovery
from psclient._core.partitioning import check_partitioner

__all__ = ["StrategyConfig", "check_replicas", "with_overrides"]


@dataclasses.dataclass(frozen=True)
class StrategyConfig:
    """The keyword arguments of `ParameterServerStrategy`, checked (see its docstring for each).

    `ParameterServerStrategy(cluster, config)` uses it as is;
    `ParameterServerStrategy(cluster, config, hang_timeout=60)` overrides one
    field (`dataclasses.replace` does the same here). A bad value raises
    ValueError or TypeError naming the argument, what was received and what
    was expected.
    """

    pipeline_depth: int = 1
    connect_timeout: float = 30.0
    checkpoint_dir: str | os.PathLike | None = None
    checkpoint_interval: float | None = None
    checkpoint_every: int | None = None
    #: Incremental checkpoints between full ones (`checkpoint_deltas`): every this many seconds
    #: and/or completed closures, each ps writes only the rows changed since the previous checkpoint.
    delta_checkpoint_interval: float | None = None
    delta_checkpoint_every: int | None = None
    checkpoints_to_keep: int = 3
    overwrite_checkpoints: bool = False
    hang_timeout: float = 30.0
    worker_timeout: float = 300.0
    ps_timeout: float = 300.0
    variable_partitioner: Callable | str | None = "auto"
    max_staleness: int | None = None
    replicas_to_aggregate: int | None = None
    measure_staleness: bool | None = None
    metrics_port: int | None = None
    #: What a lost ps that comes back gets from the newest checkpoint: "part" (its own
    #: state only; the other ps keep theirs), "all" (every variable rolls back), or None:
    #: "part" in asynchronous training, "all" with `replicas_to_aggregate` (docs/fault_tolerance.md).
    ps_recovery: str | None = None
    #: Where a DynamicEmbedding with a `capacity` keeps its rows: "dense" (one preallocated
    #: matrix per ps, the default) or "hash" (hash tables, the storage before; for comparisons).
    dynamic_table_storage: str = "dense"
    #: How a checkpoint's cut reads the big variables written by sparse ops (embedding tables and
    #: their slots): "rows" (copied before the cut, training going on; the cut reads again only
    #: the rows written since) or "copy" (read whole in the cut: the pause grows with their bytes).
    checkpoint_cut: str = "rows"

    def __post_init__(self) -> None:
        resolve_ps_recovery(self.ps_recovery, self.replicas_to_aggregate)
        check_positive("max_staleness", self.max_staleness, integer=True, optional=True, allow_zero=True)
        check_positive("replicas_to_aggregate", self.replicas_to_aggregate, integer=True, optional=True)
        if self.max_staleness is not None and self.replicas_to_aggregate is not None:
            raise ValueError(
                f"Invalid value for argument `max_staleness`. Received: max_staleness={self.max_staleness!r} "
                f"with replicas_to_aggregate={self.replicas_to_aggregate!r}. Expected None: synchronous "
                "training applies only gradients computed on the current weights (staleness 0), so "
                "pass one of max_staleness (bounded asynchronous) and replicas_to_aggregate (synchronous)."
            )
        self._check_measure_staleness()
        check_partitioner(self.variable_partitioner)
        for name, integer in (
            ("checkpoint_interval", False),
            ("checkpoint_every", True),
            ("delta_checkpoint_interval", False),
            ("delta_checkpoint_every", True),
            ("checkpoints_to_keep", True),
            ("hang_timeout", False),
            ("worker_timeout", False),
            ("ps_timeout", False),
        ):
            check_positive(name, getattr(self, name), integer=integer, optional="checkpoint_" in name,
                           unit="" if integer else "seconds")
        self._check_checkpoint_dir()
        check_positive("pipeline_depth", self.pipeline_depth, integer=True)
        check_positive("connect_timeout", self.connect_timeout, unit="seconds")
        check_port("metrics_port", self.metrics_port)
        if self.checkpoint_cut not in ("rows", "copy"):
            raise ValueError(
                "Invalid value for argument `checkpoint_cut`. Received: checkpoint_cut="
                f"{self.checkpoint_cut!r}. Expected 'rows' (the default) or 'copy'.")
        if self.dynamic_table_storage not in ("dense", "hash"):
            raise ValueError(
                "Invalid value for argument `dynamic_table_storage`. Received: dynamic_table_storage="
                f"{self.dynamic_table_storage!r}. Expected 'dense' (the default) or 'hash'.")

    # ------------------------------------------------------------ derived
    @property
    def measured(self) -> bool:
        """Whether scheduled steps are instrumented.

        Off by default in asynchronous training: measuring costs one version
        read, one fetch-and-add and one report fetch per step (18% of the steps
        per second of a small fit step here; docs/staleness.md). `max_staleness` and
        `replicas_to_aggregate` need it, so they turn it on.
        """
        if self.measure_staleness is None:
            return self.max_staleness is not None or self.replicas_to_aggregate is not None
        return self.measure_staleness

    @property
    def recovery_mode(self) -> str:
        """`ps_recovery` made concrete: "part" or "all"."""
        return resolve_ps_recovery(self.ps_recovery, self.replicas_to_aggregate)

    @property
    def streaming(self) -> bool:
        """Whether calls are enqueued streaming (more than one in flight per worker)."""
        return self.pipeline_depth > 1

    def check_for(self, num_workers: int) -> None:
        """What depends on the cluster: `replicas_to_aggregate` at most the number of workers."""
        check_replicas(self.replicas_to_aggregate, num_workers)

    # ------------------------------------------------------------- checks
    def _check_measure_staleness(self) -> None:
        value = self.measure_staleness
        needed = self.max_staleness is not None or self.replicas_to_aggregate is not None
        if value is not None and (not isinstance(value, bool) or (needed and not value)):
            raise ValueError(
                "Invalid value for argument `measure_staleness`. Received: measure_staleness="
                f"{value!r} with max_staleness={self.max_staleness!r}, replicas_to_aggregate="
                f"{self.replicas_to_aggregate!r}. Expected True, False or None (the default: measured only "
                "with max_staleness or replicas_to_aggregate, which need it)."
            )

    def _check_checkpoint_dir(self) -> None:
        directory = self.checkpoint_dir
        if directory is not None and not isinstance(directory, (str, os.PathLike)):
            raise TypeError(
                "Invalid value for argument `checkpoint_dir`. Received: "
                f"checkpoint_dir={directory!r} of type {type(directory).__name__}. "
                "Expected a directory path (str or os.PathLike) or None."
            )
        if directory is None and (self.checkpoint_interval or self.checkpoint_every):
            raise ValueError(
                "Invalid value for argument `checkpoint_dir`. Received: checkpoint_dir=None "
                f"with checkpoint_interval={self.checkpoint_interval!r}, checkpoint_every="
                f"{self.checkpoint_every!r}. Expected a directory to write the checkpoints to."
            )
        if directory is None and (self.delta_checkpoint_interval or self.delta_checkpoint_every):
            raise ValueError(
                "Invalid value for argument `checkpoint_dir`. Received: checkpoint_dir=None "
                f"with delta_checkpoint_interval={self.delta_checkpoint_interval!r}, delta_checkpoint_every="
                f"{self.delta_checkpoint_every!r}. Expected a directory to write the full checkpoints "
                "and their deltas to (a delta holds only what changed since the previous checkpoint)."
            )
        overwrite = self.overwrite_checkpoints
        if not isinstance(overwrite, bool) or (overwrite and directory is None):
            raise ValueError(
                "Invalid value for argument `overwrite_checkpoints`. Received: overwrite_checkpoints="
                f"{overwrite!r} with checkpoint_dir={directory!r}. Expected True or "
                "False, and True only with a checkpoint_dir."
            )


def with_overrides(config: StrategyConfig | None, overrides: dict[str, Any]) -> StrategyConfig:
    """`config` (the defaults when None) with the keyword arguments in `overrides` replacing its fields.

    Raises:
        TypeError: `config` is not a StrategyConfig, or a keyword is not one of its fields.
    """
    return replaced(config, StrategyConfig, overrides, "ParameterServerStrategy")


def check_replicas(replicas_to_aggregate: Any, num_workers: int) -> None:
    """`replicas_to_aggregate` is at most the number of workers (it was checked positive before)."""
    if replicas_to_aggregate is not None and replicas_to_aggregate > num_workers:
        raise ValueError(
            "Invalid value for argument `replicas_to_aggregate`. Received: replicas_to_aggregate="
            f"{replicas_to_aggregate!r} with {num_workers} workers. Expected an integer between 1 "
            f"and the number of workers ({num_workers}), or None (asynchronous training)."
        )
