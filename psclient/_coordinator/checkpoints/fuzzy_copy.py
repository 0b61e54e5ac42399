"""Big variables copied before a checkpoint's cut, while training goes on; the cut reads only what changed.

Reading a variable updated by sparse ops in the cut copies it whole there
(TF's copy-on-read mode), so the pause would grow with the embedding tables'
bytes. For each variable (or shard) with write marks (`psclient._tf.write_marks`:
those above one row chunk of a checkpoint) that was written only by sparse ops
since the previous checkpoint:

1. `prepare`, before dispatch pauses: its marks are cleared, then its rows are
   copied on its ps into a staging variable of its shape, a chunk of
   `chunk_rows` rows at a time (`ResourceGather`, then a scatter into the
   stage: each copy holds the variable for the time of one chunk). Training
   goes on, so each chunk is its rows as of its own moment.
2. `cut`, in the cut (nothing running): the rows marked since step 1 are read
   again and scattered into the stage (`where` on the marks, one gather, one
   scatter). Every write after a chunk was copied marked its rows (a mark
   follows its write, and the closures that wrote ended before the cut), so
   the stage now holds exactly the cut's values. It is then read sharing its
   buffer (`DisableCopyOnRead` first): the snapshot holds that read, a tensor
   like any other, and the stage itself is dropped. A variable written whole
   since step 1 (a dense `assign*`) is read whole in the cut instead.

A variable not scattered since the previous checkpoint (never written,
written densely, or only scattered before) is left to the cut. One scattered
before stays in TF's copy-on-read mode, so its read in the cut would copy it
whole there (53 ms for 1 GB here: benchmarks/quiet_checkpoint.py);
`prepare` turns that mode off for it (`DisableCopyOnRead`), so the cut's
read shares its buffer. Should training scatter it again while the
checkpoint still holds that read, TF copies the variable once in that
scatter (its buffer is shared), on the ps, outside the pause; a variable
left alone (frozen embeddings) is never copied. Memory on a ps: one stage
per copied variable (what the cut's copy took before) and one chunk in
flight, plus the marks (one byte a row). Big bounded DynamicEmbedding shards
are copied by the same `prepare`, and packed after the cut (`table_copy`); so are the shards of
tables in hash storage, merged after it (`hash_copy`).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

import tensorflow as tf

from psclient._coordinator.checkpoints import checkpoint_pieces as _pieces
from psclient._coordinator.checkpoints import hash_copy as _hash_copy
from psclient._coordinator.checkpoints import stages as _stages
from psclient._coordinator.checkpoints import table_copy as _table_copy
from psclient._coordinator.checkpoints.checkpoint_parts import (
    CheckpointWriteError,
    PsTimeout,
    describe_task,
    device_of,
    on_each_ps,
    slots_of,
)
from psclient._core.errors import first_line
from psclient._tf import write_marks as _write_marks
from psclient._tf.registrations import function_not_registered_yet

__all__ = ["Prepared", "cut", "prepare"]

log = logging.getLogger("psclient")


class _Copy:
    """One slot's stage, filled on its ps before the cut (`prepare`)."""

    __slots__ = ("slot", "marks", "stage")

    def __init__(self, slot: Any, marks: Any, stage: Any):
        self.slot, self.marks, self.stage = slot, marks, stage


class Prepared:
    """The copies of one checkpoint's big variables (by ps and slot) and bounded table shards (by ps
    and id(shard): `table_copy`, `hash_copy`), until its cut takes them and its write releases them."""

    def __init__(self, copies: dict[int, dict[tuple, _Copy]], tables: dict[int, dict[int, Any]], seconds: float):
        self.copies, self.tables, self.seconds = copies, tables, seconds
        self.nbytes = sum(_pieces.slot_bytes(copy.slot) for by_slot in copies.values() for copy in by_slot.values())
        self.nbytes += sum(copy.nbytes for by_shard in tables.values() for copy in by_shard.values())
        #: Rows the cut read again: ps -> one count per copy (`cut`, `table_copy.cut`), tensors on
        #: the ps until `release` fetches them (with a timeout), then ints.
        self.read_again: dict[int, list] = {}

    def take(self, ps: int, slot: Any) -> _Copy | None:
        return self.copies.get(ps, {}).get((slot.key, slot.spec))

    def take_table(self, ps: int, shard: Any) -> Any:
        """The shard's `table_copy.TableCopy` if it was copied and is still current, else None."""
        copy = self.tables.get(ps, {}).get(id(shard))
        return copy if copy is not None and copy.shard is shard and copy.current() else None

    def rows_read_again(self) -> int:
        """How many rows the cut read again (counted by `release`; a ps that did not answer: 0)."""
        return sum(count for counts in self.read_again.values() for count in counts if isinstance(count, int))

    def release(self, timeout: float | None = None, hung: int | None = None) -> None:
        """Drop the stages once the checkpoint is written (its reads of them kept what it wrote):
        each first given an empty value on its ps (`stages.empty`). Fetches the counts of rows read
        again. Waits at most `timeout` for a ps (a hung one keeps its stages until it answers), and
        not at all for `hung`, a ps the write already waited `timeout` for: its call goes on alone."""
        copies, self.copies = self.copies, {}
        tables, self.tables = self.tables, {}

        def empty_on(ps: int) -> Callable[[], None]:
            def run() -> None:
                with device_of(ps):
                    counts = self.read_again.get(ps, [])
                    self.read_again[ps] = [int(n) for n in tf.stack(counts).numpy()] if counts else []
                    for copy in copies.get(ps, {}).values():
                        _stages.empty(copy.stage)
                    for copy in tables.get(ps, {}).values():
                        copy.release()
            return run

        work = {ps: empty_on(ps) for ps in set(copies) | set(tables)}
        waits = [({hung: work.pop(hung)}, 0.0)] if hung in work else []
        for part, wait in [*waits, (work, timeout)]:
            try:
                on_each_ps(part, timeout=wait)
            except (tf.errors.OpError, PsTimeout) as error:  # a lost or hung ps: the write says so
                log.debug("stages of a checkpoint not emptied: %s", first_line(error))


def prepare(variables: dict[str, Any], describe_ps: Callable[[int], str],
            timeout: float | None = None, tables: dict[str, Any] | None = None,
            stop: Callable[[], bool] | None = None) -> Prepared | None:
    """Copy, on each ps, the marked variables written only by sparse ops since the last prepare, and
    the marked shards of `tables` (`table_copy.copy_shards`), training going on. None when none is;
    also when a ps fails (logged: the cut then reads everything, as without a copy), and when
    `stop()` turns true (checked between chunks: a ps recovery or shutdown wants the copy to end).
    Raises CheckpointWriteError naming a ps that does not answer for `timeout` after its last
    chunk began: a cut would wait on it as long again, dispatch paused."""
    started = time.monotonic()
    marked = {ps: [(slot, marks) for slot in slots if (marks := _write_marks.marks_of(slot.variable)) is not None]
              for ps, slots in slots_of(variables).items()}
    marked = {ps: slots for ps, slots in marked.items() if slots}
    shards: dict[int, list] = {}
    for table in (tables or {}).values():
        for shard in table.shards:
            if shard.marked:  # bounded (`table_copy`) or in hash storage (`hash_copy`)
                shards.setdefault(_pieces.task_of(shard), []).append(shard)
    if not marked and not shards:
        return None

    # Once one ps's copy fails, the others stop at their next chunk: the cut reads everything anyway,
    # and a ps loss's recovery waits on this thread (it took the rest of a 1 GB copy: 1.1 s).
    failed: list = []
    # Each chunk's start: the copy of a big model takes longer than `timeout` but goes on; a ps
    # that stops answering ends it `timeout` after its last chunk.
    progress = [time.monotonic()]

    def given_up() -> bool:
        progress[0] = time.monotonic()
        return bool(failed) or (stop is not None and stop())

    finished: dict[int, tuple] = {}  # the copies of each ps that ended its work
    # Set when the copy as a whole is given up: a ps's copy that ends after that (its thread was
    # still waiting on a hung ps) drops itself, else it stayed until the next copy.
    abandoned, finishing = [False], threading.Lock()

    def copy_on(ps: int) -> Callable[[], tuple]:
        def run() -> tuple:
            with device_of(ps):
                try:
                    tables = _table_copy.copy_shards(shards.get(ps, []), stop=given_up)
                    tables.update(_hash_copy.copy_shards(shards.get(ps, []), stop=given_up))
                    copied = (_copy_sparse_written(marked.get(ps, []), stop=given_up), tables)
                    with finishing:
                        late = abandoned[0]
                        if not late:
                            finished[ps] = copied
                    if late and (unused := _prepared({ps: copied}, 0.0)):
                        unused.release(timeout=timeout)
                    return copied
                except tf.errors.OpError as error:
                    error._psclient_ps = ps
                    if not function_not_registered_yet(error):  # that one is made again (`on_each_ps`)
                        failed.append(error)
                    raise
        return run

    try:
        done = on_each_ps({ps: copy_on(ps) for ps in set(marked) | set(shards)}, timeout=timeout,
                          progress=lambda: float("-inf") if stop is not None and stop() else progress[0])
    except (tf.errors.OpError, PsTimeout, _stages.CopyStopped) as error:
        # The ps that ended their copies drop them: stages emptied, hash shards' writes no longer
        # noting their keys (else both stayed until the next copy).
        with finishing:
            abandoned[0] = True
            ended = dict(finished)
        if unused := _prepared(ended, 0.0):
            unused.release(timeout=timeout)
        if not failed and stop is not None and stop():
            log.info("the copy before a checkpoint's cut was stopped (a ps recovery or shutdown)")
            return None
        failed.append(error)  # a ps that does not answer: the others stop too
        error = failed[0]  # the ps that failed first, not one stopped for it
        where = describe_task(getattr(error, "_psclient_ps", None), describe_ps)
        if isinstance(error, PsTimeout):  # hung: the cut would wait on it as long again, dispatch paused
            raise CheckpointWriteError(
                f"{where} could not copy its variables before a checkpoint's cut: no answer within "
                f"{timeout:g} s (the ps may hang). No checkpoint was written; the previous one stays the "
                "newest.") from error
        log.warning("%s could not copy its variables before a checkpoint's cut (%s): the cut reads them whole",
                    where, first_line(error))
        return None
    return _prepared(done, time.monotonic() - started)


def _prepared(done: dict[int, tuple], seconds: float) -> Prepared | None:
    """The copies of `done` (ps -> (by slot, by shard)), None when it holds none."""
    copies = {ps: by_slot for ps, (by_slot, _) in done.items() if by_slot}
    table_copies = {ps: by_shard for ps, (_, by_shard) in done.items() if by_shard}
    return Prepared(copies, table_copies, seconds) if copies or table_copies else None


def _copy_sparse_written(slots: list, stop: Callable[[], bool] | None = None) -> dict[tuple, _Copy]:
    """On the ps in force: a stage for each slot scattered, and not written whole, since the marks were
    last cleared, filled chunk by chunk; every slot's marks cleared first (so those copied mark what
    is written from then on). `stop`: as `stages.copy_in_chunks`'."""
    if not slots:
        return {}
    flags = tf.stack([marks.flags() for _slot, marks in slots]).numpy()
    for _slot, marks in slots:
        marks.reset()
    out = {}
    with _stages.emptied_on_failure() as made:
        for (slot, marks), (scattered, whole) in zip(slots, flags):
            _copy_one(slot, marks, scattered, whole, made, out, stop)
    return out


def _copy_one(slot: Any, marks: Any, scattered: int, whole: int, made: list, out: dict,
              stop: Callable[[], bool] | None) -> None:
    """`_copy_sparse_written` for one slot: its stage in `made` as soon as it exists, its copy in `out`."""
    if not scattered:
        # Left to the cut, its read then sharing the buffer: copy-on-read mode (from scatters
        # before the previous checkpoint) would copy it whole in the pause.
        tf.raw_ops.DisableCopyOnRead(resource=slot.variable.handle)
        return
    if whole:
        return  # written densely since: read whole in the cut
    variable = slot.variable
    shape = variable.shape.as_list()
    stage = _stages.new_stage(shape, variable.dtype)
    made.append(stage)
    _stages.copy_in_chunks(variable, stage, shape[0], _pieces.chunk_rows(shape, variable.dtype, aligned=False), stop)
    out[(slot.key, slot.spec)] = _Copy(slot, marks, stage)
    # Traced now, not in the cut (once per shape and dtype: a later checkpoint finds it).
    _cut_one.get_concrete_function(marks.rows, marks.whole, variable, stage)


def cut(prepared: Prepared, ps: int, copies: list[_Copy]) -> list:
    """In the cut, on the ps in force: each copy's value, its stage with the rows marked since its
    copy read again, or the variable read whole where it was written whole since."""
    out = []
    for copy in copies:
        # One call on the ps per copy, nothing fetched: the stall counts each round trip.
        value, count = _cut_one(copy.marks.rows, copy.marks.whole, copy.slot.variable, copy.stage)
        prepared.read_again.setdefault(ps, []).append(count)
        out.append(value)
    return out


@tf.function(autograph=False)
def _cut_one(marks, whole, variable, stage):
    """(value at the cut, rows read again): `variable` read whole if `whole` is set, else `stage`
    with the rows `marks` flags read again, read sharing its buffer (the scatters put it in
    copy-on-read mode; nothing writes it afterwards, and `release` empties it)."""
    def patched():
        indices = tf.reshape(tf.where(marks.read_value() > 0), [-1])
        _stages.move_rows(variable, stage, indices)
        tf.raw_ops.DisableCopyOnRead(resource=stage.handle)  # after the scatter: same resource, in order
        return stage.read_value(), tf.size(indices, out_type=tf.int64)

    return tf.cond(whole.read_value() > 0, lambda: (variable.read_value(), tf.constant(0, tf.int64)), patched)
