"""`psclient.export_servable` and `psclient.ServingExport`: SavedModels in TF Serving's layout.

`export_servable(model, base_dir)` writes the model's SavedModel (Keras's own
`model.export`: a `serve` endpoint and the `serving_default` signature, stock
TF ops only, DynamicEmbedding layers as a lookup of stock TF, no training
state) to `<base_dir>/<version>/` safely (`psclient._core.serving_dirs`: a
hidden temporary directory renamed when complete, one run per `base_dir`,
the newest `keep` versions kept). `ServingExport` calls it from `fit`, and
with `delta_every_seconds` also writes delta versions between full ones
(`psclient._coordinator.serving.delta_cut`, layout in `psclient._core.serving_deltas`),
which `psclient.serving.load` applies. See docs/serving.md.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import logging
import os
import threading
import time
from typing import Callable

import keras
import tensorflow as tf

from psclient._coordinator.serving.delta_cut import CutLost
from psclient._core import serving_deltas, serving_dirs
from psclient._core.errors import PSUnavailableError
from psclient._core.serving_dirs import ServingDirError
from psclient._engine import registry
from psclient._keras import bounded_export
from psclient._keras.dynamic_embedding import offered_snapshots
from psclient._keras.hung_ps_writes import writes_of
from psclient._tf.executors import on_thread_executor

__all__ = ["ServingDirError", "ServingExport", "export_servable"]


def export_servable(model, base_dir, version=None, keep=5, *, run_id=None, take_over=False) -> str:
    """Write `model`'s SavedModel to `<base_dir>/<version>/` for TF Serving; return that directory.

    Args:
      model: a built Keras model (trained on a psclient cluster or not).
      base_dir: the directory TF Serving's `--model_base_path` names (made if missing).
      version: the version to write, an integer >= 0 that does not exist yet;
        None: one more than the newest in `base_dir` (1 in an empty one).
      keep: after writing, keep only the newest `keep` versions (None: all).
      run_id: the run this export belongs to (a string); None: this process's.
        A `base_dir` written by another run is refused (`ServingDirError`).
      take_over: write (and prune) `base_dir` even if another run wrote it;
        it is this run's from then on.

    The version appears complete or not at all: it is written under a hidden
    name in `base_dir` and renamed to its number when every file is on disk.
    On a cluster, a ps that does not answer within the strategy's
    `hang_timeout` makes it raise `psclient.PSUnavailableError` naming the ps,
    and that version is never published (`psclient._keras.bounded_export`).
    """
    if not isinstance(model, keras.Model):
        raise TypeError(f"Invalid value for argument `model`. Received: model of type {type(model).__name__}. "
                        "Expected a keras.Model.")
    if not model.built:
        raise ValueError(f"Invalid value for argument `model`. Received: model {model.name!r}, not built. "
                         "Expected a built model (call it, fit it, or give it an Input).")
    base_dir = serving_dirs.check_base_dir(base_dir)
    version = serving_dirs.check_version(version)
    keep = serving_dirs.check_keep(keep)
    run_id = serving_dirs.check_run_id(run_id)
    if not isinstance(take_over, bool):
        raise TypeError(f"Invalid value for argument `take_over`. Received: take_over={take_over!r}. "
                        "Expected True or False.")
    return _export(model, base_dir, version, keep, run_id=run_id, take_over=take_over)


def _export(model, base_dir, version=None, keep=5, *, run_id=None, take_over=False, around=contextlib.nullcontext):
    """`export_servable` of checked arguments; `around()`: a context the write runs in, entered on the
    export's thread once every ps answered (`ServingExport` cuts its delta chain's base in it)."""
    serving_dirs.claim(base_dir, run_id, take_over)

    def write(publication=None) -> int:
        with serving_dirs.new_version(base_dir, version) as (scratch, written), around():
            model.export(scratch, format="tf_saved_model", verbose=False)
            if publication is not None and not publication.may_publish():
                raise bounded_export.Abandoned(scratch)  # its caller gave up: removed, never renamed
        return written

    version = _bounded(write, "export_servable")
    serving_dirs.prune(base_dir, keep)
    serving_deltas.prune_chains(base_dir)  # the deltas of pruned versions go with them
    return os.path.join(base_dir, str(version))


def _bounded(call: Callable, what: str):
    """`call(publication)`; on a cluster on the export's thread, given up on a ps that does not answer
    within the strategy's `hang_timeout` (`PSUnavailableError` naming it, its first words `what`):
    a hung ps must not hold the caller (`bounded_export`)."""
    bounds = _hang_bounds()
    return call(None) if bounds is None else bounded_export.export_bounded(call, *bounds, what)


def _hang_bounds():
    """(num_ps, hang_timeout, describe_ps) of the connected strategy, for `bounded_export`; None without one."""
    strategy = registry.current()
    if strategy is None or strategy.closed:
        return None
    return strategy.num_ps, strategy.config.hang_timeout, lambda ps: strategy.cluster.ps[ps]


def _positive(name: str, value, kind):
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, kind) or value <= 0:
        expected = "an integer >= 1" if kind is int else "a number of seconds > 0"
        raise ValueError(f"Invalid value for argument `{name}`. Received: {name}={value!r}. Expected {expected} "
                         "or None.")
    return value


def _dynamic_tables(model) -> list:
    """The `DynamicTable`s of `model`'s `DynamicEmbedding` layers (nested ones too), each once."""
    from psclient._keras.dynamic_embedding import dynamic_layers

    tables = {id(layer.table): layer.table for layer in dynamic_layers(model)}  # a layer used twice: once
    return list(tables.values())


def _dense(model) -> list:
    """(name in the SavedModel, tf.Variable or the shards of a partitioned one) of `model`'s variables.

    A partitioned variable is saved in a SavedModel both whole (named by its
    path) and as its shards: a delta carries its shards, each written by its ps."""
    pairs = []
    for variable in model.variables:
        value = getattr(variable, "value", variable)
        if isinstance(value, tf.Variable):
            pairs.append((value.name, value))
        else:  # psclient's PartitionedVariable (a ShardedVariable): its shards, in order
            pairs.append((f"{variable.path}:0", list(value.variables)))
    return pairs


class ServingExport(keras.callbacks.Callback):
    """Export the model being fit with `export_servable`: every `every_epochs` epochs and/or every
    `every_seconds` seconds (checked at each batch's end and each epoch's end).

    With neither given, once per epoch. Before each export it waits for the
    steps in flight (`strategy.join()`), so a version holds no step half applied. `keep`, `run_id` and `take_over` are
    `export_servable`'s; the run id is checked when training begins, so a
    `base_dir` of another run fails `fit` before its first step.
    `exported` lists the directories written, in order.

    Deltas: with `delta_every_seconds=S`, every S seconds (checked at each
    batch's end) it also writes a delta version, `<base_dir>/deltas/<V>/<seq>/`:
    the rows of the dynamic tables changed since the previous version (full or
    delta), the keys gone, the rows changed of the embedding-like variables
    (rank 2, `ROW_DIFF_MIN_ROWS` rows or more), and the other dense variables
    whole, written by the ps tasks. A full version replaces a delta after
    `full_every_deltas` deltas, and when a delta cannot be taken or written (a
    ps lost since the previous cut took that cut's copies with it; the failed
    delta is never published). Training
    ends with a last delta; the chain goes on in the next `fit` with this
    callback (each ps keeps the last cut's copy of its rows until
    `release()`). `deltas` lists a dict per delta written (path,
    rows changed and removed, `dense_rows_changed` of the embedding-like
    variables, bytes, `seconds` training was paused for the cut, `join_seconds` of it waiting for the steps in flight, and
    `write_seconds` the ps tasks then took to diff and write it while
    training went on, on a writer thread, each delta written by the time `fit` returns; one given up
    on a hung ps is in `failed_deltas`).
    `psclient.serving.load(base_dir)` serves the newest full version with its
    deltas applied; TF Serving sees the full versions only.

    Through ps faults, training goes on (`psclient._keras.hung_ps_writes`): a
    ps lost before or during an export is restored by the strategy first and
    the export made again; an export given up on a ps that hung
    (`PSUnavailableError` after `hang_timeout`, nothing published) is noted in
    `failed_exports` and made again at the first batch's end after the ps
    answered, and at the end of `fit` at most `FINAL_ATTEMPTS` times (then
    `fit` raises it).
    """

    _psclient_reads_batch_logs = False  # its batch hook only looks at the clock (trainer.reads_batch_logs)

    def __init__(self, base_dir, every_seconds=None, every_epochs=None, keep=5, *, run_id=None, take_over=False,
                 delta_every_seconds=None, full_every_deltas=60):
        super().__init__()
        self.base_dir = serving_dirs.check_base_dir(base_dir)
        self.every_seconds = _positive("every_seconds", every_seconds, (int, float))
        self.every_epochs = _positive("every_epochs", every_epochs, int)
        if self.every_seconds is None and self.every_epochs is None:
            self.every_epochs = 1
        self.keep = serving_dirs.check_keep(keep)
        self.run_id = serving_dirs.check_run_id(run_id)
        if not isinstance(take_over, bool):
            raise TypeError(f"Invalid value for argument `take_over`. Received: take_over={take_over!r}. "
                            "Expected True or False.")
        self.take_over = take_over  # used when training begins: the directory is this run's after that
        self.delta_every_seconds = _positive("delta_every_seconds", delta_every_seconds, (int, float))
        self.full_every_deltas = _positive("full_every_deltas", full_every_deltas, int)
        self.exported: list[str] = []
        self.deltas: list[dict] = []
        self._last = self._last_delta = time.monotonic()
        # The delta chain (previous cut, position, writer thread); used in delta mode only.
        self._chain_state = _DeltaChain(self.base_dir, self.deltas)
        #: One dict per delta whose write failed ({"version", "seq", "error"}); none was made visible,
        #: and the next version written after it was a full one.
        self.failed_deltas: list[dict] = self._chain_state.failures
        #: One dict per export given up on a ps that hung ({"task", "error", "at": time.time()});
        #: none was published, and the export was made again.
        self.failed_exports: list[dict] = writes_of(self, _EXPORT).failures

    def on_train_begin(self, logs=None):
        serving_dirs.claim(self.base_dir, self.run_id, self.take_over)
        self._last = self._last_delta = time.monotonic()

    def export_now(self) -> None:
        chain = self._chain_state
        chain.finish_pending()  # the deltas of the chain before it are all written first
        _join_steps()
        bases = []  # the new chain's base, once cut
        around = contextlib.nullcontext
        if self.delta_every_seconds is not None:
            chain.cut = None  # the old chain's copies freed first; if the export fails, the next version is full
            around = functools.partial(_cut_chain_base, self.model, bases)
        # No take_over here: a run that took the directory over since fails the export, as it should.
        path = _export(self.model, self.base_dir, keep=self.keep, run_id=self.run_id, around=around)
        self.exported.append(path)
        if bases:
            chain.cut, chain.position = bases[0], (int(os.path.basename(path)), 0)
        self._last = self._last_delta = time.monotonic()

    def delta_now(self) -> None:
        """Write a delta version now (a full version when one is due instead).

        Training pauses for the cut only (the steps in flight finish, the ps
        tasks copy what changed); the ps tasks then diff and write it on the
        callback's writer thread while training goes on."""
        chain = self._chain_state
        chain.finish_pending()
        version, seq = chain.position
        if chain.cut is not None and chain.cut.lost():
            # A ps lost since the full version took the cut's copies with it (training went on from
            # a restored checkpoint): no delta can say what changed since, the chain starts again.
            _log_full_instead(CutLost("a ps task was lost and recovered since the full version"), version, seq + 1)
            chain.cut = None
        if chain.cut is None or (self.full_every_deltas is not None and seq >= self.full_every_deltas):
            self.export_now()
            return
        began = time.monotonic()
        _join_steps()
        joined = time.monotonic()
        try:
            cut = _bounded(lambda _publication: chain.cut.take(), "a ServingExport delta's cut")
        except (tf.errors.OpError, CutLost) as error:
            # The previous cut lived on a ps that was lost (or a copy failed there): a full version instead.
            _log_full_instead(error, version, seq + 1)
            chain.cut = None
            self.export_now()
            return
        chain.submit(cut, {"seconds": time.monotonic() - began, "join_seconds": joined - began})
        self._last_delta = time.monotonic()

    @property
    def chain(self) -> tuple:
        """(the last full version written, the last delta taken after it: 0 for none); (None, 0) before
        any. A delta taken is written on a writer thread, all of them by the time `fit` returns; one
        whose write failed or was given up on a hung ps is taken back (`failed_deltas`), and the next
        version is a full one."""
        return self._chain_state.position

    def due_by_time(self) -> bool:
        return self.every_seconds is not None and time.monotonic() - self._last >= self.every_seconds

    def delta_due(self) -> bool:
        return (self.delta_every_seconds is not None
                and time.monotonic() - self._last_delta >= self.delta_every_seconds)

    def on_train_batch_end(self, batch, logs=None):
        writes = writes_of(self, _EXPORT)
        if writes.pending or self.due_by_time():
            writes.run(self.export_now)
        elif self.delta_due():
            writes.run(self.delta_now)

    def on_epoch_end(self, epoch, logs=None):
        writes = writes_of(self, _EXPORT)
        if ((self.every_epochs is not None and (epoch + 1) % self.every_epochs == 0) or self.due_by_time()
                or writes.pending):
            writes.run(self.export_now)

    def on_train_end(self, logs=None):
        writes = writes_of(self, _EXPORT)
        if self.delta_every_seconds is not None:
            try:
                writes.run(self.delta_now, final=True)  # what training ended with is served
            finally:
                self._chain_state.stop_writer()
        elif writes.pending:
            writes.run(self.export_now, final=True)
        # The cut is kept: a next `fit` (online training, fit after fit) goes on with the same chain.

    def release(self) -> None:
        """Wait for the delta being written (given up on a hung ps after `hang_timeout`), and free the
        previous cut's copy of the rows on the ps tasks; the next version written is a full one."""
        self._chain_state.stop_writer()
        self._chain_state.cut = None


_EXPORT = "a psclient.ServingExport export"


@contextlib.contextmanager
def _cut_chain_base(model, bases: list):
    """Around a full version's write (on the export's thread, after every ps answered its probe): the
    new delta chain's base cut, appended to `bases`, its snapshot of each dynamic table served by the
    export.

    Cut *before* the export: no step of this process runs in between, but one can land there, the
    step of a hung worker taken out (its closure run elsewhere), applied when that worker resumes.
    Cut after the export, a row it changed in between was in the base, not in the full version, and
    in no delta until trained again (docs/serving.md, "Consistency"); cut before, whatever changes
    after it is in the next delta."""
    from psclient._coordinator.serving.delta_cut import DeltaCut

    tables = _dynamic_tables(model)
    base = DeltaCut(tables, _dense(model))
    bases.append(base)
    snapshots = {id(table): snapshot for table, snapshot in zip(tables, base.previous)}
    with offered_snapshots(model._flatten_layers(include_self=False), snapshots):  # noqa: SLF001
        yield


def _join_steps() -> None:
    strategy = registry.current()
    if strategy is not None:
        strategy.join()  # a version is a cut between steps: none in flight on the workers


class _DeltaChain:
    """A `ServingExport`'s deltas: the previous version's cut (a `DeltaCut`, its copies on the ps),
    where the chain stands (full version, last delta taken), and the thread that writes them.

    Each delta is written on a thread of its own (`psclient-serving-deltas`), one at a time, which
    the next version waits for (`finish_pending`). On a cluster that wait gives up on a ps that does
    not answer within `hang_timeout` (`bounded_export.wait_bounded`): the delta is abandoned (it
    publishes nothing, its hidden directory removed once its thread ends), recorded as failed, and
    the next version is a full one. The thread is a daemon: one abandoned waits on the hung ps
    inside TF's call, which cannot be cancelled, and must not keep the process from exiting.

    Not a Keras class, so its names can be anything (the Keras seam's check reads private names
    on Keras-derived classes as Keras's own)."""

    THREAD_NAME = "psclient-serving-deltas"

    def __init__(self, base_dir: str, records: list):
        self.base_dir = base_dir
        self.records = records  # the callback's `deltas`: one dict per delta written
        self.failures: list[dict] = []  # the callback's `failed_deltas`: one dict per delta given up
        self.cut = None
        self.position = (None, 0)
        # The delta being written: (its Future, its thread, its Publication), or None.
        self._pending = None
        #: Called with a ps device after each part of a delta that ps wrote (`DeltaCut.write`): a test's seam.
        self.after_part = None

    def submit(self, cut, paused: dict) -> None:
        """Write `cut` (just taken) as the chain's next delta, on a writer thread (the one before it
        has ended: `delta_now` and `export_now` wait for it first)."""
        version, seq = self.position
        self.position = (version, seq + 1)
        future, publication = concurrent.futures.Future(), bounded_export.Publication()
        args = (self.cut, cut, version, seq + 1, paused, publication)

        def run():
            try:
                future.set_result(self._write(*args))
            except BaseException as error:  # noqa: BLE001 - handed to `finish_pending` through the future
                future.set_exception(error)

        thread = threading.Thread(target=run, name=self.THREAD_NAME, daemon=True)
        thread.start()
        self._pending = (future, thread, publication)

    def _write(self, delta_cut, cut, version: int, seq: int, paused: dict, publication) -> None:
        """On the writer thread: one delta, from the ps tasks, into its hidden directory, then renamed
        (unless its wait was given up on: `publication`)."""
        began = time.monotonic()
        # Through an executor of the writer thread's own: on TF's default one, shared by every thread,
        # another thread's error on a ps's stream failed two deltas of seeded chaos plans (docs/chaos.md).
        with serving_deltas.new_delta(self.base_dir, version, seq) as scratch, on_thread_executor():
            manifest = delta_cut.write(cut, scratch, self.after_part)
            manifest.update(version=version, seq=seq, written_at=time.time())
            serving_deltas.write_manifest(scratch, manifest)
            if not publication.may_publish():
                raise bounded_export.Abandoned(scratch)  # given up on: removed, never renamed
        path = os.path.join(serving_deltas.chain_dir(self.base_dir, version), str(seq))
        self.records.append({"path": path, "version": version, "seq": seq, **paused,
                             "write_seconds": time.monotonic() - began, "bytes": _bytes(path),
                             "changed": sum(sum(t["changed"]) for t in manifest["tables"]),
                             "removed": sum(sum(t["removed"]) for t in manifest["tables"]),
                             "dense_rows_changed": sum(sum(d["changed"]) for d in manifest["dense"]
                                                       if d["form"] == "rows")})

    def finish_pending(self) -> None:
        """Wait for the delta being written; if it failed on a ps, the next version is a full one.

        Raises `PSUnavailableError` if a ps did not answer within `hang_timeout` meanwhile (the delta
        given up on, recorded as failed)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        future, thread, publication = pending
        try:
            _bounded_wait(lambda timeout: _ended(future, timeout), publication)
            future.result()
        except (tf.errors.OpError, CutLost, PSUnavailableError) as error:
            self.cut = None
            version, seq = self.position
            _log_full_instead(error, version, seq)
            # The chain stands at the last delta written: the failed one was never visible.
            self.position = (version, seq - 1)
            self.failures.append({"version": version, "seq": seq, "error": f"{type(error).__name__}: {error}"})
            if isinstance(error, PSUnavailableError):
                raise  # a hung ps: the callback notes it and makes a full version once the ps answers
        thread.join()

    def stop_writer(self) -> None:
        """Wait for the delta being written (at `fit`'s end); one given up on a hung ps is recorded in
        `failures` and logged, and does not fail the training."""
        try:
            self.finish_pending()
        except PSUnavailableError:
            pass  # recorded and logged by finish_pending; the next version is a full one


def _ended(future, timeout) -> bool:
    concurrent.futures.wait([future], timeout=timeout)
    return future.done()


def _bounded_wait(done: Callable, publication) -> None:
    """`done(None)`; on a cluster, given up on a ps that does not answer within the strategy's
    `hang_timeout` (`bounded_export.wait_bounded`)."""
    bounds = _hang_bounds()
    if bounds is None:
        done(None)
    else:
        bounded_export.wait_bounded(done, publication, *bounds, "a ServingExport delta's write")


def _log_full_instead(error, version, seq) -> None:
    logging.getLogger(__name__).warning(
        "psclient ServingExport: delta %d of version %d failed (%s: %s); the next version is a full one",
        seq, version, type(error).__name__, str(error).splitlines()[0] if str(error) else "")


def _bytes(path: str) -> int:
    return sum(entry.stat().st_size for entry in os.scandir(path) if entry.is_file())
