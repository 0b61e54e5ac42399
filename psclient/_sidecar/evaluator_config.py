"""`EvaluatorConfig`: how a `SidecarEvaluator` watches, logs and picks its best model, checked once.

`SidecarEvaluator(model, data, checkpoint_dir, steps, max_evaluations,
callbacks)` keeps TF's own six arguments; everything else psclient adds is a
field here, as `StrategyConfig` is for the strategy:
`SidecarEvaluator(model, data, "/ckpts", config=EvaluatorConfig(idle_timeout=60))`,
or the same field as a keyword (`SidecarEvaluator(..., idle_timeout=60)`),
which replaces the config's. Every value is checked in `__post_init__`, so a
bad one fails where it is written (and, for `psclient evaluate`, before the
model and the data are built). Pure: no TensorFlow.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Callable

from psclient._core.checks import check_positive

__all__ = ["EvaluatorConfig", "check_watch"]

#: Metric names for which a larger value is better (`best_mode="auto"`).
_HIGHER_IS_BETTER = ("acc", "auc", "precision", "recall", "f1")


@dataclasses.dataclass(frozen=True)
class EvaluatorConfig:
    """A `SidecarEvaluator`'s options beyond TF's six arguments (see its docstring for each).

    A bad value raises ValueError or TypeError naming the argument, what was
    received and what was expected.
    """

    log_dir: str | os.PathLike | None = None
    idle_timeout: float | None = 600.0
    settle_time: float = 2.0
    poll_interval: float = 1.0
    model_key: str = "model"
    export_best: str | os.PathLike | None = None
    best_metric: str = "loss"
    best_mode: str = "auto"
    #: The evaluator's clock (seconds, monotonic): a test passes a fake one.
    clock: Callable[[], float] = time.monotonic

    def __post_init__(self) -> None:
        check_positive("idle_timeout", self.idle_timeout, optional=True, finite=True, unit="seconds")
        check_positive("settle_time", self.settle_time, allow_zero=True, finite=True, unit="seconds")
        check_positive("poll_interval", self.poll_interval, finite=True, unit="seconds")
        for name in ("log_dir", "export_best"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (str, os.PathLike)):
                raise TypeError(f"Invalid value for argument `{name}`. Received: {name}={value!r} of type "
                                f"{type(value).__name__}. Expected a path (str or os.PathLike) or None.")
        if self.export_best is not None and not os.fspath(self.export_best).endswith(".keras"):
            raise ValueError(f"Invalid value for argument `export_best`. Received: {self.export_best!r}. "
                             "Expected a path ending in '.keras'.")
        if self.best_mode not in ("auto", "max", "min"):
            raise ValueError(f"Invalid value for argument `best_mode`. Received: {self.best_mode!r}. "
                             "Expected 'auto', 'max' or 'min'.")
        for name in ("model_key", "best_metric"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"Invalid value for argument `{name}`. Received: {name}={value!r}. "
                                 "Expected a non-empty string.")
        if not callable(self.clock):
            raise TypeError(f"Invalid value for argument `clock`. Received: clock={self.clock!r}. "
                            "Expected a callable returning seconds (time.monotonic).")

    # ------------------------------------------------------------ derived
    @property
    def export_best_path(self) -> str | None:
        """`export_best` made absolute (None without one)."""
        return None if self.export_best is None else os.path.abspath(os.fspath(self.export_best))

    @property
    def higher_is_better(self) -> bool:
        """`best_mode` made concrete: "auto" is "max" for accuracy-like metric names."""
        if self.best_mode == "auto":
            return any(name in self.best_metric for name in _HIGHER_IS_BETTER)
        return self.best_mode == "max"

    def log_dir_for(self, checkpoint_dir: str) -> str:
        """Where summaries go: `log_dir` made absolute, by default `<checkpoint_dir>/eval`."""
        return os.path.join(checkpoint_dir, "eval") if self.log_dir is None else os.path.abspath(os.fspath(self.log_dir))


def check_watch(checkpoint_dir: Any, steps: Any, max_evaluations: Any) -> str:
    """TF's positional arguments checked (ValueError naming the argument); `checkpoint_dir` made absolute."""
    if not isinstance(checkpoint_dir, (str, os.PathLike)):
        raise TypeError(f"Invalid value for argument `checkpoint_dir`. Received: checkpoint_dir={checkpoint_dir!r} "
                        f"of type {type(checkpoint_dir).__name__}. Expected the directory training writes "
                        "checkpoints to (str or os.PathLike).")
    directory = os.path.abspath(os.fspath(checkpoint_dir))
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise ValueError(f"Invalid value for argument `checkpoint_dir`. Received: checkpoint_dir={checkpoint_dir!r}, "
                         "which is a file, not a directory. Expected the directory training writes checkpoints to.")
    check_positive("steps", steps, integer=True, optional=True)
    check_positive("max_evaluations", max_evaluations, integer=True, optional=True)
    return directory
