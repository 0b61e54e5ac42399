"""A full checkpoint's deltas in a restore: each checked in the first pass, applied in the second.

A restore reads each value twice (`checkpoint_parts`): a check, then a read
that assigns it, a batch at a time. With deltas (`checkpoint_deltas`), the
first pass also checks each complete delta in order (`check`: its whole
values, the changed rows of each row-diffed shard, its tables' changes,
each read on the ps that will apply it and dropped) and stops at the first
missing or damaged one. The second pass then builds each batch's values
from the full checkpoint and the deltas checked (`Chain`):

- a variable a delta holds whole is read from the newest such delta instead
  of the full checkpoint (`CheckedPart.sources`);
- a row-diffed one is read from the full checkpoint (or that delta), and the
  changed rows of each later delta that fall in the batch's rows are
  scattered into it, on its ps (`Chain.patch`): the delta's row indices are
  sorted, so the rows of a range are one range of the delta's rows, read
  alone (a slice of its key);
- a table shard's saved state gets each delta's changes in turn
  (`table_deltas.patcher`), one shard at a time.

So a ps holds, beyond its variables, about one batch and the changed rows of
it, never a second copy of its variables or tables, and no value passes
through the coordinator.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from typing import Any, Callable

import tensorflow as tf

from psclient._coordinator.checkpoints import checkpoint_pieces as _pieces
from psclient._coordinator.checkpoints import table_deltas
from psclient._coordinator.checkpoints.checkpoint_parts import (
    LAYOUT_KEY,
    VALUE_SUFFIX,
    CheckedPart,
    CheckpointUnreadable,
    device_of,
    on_each_ps,
    read_on_ps,
    slots_of,
)
from psclient._coordinator.checkpoints.table_deltas import constant as _constant
from psclient._core.errors import first_line
from psclient._tf import checkpoints as _checkpoints

__all__ = ["Chain", "Delta", "check"]

_COMPLETED = "psclient_completed" + VALUE_SUFFIX


@dataclasses.dataclass
class Delta:
    """One delta checked in the first pass: what the second applies of it."""

    path: str
    #: key -> [[first row, rows], ...]: its row-diffed shards.
    rows: dict
    #: keys it holds whole.
    whole: frozenset
    shapes: dict
    chunked: frozenset
    #: the row chunk size it was saved with (None: saved whole).
    chunk: int | None
    #: its layout's tables entry.
    tables: dict
    completed: int | None
    meta: dict


def check(path: str, delta: str, variables: dict[str, Any], tables: dict, only_ps: frozenset | None,
          describe_ps: Callable[[int], str], timeout: float | None) -> Delta:
    """Read and check every value of the delta `delta` of `path` on the ps that will apply it
    (dropped at once). Raises CheckpointUnreadable saying what is wrong."""
    try:
        reader = tf.train.load_checkpoint(delta)
        shapes, dtypes = reader.get_variable_to_shape_map(), reader.get_variable_to_dtype_map()
        layout = json.loads(reader.get_tensor(LAYOUT_KEY))
        completed = int(reader.get_tensor(_COMPLETED)) if _COMPLETED in shapes else None
    except (tf.errors.OpError, ValueError, IndexError) as error:
        raise CheckpointUnreadable(f"its index or layout cannot be read: {first_line(error)}") from error
    info = layout.get("delta") or {}
    if info.get("base") != os.path.basename(path):
        raise CheckpointUnreadable(f"it is a delta of {info.get('base')!r}, not of {os.path.basename(path)}")
    rows = info.get("rows", {})
    whole, problems = {}, []
    for key, variable in variables.items():
        name = key + VALUE_SUFFIX
        if name in rows:
            continue
        if name not in shapes:
            problems.append(f"{key} ({variable.name}) is not in it")
        elif list(shapes[name]) != variable.shape.as_list() or dtypes[name] != variable.dtype:
            problems.append(f"{key} ({variable.name}) has shape {list(shapes[name])} {dtypes[name].name} "
                            f"there but {variable.shape.as_list()} {variable.dtype.name} here")
        else:
            whole[key] = variable
    if problems:
        raise CheckpointUnreadable("; ".join(problems[:5]))
    if tables:
        missing = [key for key in tables if key not in layout.get("tables", {})]
        if missing:
            raise CheckpointUnreadable(f"the dynamic tables {', '.join(missing)} are not in it")
    read_on_ps(delta, whole, dtypes, layout, describe_ps, only_ps, timeout=timeout)  # raises CheckpointUnreadable
    checked = Delta(delta, rows, frozenset(k + VALUE_SUFFIX for k in whole), shapes, _pieces.chunked_keys(layout),
                    _pieces.chunk_bytes(layout), layout.get("tables", {}), completed,
                    {k: v for k, v in layout.items() if k not in ("format", "parts", "tables", "delta", "row_chunks")})
    _check_rows(checked, variables, only_ps, timeout)
    if tables:
        try:
            table_deltas.check(delta, tables, checked.tables, only_ps, functools.partial(on_each_ps, timeout=timeout))
        except tf.errors.OpError as error:
            raise CheckpointUnreadable(
                f"the changes to {getattr(error, '_psclient_table', 'a dynamic table')} cannot be read "
                f"(corrupt or truncated data file?): {first_line(error)}") from error
    return checked


def _check_rows(delta: Delta, variables: dict[str, Any], only_ps: frozenset | None, timeout: float | None) -> None:
    """Each ps reads the changed rows it will apply (of each delta shard its slots overlap, once), a
    range at a time, and drops them."""
    by_ps = {ps: [s for s in slots if s.key in delta.rows] for ps, slots in slots_of(variables).items()
             if only_ps is None or ps in only_ps}

    def run_on(ps: int) -> Callable[[], None]:
        def run():
            seen = set()
            with device_of(ps):
                for slot in by_ps[ps]:
                    piece = _pieces.Piece(slot)
                    for first, count in _overlapping(delta, piece.key, piece.first_row, int(slot.variable.shape[0])):
                        if (slot.key, first) in seen:
                            continue
                        seen.add((slot.key, first))
                        at = f"{slot.key}/delta/{first}"
                        try:
                            _checkpoints.restore(delta.path, [at + "/idx"], [""], [tf.int64])
                            shape = list(delta.shapes[at + "/rows"])
                            step = (_pieces.chunk_rows(shape, slot.variable.dtype, delta.chunk)
                                    if at + "/rows" in delta.chunked else None) or max(shape[0], 1)
                            for start in range(0, shape[0], step):
                                _read_rows(delta, at, shape, start, min(shape[0], start + step), slot.variable.dtype)
                        except tf.errors.OpError as error:
                            error._psclient_what = f"{slot.key.split('/')[0]} ({slot.variable.name})"
                            raise
        return run

    try:
        on_each_ps({ps: run_on(ps) for ps in by_ps if by_ps[ps]}, timeout=timeout)
    except tf.errors.OpError as error:
        raise CheckpointUnreadable(
            f"the changed rows of {getattr(error, '_psclient_what', 'a variable')} cannot be read "
            f"(corrupt or truncated data file?): {first_line(error)}") from error


def _overlapping(delta: Delta, key: str, start: int, length: int) -> list:
    """The delta's row-diffed shards of `key` ([first, rows]) that overlap rows [start, start + length)."""
    return [(first, rows) for first, rows in delta.rows.get(key, ())
            if first < start + length and first + rows > start]


def _read_rows(delta: Delta, at: str, shape: list[int], start: int, stop: int, dtype):
    """Rows [start, stop) of `at/rows` (a slice of the key: only the chunks saved that hold them)."""
    spec = "" if (start, stop) == (0, shape[0]) else _pieces.rows_spec(shape, start, stop - start)
    return _checkpoints.restore(delta.path, [at + "/rows"], [spec], [dtype])[0]


class Chain:
    """The deltas checked, in order, as the second pass applies them (`assign_on_ps`'s `patch`)."""

    def __init__(self, deltas: list[Delta]):
        self.deltas = deltas
        #: key -> the newest delta that holds it whole (read there instead of the full checkpoint).
        self.sources: dict[str, str] = {}

    def route(self, parts: dict[int, CheckedPart]) -> None:
        """Point each part's keys a delta holds whole at the newest such delta."""
        for part in parts.values():
            chunked = set(part.chunked)
            for slot in part.slots:
                for delta in reversed(self.deltas):
                    if slot.key in delta.whole:
                        self.sources[slot.key] = part.sources[slot.key] = delta.path
                        if slot.key not in delta.chunked:
                            chunked.discard(slot.key)
                        break
            part.chunked = frozenset(chunked)

    def patch(self, piece, tensor):
        """`tensor` (the piece's rows, read from its source) with the changed rows of every delta
        after its source applied in order, on the ps in force."""
        source = self.sources.get(piece.key)
        after = source is None
        for delta in self.deltas:
            if not after:
                after = delta.path == source
                continue
            if piece.key in delta.rows:
                tensor = _scatter(delta, piece, tensor)
        return tensor


def _scatter(delta: Delta, piece, tensor):
    """`tensor` (the piece's rows) with the delta's changed rows that fall in it, on the ps in force."""
    start, length = piece.first_row, int(tensor.shape[0])
    dtype = piece.slot.variable.dtype
    for first, count in _overlapping(delta, piece.key, start, length):
        at = f"{piece.key}/delta/{first}"
        shape = list(delta.shapes[at + "/rows"])
        low, high = max(start, first) - first, min(start + length, first + count) - first  # in the delta shard
        (indices,) = _checkpoints.restore(delta.path, [at + "/idx"], [""], [tf.int64])
        if int(indices.shape[0]) == 0:  # the shard whole (or nothing changed)
            if shape[0] == 0:
                continue
            p, q = low, high
            positions = tf.range(_constant(first + low - start, tf.int64), _constant(first + high - start, tf.int64),
                                 _constant(1, tf.int64))
        else:  # sorted: the rows in [low, high) are rows [p, q) of the delta's
            bounds = tf.raw_ops.LowerBound(sorted_inputs=tf.reshape(indices, _constant([1, -1], tf.int32)),
                                           values=_constant([[low, high]], tf.int64), out_type=tf.int64)
            p, q = (int(b) for b in bounds.numpy()[0])  # two integers to the coordinator
            if q == p:
                continue
            positions = tf.raw_ops.Slice(input=indices, begin=_constant([p], tf.int64), size=_constant([q - p], tf.int64))
            positions = positions + _constant(first - start, tf.int64)
        changed = _read_rows(delta, at, shape, p, q, dtype)
        tensor = tf.tensor_scatter_nd_update(tensor, tf.reshape(positions, _constant([-1, 1], tf.int32)), changed)
    return tensor
