"""`SidecarEvaluator`: evaluates the checkpoints that training writes, from its own process.

The evaluator never connects to the training cluster: it only reads the
checkpoint directory. What to read next is decided by `Planner`, plain logic
fed with directory scans and a clock, so its rules are tested without files
or TensorFlow:

- TF `CheckpointManager` checkpoints are read only through the state file,
  which TF writes after the data: they are complete when seen.
- A Keras file (written in place) is read once it has *settled* (same size and
  mtime for `settle_time` seconds) or is *superseded* (a newer checkpoint file
  exists, so Keras has finished it), or is the final marker's checkpoint. A
  failed read of an unsettled file is retried; of a settled one, it is logged
  as unreadable and skipped.
- When several are ready, the newest is evaluated and the older ones are
  logged as skipped.
- It stops after `max_evaluations`, once the final marker's checkpoint is
  evaluated, or after `idle_timeout` seconds without a new checkpoint.

The final marker `psclient-final.json` is written by training at its end
(`write_final_marker`), so the evaluator stops by itself rather than by
guessing from file names.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import tensorflow as tf
from tensorflow.core.framework import summary_pb2

from psclient._core.checks import with_overrides
from psclient._sidecar.evaluator_config import EvaluatorConfig, check_watch
from psclient._core.files import replaced_atomically
from psclient._sidecar import formats
from psclient._sidecar.formats import CheckpointRef, CheckpointUnreadableError

FINAL_MARKER = "psclient-final.json"
METRICS_FILE = "evaluations.jsonl"
_log = logging.getLogger("psclient.sidecar")


# The final marker -------------------------------------------------------------------


def write_final_marker(checkpoint_dir: str | os.PathLike, checkpoint: str | os.PathLike, step: int | None = None) -> str:
    """Marks `checkpoint` as training's last one; returns the marker's path.

    Writes `<checkpoint_dir>/psclient-final.json` = {"checkpoint": path relative
    to the directory, "step": int or null, "written_at": unix time}, atomically
    (a temporary file of an unpredictable name beside it, then `os.replace`), so a reader
    sees the whole marker or none, readable by whoever can read the checkpoints
    (the mode of any new file there). Call it after the checkpoint is saved.
    """
    checkpoint_dir = os.fspath(checkpoint_dir)
    checkpoint = os.fspath(checkpoint)
    if step is not None and (not isinstance(step, int) or isinstance(step, bool)):
        raise TypeError(f"Invalid type for argument `step`. Received: step={step!r}. Expected an int or None.")
    if os.path.isabs(checkpoint):
        checkpoint = os.path.relpath(checkpoint, checkpoint_dir)
    body = json.dumps({"checkpoint": checkpoint, "step": step, "written_at": time.time()})
    path = os.path.join(checkpoint_dir, FINAL_MARKER)
    with replaced_atomically(path) as temp, open(temp, "w", encoding="utf-8") as f:
        f.write(body)
    return path


def read_final_marker(checkpoint_dir: str | os.PathLike) -> dict | None:
    """The final marker of `checkpoint_dir` as a dict, or None when there is none."""
    try:
        with open(os.path.join(os.fspath(checkpoint_dir), FINAL_MARKER), encoding="utf-8") as f:
            marker = json.load(f)
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) and isinstance(marker.get("checkpoint"), str) else None


# The plan: which checkpoint next, and when to stop (no I/O) --------------------------


@dataclass
class Decision:
    action: str  # "evaluate", "wait" or "stop"
    checkpoint: CheckpointRef | None = None
    skipped: list[CheckpointRef] = field(default_factory=list)
    reason: str = ""


class Planner:
    """Decides what the evaluator does after each scan. Pure logic: time is passed in."""

    def __init__(self, *, settle_time: float, idle_timeout: float | None, max_evaluations: int | None, now: float):
        self.settle_time = settle_time
        self.idle_timeout = idle_timeout
        self.max_evaluations = max_evaluations
        self.evaluations = 0
        self._done: set[tuple] = set()  # Versions evaluated, skipped or unreadable.
        self._stable_since: dict[str, tuple[tuple, float]] = {}  # name -> (version, since)
        self._seen: dict[tuple, int] = {}  # version -> its 1-based order of discovery
        self._last_progress = now

    def observe(self, refs: list[CheckpointRef], now: float) -> None:
        for ref in refs:
            previous = self._stable_since.get(ref.name)
            if previous is None or previous[0] != ref.version:
                self._stable_since[ref.name] = (ref.version, now)
            if ref.version not in self._seen:
                self._seen[ref.version] = len(self._seen) + 1
                self._last_progress = now

    def ordinal(self, ref: CheckpointRef) -> int:
        """1 for the first checkpoint version seen, 2 for the next, ..."""
        return self._seen.get(ref.version, len(self._seen) + 1)

    def settled(self, ref: CheckpointRef, now: float) -> bool:
        if ref.kind == formats.TF:
            return True  # Published through the state file only when complete.
        version, since = self._stable_since.get(ref.name, (None, now))
        return version == ref.version and now - since >= self.settle_time

    def decide(self, refs: list[CheckpointRef] | None, marker: dict | None, now: float) -> Decision:
        if self.max_evaluations is not None and self.evaluations >= self.max_evaluations:
            return Decision("stop", reason=f"max_evaluations={self.max_evaluations} reached")
        if refs is None:
            return self._idle(now, "the checkpoint directory does not exist")
        self.observe(refs, now)
        pending = [r for r in refs if r.version not in self._done]
        if marker is not None:
            wanted = os.path.normpath(marker["checkpoint"])
            final = next((r for r in reversed(refs) if os.path.normpath(r.name) == wanted), None)
            if final is None:
                return Decision("stop", reason=f"the final marker names {marker['checkpoint']!r}, "
                                               "which is not a checkpoint in the directory")
            if final.version in self._done:
                return Decision("stop", reason=f"the final checkpoint {final.name} is done")
            return self._choose(final, pending)
        newer = {r.name: any(o.order > r.order and o.kind == r.kind for o in refs) for r in pending}
        ready = [r for r in pending if self.settled(r, now) or newer[r.name]]
        if ready:
            return self._choose(max(ready, key=lambda r: (r.order, r.name)), pending)
        return self._idle(now, "no new checkpoint")

    def _choose(self, ref: CheckpointRef, pending: list[CheckpointRef]) -> Decision:
        # Older ones are passed over only once `ref` is evaluated: if it turns
        # out unreadable, the next newest is still there to evaluate.
        skipped = [r for r in pending if r is not ref and (r.order, r.name) < (ref.order, ref.name)]
        return Decision("evaluate", ref, skipped)

    def _idle(self, now: float, why: str) -> Decision:
        if self.idle_timeout is not None and now - self._last_progress >= self.idle_timeout:
            return Decision("stop", reason=f"{why} for {self.idle_timeout:g} s (idle_timeout)")
        return Decision("wait", reason=why)

    def evaluated(self, decision: Decision, now: float) -> None:
        """Records that `decision.checkpoint` was evaluated and its older ones skipped."""
        self._done.add(decision.checkpoint.version)
        self._done.update(r.version for r in decision.skipped)
        self.evaluations += 1
        self._last_progress = now

    def unreadable(self, ref: CheckpointRef, now: float, final: bool = False) -> bool:
        """Records a failed read; True if `ref` is given up (settled), False to retry it."""
        if final or self.settled(ref, now):
            self._done.add(ref.version)
            return True
        return False


def _scalar_metadata() -> Any:
    metadata = summary_pb2.SummaryMetadata()
    metadata.plugin_data.plugin_name = "scalars"
    return metadata


# The evaluator ----------------------------------------------------------------------


@dataclass
class SidecarReport:
    """What a `SidecarEvaluator.start()` run did."""

    evaluations: list[dict]  # One per evaluated checkpoint: checkpoint, step, metrics, ...
    skipped: list[str]  # Checkpoints passed over for a newer one.
    unreadable: list[str]  # Checkpoints that could not be read, with the reason.
    stop_reason: str
    best: dict | None = None  # The exported best evaluation, if export_best was set.


class SidecarEvaluator:
    """Evaluates each new checkpoint that training writes, in a process of its own.

    Example:

        model = build_model()                       # same architecture as training's
        model.compile(loss=..., metrics=["accuracy"])
        psclient.SidecarEvaluator(model, test_ds, "/ckpts", steps=20).start()

    Reads TF `CheckpointManager` directories (`tf.train.Checkpoint(model=...)`,
    key `model_key`) and Keras `ModelCheckpoint` files (`*.weights.h5`,
    `*.keras`). Each evaluation is logged, written as TensorBoard scalars to
    `log_dir` at the checkpoint's training step, and appended to
    `log_dir/evaluations.jsonl`.

    The step of a checkpoint is the first of: its saved `step` variable (TF,
    root key "step"), its optimizer's `iterations`, the step in the final
    marker (for that checkpoint), the N of a TF `ckpt-N` prefix, and else the
    checkpoint's rank in discovery order (1, 2, ...).

    Args:
        model: a built, compiled Keras 3 model (its compiled metrics are reported).
        data: what `model.evaluate` takes as `x` (a `tf.data.Dataset`, arrays),
            or an `(x, y)` tuple.
        checkpoint_dir: the directory training writes checkpoints to.
        steps: batches per evaluation (None: the whole of `data`).
        max_evaluations: stop after this many evaluations (None: no limit).
        callbacks: Keras callbacks passed to `model.evaluate`.
        config: a `psclient.EvaluatorConfig` holding the options below (None:
            the defaults). Each of its fields may also be passed as a keyword,
            which replaces the config's value.
        log_dir: where summaries and evaluations.jsonl go (default
            `<checkpoint_dir>/eval`).
        idle_timeout: stop after this many seconds without a new checkpoint
            (None: wait forever). A missing directory is waited for as long.
        settle_time: seconds a Keras file must stay unchanged before it is read.
        poll_interval: seconds between directory scans.
        model_key: the key of the model in TF checkpoints' root object.
        export_best: a `.keras` path: the model of the best evaluation is saved
            there (atomically) by `best_metric`.
        best_metric: the metric that picks the best checkpoint.
        best_mode: "max", "min" or "auto" (max for accuracy-like names).
    """

    def __init__(self, model: Any, data: Any, checkpoint_dir: str | os.PathLike, steps: int | None = None,
                 max_evaluations: int | None = None, callbacks: list | None = None,
                 config: EvaluatorConfig | None = None, **options: Any):
        # TF's six arguments, then psclient's options: one EvaluatorConfig, each of its fields also a keyword.
        config = with_overrides(config, EvaluatorConfig, options, "SidecarEvaluator")
        if not getattr(model, "built", False) or not hasattr(model, "evaluate"):
            raise ValueError(f"Invalid value for argument `model`. Received: {model!r}. Expected a built "
                             "Keras model (give it a keras.Input or call build()) so checkpoints can be restored.")
        if not getattr(model, "compiled", False):
            raise ValueError(f"Invalid value for argument `model`. Received: an uncompiled {type(model).__name__}. "
                             "Expected a compiled model: compile(loss=..., metrics=[...]) names what is reported.")
        self.model, self.data, self.config = model, data, config
        self.checkpoint_dir = check_watch(checkpoint_dir, steps, max_evaluations)
        self.steps, self.max_evaluations = steps, max_evaluations
        self.callbacks = list(callbacks or [])
        self.log_dir = config.log_dir_for(self.checkpoint_dir)
        self.export_best = config.export_best_path
        self._clock = config.clock
        self._stop = threading.Event()
        #: What `start()` has done so far (None before it runs).
        self.report: SidecarReport | None = None
        self._keras_expected: dict | None = None

    def stop(self) -> None:
        """Makes a running `start()` return after its current evaluation. Thread-safe."""
        self._stop.set()

    def start(self) -> SidecarReport:
        """Evaluates checkpoints until a stop rule fires; returns what it did.

        Raises:
            CheckpointMismatchError: the model does not match a checkpoint.
            ValueError: `best_metric` is not one of the evaluated metrics.
        """
        planner = Planner(settle_time=self.config.settle_time, idle_timeout=self.config.idle_timeout,
                          max_evaluations=self.max_evaluations, now=self._clock())
        # Filled in as it goes: `report` is what Prometheus's scrapes read meanwhile (--metrics-port).
        report = self.report = SidecarReport([], [], [], stop_reason="stop() was called")
        writer = None
        waiting_for = None
        ignore = frozenset([self.export_best] if self.export_best else [])
        _log.info("watching %s (evaluations go to %s)", self.checkpoint_dir, self.log_dir)
        try:
            while not self._stop.is_set():
                refs = formats.scan(self.checkpoint_dir, ignore)
                marker = read_final_marker(self.checkpoint_dir) if refs is not None else None
                decision = planner.decide(refs, marker, self._clock())
                if decision.action == "stop":
                    report.stop_reason = decision.reason
                    break
                if decision.action == "wait":
                    if decision.reason != waiting_for:  # Say it once, not every poll.
                        waiting_for = decision.reason
                        _log.info("waiting: %s in %s", decision.reason, self.checkpoint_dir)
                    self._stop.wait(self.config.poll_interval)
                    continue
                waiting_for = None
                is_final = marker is not None and os.path.normpath(marker["checkpoint"]) == \
                    os.path.normpath(decision.checkpoint.name)
                try:
                    record = self._evaluate(decision.checkpoint, planner, marker if is_final else None)
                except CheckpointUnreadableError as e:
                    if planner.unreadable(decision.checkpoint, self._clock(), final=is_final):
                        report.unreadable.append(str(e))
                        _log.warning("skipped %s: unreadable (corrupt or deleted): %s", decision.checkpoint.name, e)
                    else:
                        _log.info("%s is not complete yet; retrying (%s)", decision.checkpoint.name, e)
                        self._stop.wait(self.config.poll_interval)
                    continue
                planner.evaluated(decision, self._clock())
                if decision.skipped:
                    names = [r.name for r in decision.skipped]
                    report.skipped += names
                    _log.info("skipped %s: evaluated the newer %s instead", ", ".join(names), decision.checkpoint.name)
                writer = self._write(record, writer)
                if self.export_best:
                    report.best = self._maybe_export(record, report.best)
                report.evaluations.append(record)
        finally:
            if writer is not None:
                writer.close()
        _log.info("stopping after %d evaluation(s): %s", len(report.evaluations), report.stop_reason)
        return report

    def _evaluate(self, ref: CheckpointRef, planner: Planner, marker: dict | None) -> dict:
        if ref.kind == formats.KERAS and self._keras_expected is None:
            with tempfile.TemporaryDirectory(prefix="psclient-sidecar-") as scratch:
                self._keras_expected = formats.keras_expected_variables(self.model, scratch)
        formats.restore(ref, self.model, self.config.model_key, self._keras_expected)
        step = formats.step_of(ref)
        if step is None and marker is not None and isinstance(marker.get("step"), int):
            step = marker["step"]
        if step is None:
            step = ref.number if ref.number is not None else planner.ordinal(ref)
        _log.info("evaluating %s (step %d)", ref.name, step)
        x, y = (self.data if isinstance(self.data, tuple) and len(self.data) == 2 else (self.data, None))
        metrics = self.model.evaluate(x, y, steps=self.steps, callbacks=self.callbacks, verbose=0, return_dict=True)
        metrics = {k: float(v) for k, v in metrics.items()}
        _log.info("%s (step %d): %s", ref.name, step, "  ".join(f"{k}={v:.4f}" for k, v in metrics.items()))
        return {"checkpoint": ref.name, "step": int(step), "metrics": metrics, "time": time.time()}

    def _write(self, record: dict, writer: Any) -> Any:
        os.makedirs(self.log_dir, exist_ok=True)
        if writer is None:
            writer = tf.summary.create_file_writer(self.log_dir)
        with writer.as_default():
            for name, value in record["metrics"].items():
                # tf.summary.scalar needs the tensorboard package; the same event,
                # tagged for TensorBoard's scalars plugin, needs only TensorFlow.
                tf.summary.write(name, tf.constant(value, tf.float32), step=record["step"],
                                 metadata=_scalar_metadata())
        writer.flush()
        with open(os.path.join(self.log_dir, METRICS_FILE), "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        return writer

    def _maybe_export(self, record: dict, best: dict | None) -> dict | None:
        metrics = record["metrics"]
        if self.config.best_metric not in metrics:
            raise ValueError(f"Invalid value for argument `best_metric`. Received: {self.config.best_metric!r}. "
                             f"Expected one of the evaluated metrics: {sorted(metrics)}.")
        value = metrics[self.config.best_metric]
        if best is not None:
            previous = best["metrics"][self.config.best_metric]
            if not (value > previous if self.config.higher_is_better else value < previous):
                return best
        os.makedirs(os.path.dirname(self.export_best), exist_ok=True)
        # Saved in a private temporary directory beside it (a dot-name: out of scans), then renamed.
        with replaced_atomically(self.export_best) as temp:
            self.model.save(temp)
        _log.info("exported %s (%s=%.4f) to %s", record["checkpoint"], self.config.best_metric, value, self.export_best)
        return record
