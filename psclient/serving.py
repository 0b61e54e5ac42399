"""Serve a model psclient exports, fresh between full versions: `psclient.serving.load(base_dir)`.

`load(base_dir)` loads the newest full version in `base_dir` (a SavedModel that
`psclient.ServingExport` or `psclient.export_servable` wrote) with stock
TensorFlow, applies the delta versions written after it (`ServingExport(...,
delta_every_seconds=S)`), and returns a `ServedModel`: call it on a batch of
inputs as the SavedModel's `serve` endpoint is called. A thread it owns polls
`base_dir` for new deltas and full versions (`close()`, or a `with` block,
stops and joins it; `poll_seconds=None`: no thread, call `refresh()`).

Deltas are applied in order, each whole or not at all, between calls (a call
never sees half a delta); a missing delta (a gap) is never skipped: the newest
full version is loaded again instead. A newer full version is loaded when it
appears.

Stock TensorFlow only: no cluster, no task processes; importing this module
starts nothing and imports none of psclient's cluster or Keras modules. Layout
of the deltas: `psclient._core.serving_deltas`; docs/serving.md.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref

import numpy as np
import tensorflow as tf

from psclient._core import serving_deltas, serving_dirs
from psclient._core.serving_dirs import ServingDirError
from psclient._tf.executors import eager_ops_as_themselves, streamed_function_registrations

__all__ = ["ServedModel", "ServingDirError", "load"]

_log = logging.getLogger(__name__)


class _Served:
    """One loaded full version: the SavedModel and its variables by name (several objects may share one)."""

    def __init__(self, base_dir: str, version: int):
        self.version, self.applied = version, 0
        self.saved = tf.saved_model.load(os.path.join(base_dir, str(version)))
        self.variables: dict[str, list] = {}
        for node in tf.train.TrackableView(self.saved).descendants():
            if isinstance(node, tf.Variable):
                named = self.variables.setdefault(node.name, [])
                if all(node is not other for other in named):
                    named.append(node)

    def table(self, name: str, part: str, shard: int) -> tf.Variable:
        """A dynamic table's snapshot variable in the SavedModel (`ServingTable`'s names)."""
        suffix = f"{name}_{part}_{shard}:0"
        found = [v for key, group in self.variables.items() if key.rsplit("/", 1)[-1] == suffix for v in group]
        if len(found) != 1:
            raise ServingDirError(f"Full version {self.version} holds {len(found)} variables named {suffix!r}, "
                                  "expected one: the delta is not of this model.")
        return found[0]


def _read(path: str, dtype) -> np.ndarray:
    return tf.io.parse_tensor(tf.io.read_file(path), dtype).numpy()


def _merged(keys: np.ndarray, rows: np.ndarray, changed: np.ndarray, changed_rows: np.ndarray,
            removed: np.ndarray):
    """A shard's sorted keys and rows (each with its last, default entry) after a delta."""
    held_keys, held_rows = keys[:-1], rows[:-1]
    stay = ~np.isin(held_keys, removed) & ~np.isin(held_keys, changed)
    all_keys = np.concatenate([held_keys[stay], changed])
    order = np.argsort(all_keys, kind="stable")  # two sorted runs: a linear merge
    all_rows = np.concatenate([held_rows[stay], changed_rows.reshape(-1, rows.shape[1])])
    return (np.concatenate([all_keys[order], keys[-1:]]),
            np.concatenate([all_rows[order], rows[-1:]]))


def _prepared(served: _Served, directory: str) -> list:
    """(variable, new value, row indices or None) that apply the delta in `directory` to `served` (nothing
    assigned yet): None assigns the value whole, indices write those rows."""
    manifest = serving_deltas.read_manifest(directory)
    if (manifest.get("version"), manifest.get("seq")) != (served.version, served.applied + 1):
        raise ServingDirError(f"The delta {directory!r} is delta {manifest.get('seq')} of version "
                              f"{manifest.get('version')}; expected delta {served.applied + 1} of {served.version}.")
    writes = []
    for i, table in enumerate(manifest["tables"]):
        for k in range(table["shards"]):
            keys_var, rows_var = served.table(table["name"], "keys", k), served.table(table["name"], "rows", k)
            part = os.path.join(directory, f"t{i}_s{k}_")
            keys, rows = _merged(keys_var.numpy(), rows_var.numpy(), _read(part + "keys", tf.int64),
                                 _read(part + "rows", tf.float32), _read(part + "removed", tf.int64))
            writes += [(keys_var, keys, None), (rows_var, rows, None)]
    for j, dense in enumerate(manifest["dense"]):
        writes += _dense_writes(served, directory, f"d{j}", dense)
    return writes


def _dense_writes(served: _Served, directory: str, file: str, dense: dict) -> list:
    """(variable, value, row indices or None: all) that write dense variable `dense` (its manifest entry,
    its files named `file`...) into `served`: a partitioned one is in a SavedModel whole (model.export),
    as its shards (Keras's own export writes those too), or both."""
    dtype = tf.as_dtype(dense["dtype"])
    parts = [file] if "parts" not in dense else [f"{file}_p{i}" for i in range(len(dense["parts"]))]
    shard_names = dense.get("parts", [])
    if dense["form"] == "whole":
        values = [_read(os.path.join(directory, part), dtype) for part in parts]
        whole = np.concatenate(values) if shard_names else values[0]
        pieces = [(dense["name"], whole, None, _rows_of(whole)),
                  *((name, value, None, _rows_of(value)) for name, value in zip(shard_names, values))]
    elif dense["form"] == "rows":
        indices, rows = [], []
        for part, written, count in zip(parts, dense["written"], dense["shard_rows"]):
            path = os.path.join(directory, part)
            if written == "rows":
                indices.append(_read(path + "_idx", tf.int64))
                rows.append(_read(path + "_rows", dtype))
            else:  # most of the shard's rows changed: written whole
                indices.append(np.arange(count, dtype=np.int64))
                rows.append(_read(path, dtype))
        offsets = np.cumsum([0, *dense["shard_rows"][:-1]])  # a shard's first row in the whole variable
        pieces = [(dense["name"], np.concatenate(rows),
                   np.concatenate([offset + index for offset, index in zip(offsets, indices)]),
                   sum(dense["shard_rows"])),
                  *zip(shard_names, rows, indices, dense["shard_rows"])]
    else:
        raise ServingDirError(f"The delta {directory!r} writes variable {dense['name']!r} in form {dense['form']!r}; "
                              "expected 'whole' or 'rows' (a newer psclient wrote it?).")
    targets = []
    for name, value, index, count in pieces:
        for variable in served.variables.get(name, []):
            # Checked before anything is written: a delta is applied whole or not at all.
            if count is not None and variable.shape.rank and variable.shape[0] not in (None, count):
                raise ServingDirError(f"The delta {directory!r} writes {count} rows of variable {name!r}, which "
                                      f"holds {variable.shape[0]} in full version {served.version}: the delta "
                                      "is not of this model.")
            targets.append((variable, value, index))
    if not targets:
        raise ServingDirError(f"The delta {directory!r} holds variable {dense['name']!r}, which full version "
                              f"{served.version} does not: the delta is not of this model.")
    return targets


def _rows_of(value: np.ndarray) -> int | None:
    return value.shape[0] if value.ndim else None


class _ReadWriteLock:
    """Calls share it; applying a delta holds it alone (so no call sees half of one)."""

    def __init__(self):
        self._cond, self._readers, self._writing = threading.Condition(), 0, False

    def read(self):
        with self._cond:
            self._cond.wait_for(lambda: not self._writing)
            self._readers += 1

    def read_done(self):
        with self._cond:
            self._readers -= 1
            self._cond.notify_all()

    def write(self):
        with self._cond:
            self._cond.wait_for(lambda: not self._writing)
            self._writing = True
            self._cond.wait_for(lambda: self._readers == 0)

    def write_done(self):
        with self._cond:
            self._writing = False
            self._cond.notify_all()


class ServedModel:
    """A SavedModel from `base_dir` kept fresh with its deltas (see `load`)."""

    def __init__(self, base_dir: str, poll_seconds: float | None, endpoint: str):
        self.base_dir, self.endpoint = base_dir, endpoint
        self._lock, self._refreshing = _ReadWriteLock(), threading.Lock()
        self._served: _Served | None = None
        self._gap_handled: tuple[int, int] | None = None
        self._stats = {"loads": 0, "deltas_applied": 0, "gaps": 0, "last_error": None, "applied_at": None}
        self.refresh()
        if self._served is None:
            raise ServingDirError(f"Invalid value for argument `base_dir`. Received: base_dir={base_dir!r}, which "
                                  "holds no full version. Expected a directory psclient.ServingExport or "
                                  "psclient.export_servable wrote.")
        saved = self._served.saved
        if not hasattr(saved, endpoint) and endpoint not in saved.signatures:
            raise ValueError(f"Invalid value for argument `endpoint`. Received: endpoint={endpoint!r}. Expected a "
                             f"function or signature of the SavedModel: signatures {sorted(saved.signatures)}.")
        self._stop = threading.Event()
        self._thread = None
        if poll_seconds is not None:
            # The thread holds the model weakly: a model dropped without close() stops it too.
            self._thread = threading.Thread(target=_poll, args=(weakref.ref(self), self._stop, poll_seconds),
                                            daemon=True, name=f"psclient-serving-poll:{base_dir}")
            weakref.finalize(self, self._stop.set)
            self._thread.start()

    # ------------------------------------------------------------ serving
    def __call__(self, *args, **kwargs):
        """The SavedModel's endpoint (`serve` by default) on a batch of inputs."""
        self._lock.read()
        try:
            saved = self._served.saved
            function = getattr(saved, self.endpoint, None) or saved.signatures[self.endpoint]
            # A first call traces the endpoint for its inputs: its registration streamed (see refresh).
            with streamed_function_registrations():
                return function(*args, **kwargs)
        finally:
            self._lock.read_done()

    @property
    def version(self) -> tuple[int, int]:
        """(full version, deltas applied after it) being served."""
        served = self._served
        return served.version, served.applied

    def statistics(self) -> dict:
        """What the loader did: loads of full versions, deltas applied, gaps met, the last error, and the
        `written_at` time (seconds since the epoch) of the last delta applied."""
        return {"version": self.version, **self._stats}

    # ------------------------------------------------------------- deltas
    def refresh(self) -> bool:
        """Load what is new in `base_dir` now (a newer full version, the next deltas); return whether
        anything was. What the polling thread calls."""
        changed = False
        # In a process connected to a cluster (a training coordinator that also serves), TF registers
        # each function of a loaded SavedModel on every task of the cluster first: waited for with the
        # GIL held, one hung worker froze every thread of the process until it answered (5.5 s in a
        # chaos plan). Streamed, nothing waits on the tasks (the loader's ops all run here). Only the
        # registrations: streaming everything (`streamed_registrations`) at every poll switched TF's
        # process-wide streaming on several times a second, and the training's own registrations on
        # a worker that rejoined were then overtaken by its calls (two chaos plans in eight). Without
        # a cluster this changes nothing.
        with self._refreshing, streamed_function_registrations():
            while True:
                served = self._served
                at = None if served is None else (served.version, served.applied)
                fulls = serving_dirs.versions(self.base_dir)
                chain = [] if at is None else serving_deltas.deltas(self.base_dir, at[0])
                step = serving_deltas.next_step(at, fulls, chain, self._gap_handled)
                if step.kind == "wait":
                    return changed
                # Its eager ops (a load's variables, a delta's reads and writes) run unwrapped: TF
                # registers each new kind of wrapped op on every task first, and a hung worker held
                # a load until it answered (`eager_ops_as_themselves`).
                with eager_ops_as_themselves():
                    if step.kind == "load":
                        if step.gap is not None:
                            self._stats["gaps"] += 1
                            self._gap_handled = (at[0], step.gap) if step.version == at[0] else None
                        self._load(step.version)
                    else:
                        self._apply(served, os.path.join(serving_deltas.chain_dir(self.base_dir, step.version),
                                                         str(step.seq)))
                changed = True

    def _load(self, version: int) -> None:
        served = _Served(self.base_dir, version)  # seconds; calls go on with the version served meanwhile
        self._lock.write()
        try:
            self._served = served
        finally:
            self._lock.write_done()
        self._stats["loads"] += 1

    def _apply(self, served: _Served, directory: str) -> None:
        writes = _prepared(served, directory)  # read and merged while calls go on
        self._lock.write()
        try:
            for variable, value, rows in writes:
                if rows is None:
                    variable.assign(value)
                else:  # row updates of an embedding-like variable (global row indices)
                    variable.scatter_update(tf.IndexedSlices(value, rows))
            served.applied += 1
        finally:
            self._lock.write_done()
        self._stats["deltas_applied"] += 1
        self._stats["applied_at"] = serving_deltas.read_manifest(directory).get("written_at")

    def _refresh_in_thread(self) -> None:
        try:
            self.refresh()
        except (OSError, ServingDirError, tf.errors.OpError, KeyError, ValueError) as error:
            # A version pruned while read, a delta of another model: served as before, tried again.
            self._stats["last_error"] = f"{type(error).__name__}: {error}"
            _log.warning("psclient.serving: refreshing %s failed: %s", self.base_dir, error)

    # ------------------------------------------------------------ closing
    def close(self) -> None:
        """Stop and join the polling thread (idempotent). The model still serves what it holds."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None

    def __enter__(self) -> "ServedModel":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _poll(model_ref, stop: threading.Event, seconds: float) -> None:
    """The polling thread: refresh the model every `seconds` until stopped or the model is gone."""
    while not stop.wait(seconds):
        model = model_ref()
        if model is None:
            return
        model._refresh_in_thread()  # noqa: SLF001 - its owner's own method
        del model


def load(base_dir, poll_seconds: float | None = 1.0, endpoint: str = "serve") -> ServedModel:
    """Load the newest full version in `base_dir` and the deltas after it; keep it fresh.

    Args:
      base_dir: the directory `psclient.ServingExport` (or `export_servable`) writes.
      poll_seconds: how often a thread looks for new deltas and full versions;
        None: no thread (call `refresh()`).
      endpoint: the SavedModel's function to call (`serve`, Keras's export), or a
        signature's name (`serving_default`).
    """
    base_dir = serving_dirs.check_base_dir(base_dir)
    if poll_seconds is not None and (isinstance(poll_seconds, bool) or not isinstance(poll_seconds, (int, float))
                                     or poll_seconds <= 0):
        raise ValueError(f"Invalid value for argument `poll_seconds`. Received: poll_seconds={poll_seconds!r}. "
                         "Expected a number of seconds > 0, or None.")
    return ServedModel(base_dir, poll_seconds, endpoint)
