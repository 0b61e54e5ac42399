"""Each ps task writes and reads its own part of a checkpoint.

A checkpoint `ckpt-N` is TF's usual tensor bundle, written the way TF's own
saver writes one for variables on several tasks: one data file per ps task,
written by that task (`SaveV2` under `tf.device(ps)`), then the coordinator
merges the parts' small index files into `ckpt-N.index`
(`MergeV2Checkpoints`) and adds one part of its own with the few scalars it
holds (the completed count, the object graph, the layout below). The values
of the variables go from each ps to the filesystem, never through the
coordinator, so every ps must see the checkpoint directory (a shared
filesystem or a bucket; one machine for LocalCluster).

Unlike TF's saver, nothing here traces a function or syncs every task: each
part is a couple of eager ops on one ps, sent from a thread of its own (one
per ps, each with its own TF executor), involving that ps and the coordinator
only. A hung worker stalls none of it.

A partitioned variable is saved under one key, each shard as a slice of the
full shape (TF's `shape_and_slices`), by the ps that holds that shard. A
restore reads on each ps the slices its variables need (`RestoreV2` there,
which assembles a slice from whichever parts hold its rows) and assigns them
there: a checkpoint restores into another number of ps tasks or shards, and
the values never pass through the coordinator. It reads every value twice,
a batch of at most `READ_BATCH_BYTES` at a time: first every ps checks that
all of its values read (RestoreV2 verifies checksums) and keeps none
(`read_on_ps`), then each reads and assigns them again (`assign_on_ps`,
which applies a checkpoint's deltas to each batch before it assigns it). A
damaged checkpoint thus leaves every variable untouched, and a ps holds at
most about one batch beyond its variables, never a second copy of them.

A slot above `READ_BATCH_BYTES` is saved in row chunks of at most that
size (slices of its key, `save_chunked`: a split along rows shares the
value's buffer when a row is a multiple of 64 bytes, so a save costs no
copy; other slots are saved whole) and read and assigned in row ranges
(`Piece`: RestoreV2 of a sub-slice, a sliced assign on the ps). RestoreV2
reads a sub-range of a tensor by reading each saved slice it overlaps
whole: only the keys the layout lists under `row_chunks` are read in
ranges, the rest a slot at a time (checkpoints written before).

A ps also writes its shards of the dynamic embedding tables in its part, in
the same SaveV2 call (`table_checkpoint`).

A save is taken in two steps, a snapshot in a cut and a write while training
goes on (`checkpoint_snapshot`); this module holds what both share and the
restore. Every call on the ps tasks goes through `on_each_ps` (`ps_calls`),
which gives up on a ps that answers nothing, neither the call nor a probe, for
`hang_timeout` (`PsTimeout` names it): a TF call cannot be cancelled, so the
thread given up on goes on until its ps answers or dies, and nothing it wrote
is ever merged.

Parts are written in a scratch directory (`.psclient-save-*`, a dot-name no
reader lists) and moved to their final names by the merge, after every part
is complete: a part cut short by a ps that died is never under a checkpoint's
name.

The ops behind `tf.train.Checkpoint` (`SaveV2`, `RestoreV2`,
`MergeV2Checkpoints`: TF-internal) come from `psclient._tf.checkpoints`.
"""

from __future__ import annotations

import os
import secrets
from typing import Any, Callable

import tensorflow as tf
from tensorflow.core.protobuf import trackable_object_graph_pb2 as pb

from psclient._coordinator import runtime as _runtime
from psclient._coordinator.variables.sharding import is_partitioned
from psclient._coordinator.checkpoints.ps_calls import THREAD_PREFIX, late_threads, on_each_ps, waiting_on
from psclient._coordinator.checkpoints.checkpoint_pieces import (
    LOCAL,
    READ_BATCH_BYTES,
    Piece,
    batches,
    chunk_bytes,
    chunked_keys,
    coordinator_constant as _coordinator_constant,
    pieces_of,
    save_chunked,
)
from psclient._tf import checkpoints as _checkpoints
from psclient._core.errors import CheckpointUnreadable, PSClientError, PsTimeout, first_line

__all__ = ["CheckedPart", "CheckpointDirError", "CheckpointUnreadable", "CheckpointWriteError", "LAYOUT_KEY",
           "Piece", "PsTimeout", "READ_BATCH_BYTES", "Slot", "THREAD_PREFIX", "assign_on_ps", "batches",
           "late_threads", "on_each_ps", "probe_writable", "read_on_ps", "save_chunked", "slots_of", "waiting_on"]

#: The checkpoint's own description: which task wrote which data file with which keys.
LAYOUT_KEY = "psclient_layout"
VALUE_SUFFIX = "/.ATTRIBUTES/VARIABLE_VALUE"
GRAPH_KEY = "_CHECKPOINTABLE_OBJECT_GRAPH"


class CheckpointWriteError(PSClientError, OSError):
    """A ps task could not write its part of a checkpoint; names the task and the file."""


class CheckpointDirError(PSClientError, ValueError):
    """`checkpoint_dir` is not a directory every ps task can write and the coordinator sees."""


class Slot:
    """One tensor a ps task saves or restores: a whole variable, or one shard of a partitioned one."""

    __slots__ = ("key", "variable", "ps", "spec", "full_shape")

    def __init__(self, key: str, variable: Any, ps: int, spec: str, full_shape: list[int]):
        self.key, self.variable, self.ps, self.spec, self.full_shape = key, variable, ps, spec, full_shape


def slots_of(variables: dict[str, Any]) -> dict[int, list[Slot]]:
    """ps task -> what it holds of `variables` (key -> tf.Variable or partitioned variable)."""
    by_ps: dict[int, list[Slot]] = {}
    for key, variable in variables.items():
        name = key + VALUE_SUFFIX
        full = variable.shape.as_list()
        if not is_partitioned(variable):
            by_ps.setdefault(_ps_of(variable), []).append(Slot(name, variable, _ps_of(variable), "", full))
            continue
        start = 0
        for shard in variable.variables:
            rows = int(shard.shape[0])
            # TF's slice spec: the full shape, then "start,length" for axis 0, "-" (all) for the rest.
            spec = " ".join(str(d) for d in full) + " " + ":".join([f"{start},{rows}"] + ["-"] * (len(full) - 1))
            by_ps.setdefault(_ps_of(shard), []).append(Slot(name, shard, _ps_of(shard), spec, full))
            start += rows
    return by_ps


# LOCAL (checkpoint_pieces): the group of variables that live in this process (not on a ps): the
# coordinator writes them.


def _ps_of(variable: Any) -> int:
    ps = _runtime.ps_index_of(variable.device)
    return LOCAL if ps is None else ps


def device_of(ps: int):
    import contextlib

    return contextlib.nullcontext() if ps == LOCAL else tf.device(_runtime.ps_device(ps))


def describe_task(ps: int | None, describe_ps: Callable[[int], str]) -> str:
    if ps is None:
        return "a ps task"
    return "the coordinator" if ps == LOCAL else f"ps:{ps} ({describe_ps(ps)})"


def part_prefix(scratch: str, index: int, count: int) -> str:
    """What TF's `sharded_filename` names part `index` of `count` (the merge reads these names)."""
    return f"{scratch}/part-{index:05d}-of-{count:05d}"


class CheckedPart:
    """What one ps read and checked of a checkpoint, to read again and assign (`assign_on_ps`).

    Holds no value: `len()` is how many slots (variables or shards) the ps restores. `sources`:
    key -> a delta that holds that key whole (its newest), read instead of `path`; `chunked`: the
    keys saved in row chunks in every file they are read from.
    """

    __slots__ = ("path", "ps", "slots", "dtypes", "layout", "describe_ps", "chunked", "sources")

    def __init__(self, path: str, ps: int, slots: list[Slot], dtypes: dict[str, Any], layout: dict | None,
                 describe_ps: Callable[[int], str]):
        self.path, self.ps, self.slots, self.dtypes = path, ps, slots, dtypes
        self.layout, self.describe_ps = layout, describe_ps
        self.chunked = chunked_keys(layout)
        self.sources: dict[str, str] = {}

    def __len__(self) -> int:
        return len(self.slots)

    def batches(self) -> list[list[Piece]]:
        """Its slots in pieces (`pieces_of`), in batches."""
        return batches(pieces_of(self.slots, self.chunked, chunk_bytes(self.layout)))

    def allocate_unset(self) -> None:
        """Give each variable it restores in ranges that holds no value yet (made again on a
        restarted ps: a sliced assign cannot set one) a buffer of its shape, left uninitialized
        (`Empty`: its pages cost memory as the ranges fill them). On the device in force (its ps)."""
        for piece in pieces_of(self.slots, self.chunked, chunk_bytes(self.layout)):
            variable = piece.slot.variable
            if piece.stop is None or piece.start != 0 or tf.raw_ops.VarIsInitializedOp(resource=variable.handle).numpy():
                continue
            empty = tf.raw_ops.Empty(shape=_coordinator_constant(variable.shape.as_list(), tf.int32),
                                     dtype=variable.dtype, init=False)
            tf.raw_ops.AssignVariableOp(resource=variable.handle, value=empty)  # every row assigned below
            del empty

    def restore(self, some: list) -> list:
        """`some` (Slots or Pieces) read from the checkpoint (RestoreV2 on the device in force), each
        from its source."""
        by_path: dict[str, list[int]] = {}
        for i, s in enumerate(some):
            by_path.setdefault(self.sources.get(s.key, self.path), []).append(i)
        out = [None] * len(some)
        for path, at in by_path.items():
            got = _checkpoints.restore(path, [some[i].key for i in at], [some[i].spec for i in at],
                                       [self.dtypes[some[i].key] for i in at])
            for i, tensor in zip(at, got):
                out[i] = tensor
        return out


def read_on_ps(path: str, variables: dict[str, Any], dtypes: dict[str, Any],
               layout: dict | None, describe_ps: Callable[[int], str],
               only_ps: frozenset | None = None, timeout: float | None = None) -> dict[int, CheckedPart]:
    """Check that every slot's value can be read on its own ps: ps -> CheckedPart.

    Each ps reads its slots (RestoreV2 there, which verifies each value's
    checksum as it reads it) a batch at a time (`batches`) and drops each
    batch at once: a ps holds at most one batch beyond its variables, and
    nothing is kept. `assign_on_ps` reads them again to assign them: a
    restore reads every value twice, so that a damaged checkpoint leaves
    every variable untouched without any ps holding a second copy of its
    variables. `only_ps`: the slots those ps tasks hold, and no other (a
    part-only ps recovery). Raises CheckpointUnreadable naming the ps task
    that read, the key and the data files.
    """
    by_ps = slots_of(variables)
    if only_ps is not None:
        by_ps = {ps: slots for ps, slots in by_ps.items() if ps in only_ps}

    def check(ps: int) -> Callable[[], CheckedPart]:
        part = CheckedPart(path, ps, by_ps[ps], dtypes, layout, describe_ps)

        def run():
            with device_of(ps):
                for batch in part.batches():
                    try:
                        part.restore(batch)  # dropped at once: only whether it reads counts here
                    except tf.errors.OpError as error:
                        failing = _failing(batch, part.restore, tf.errors.OpError)  # a Piece
                        error._psclient_ps, error._psclient_slot = ps, getattr(failing, "slot", None)
                        raise
            return part
        return run

    try:
        return on_each_ps({ps: check(ps) for ps in by_ps}, timeout=timeout)
    except tf.errors.OpError as error:
        raise _unreadable(error, path, layout, by_ps, describe_ps, "") from error


def _unreadable(error: tf.errors.OpError, path: str, layout: dict | None, by_ps: dict[int, list[Slot]],
                describe_ps: Callable[[int], str], consequence: str) -> CheckpointUnreadable:
    ps = getattr(error, "_psclient_ps", None)
    slot = getattr(error, "_psclient_slot", None)
    slots = [slot] if slot is not None else by_ps.get(ps, [])
    what = (f"{slot.key.split('/')[0]} ({slot.variable.name})" if slot is not None
            else ", ".join(sorted({s.key.split("/")[0] for s in slots})))
    files = _files_of(path, layout, {s.key for s in slots})
    return CheckpointUnreadable(
        f"the value of {what} cannot be read by {describe_task(ps, describe_ps)} from {' or '.join(files)} "
        f"(corrupt or truncated data file?): {first_line(error)}{consequence}")


def _failing(slots: list, restore: Callable, errors) -> Any:
    """The first slot that cannot be read on its own (after the read of all of them failed)."""
    for slot in slots:
        try:
            restore([slot])
        except errors:
            return slot
    return None


#: What a read that passed the check and then fails means: the file changed between the two reads.
_REREAD_ERRORS = (tf.errors.DataLossError, tf.errors.NotFoundError, tf.errors.OutOfRangeError,
                  tf.errors.InvalidArgumentError)


def assign_on_ps(values: dict[int, CheckedPart], timeout: float | None = None,
                 patch: Callable[[Piece, Any], Any] | None = None) -> None:
    """Read again each value `read_on_ps` checked and assign it to its variable, on its ps, a
    batch at a time (all ps at once): a ps holds at most one batch beyond its variables.
    `patch(piece, tensor)`, run on the ps: the tensor to assign instead (a checkpoint's deltas
    applied to the piece's rows).

    Raises PsTimeout naming a ps still assigning after `timeout` seconds, and
    CheckpointUnreadable if a value that was read in the check cannot be read
    now (its file changed since): variables assigned before keep their new values.
    """
    def assign(part: CheckedPart) -> Callable[[], None]:
        def run():
            with device_of(part.ps):
                part.allocate_unset()
                for batch in part.batches():
                    try:
                        tensors = part.restore(batch)
                        if patch is not None:  # reads the deltas' rows too
                            tensors = [patch(piece, tensor) for piece, tensor in zip(batch, tensors)]
                    except _REREAD_ERRORS as error:
                        error._psclient_ps = part.ps
                        raise
                    for piece, tensor in zip(batch, tensors):
                        piece.assign(tensor)  # on this ps
                    del tensors  # before the next batch is read
        return run

    try:
        on_each_ps({ps: assign(part) for ps, part in values.items()}, timeout=timeout)
    except _REREAD_ERRORS as error:
        part = values.get(getattr(error, "_psclient_ps", None))
        if part is None:
            raise
        raise _unreadable(error, part.path, part.layout, {part.ps: part.slots}, part.describe_ps,
                          " (read without error a moment before: the file changed since). Some variables "
                          "were assigned their values from it already: restore again.") from error


def _files_of(path: str, layout: dict | None, keys: set[str]) -> list[str]:
    """The data files that hold `keys` (from the checkpoint's layout), else every data file."""
    if layout:
        files = [os.path.join(os.path.dirname(path), part["file"]) for part in layout.get("parts", [])
                 if keys & set(part.get("keys", []))]
        if files:
            return files
    return sorted(tf.io.gfile.glob(path + ".data-*")) or [path + ".data-*"]


def probe_writable(directory: str, num_ps: int, describe_ps: Callable[[int], str]) -> None:
    """Each ps writes a small file into `directory`, which the coordinator must then see.

    Raises CheckpointDirError naming the first ps that cannot write there, or whose
    file the coordinator does not find (the directory is not shared).
    """
    scratch = os.path.join(directory, f".psclient-probe-{secrets.token_hex(8)}")

    def write(ps: int) -> Callable[[], None]:
        def run():
            with tf.device(_runtime.ps_device(ps)):
                try:
                    _checkpoints.save(part_prefix(scratch, ps, num_ps), ["probe"], [""], [ps])
                except tf.errors.OpError as error:
                    error._psclient_ps = ps
                    raise
        return run

    try:
        try:
            on_each_ps({ps: write(ps) for ps in range(num_ps)})
        except tf.errors.OpError as error:
            ps = getattr(error, "_psclient_ps", None)
            raise CheckpointDirError(
                f"Invalid value for argument `checkpoint_dir`. Received: checkpoint_dir={directory!r}, "
                f"where ps:{ps} ({describe_ps(ps)}) cannot write: {first_line(error)}. Expected a "
                "directory every ps task can write (each ps writes its own part of every checkpoint)."
            ) from error
        for ps in range(num_ps):
            if not tf.io.gfile.exists(part_prefix(scratch, ps, num_ps) + ".index"):
                raise CheckpointDirError(
                    f"Invalid value for argument `checkpoint_dir`. Received: checkpoint_dir={directory!r}: "
                    f"ps:{ps} ({describe_ps(ps)}) wrote a file there that the coordinator does not "
                    "see. Expected one directory shared by the coordinator and every ps task (a "
                    "shared filesystem or a bucket): each ps writes its own part of every checkpoint."
                )
    finally:
        try:
            if tf.io.gfile.exists(scratch):
                tf.io.gfile.rmtree(scratch)
        except tf.errors.OpError:
            pass  # a directory nobody can write: nothing was left there


def object_graph(keys: list[str], scalars: list[str]) -> bytes:
    """A `tf.train.Checkpoint(key=variable, ...)` object graph, so TF's own readers find each key."""
    graph = pb.TrackableObjectGraph()
    root = graph.nodes.add()
    for name in [*keys, *scalars]:
        child = root.children.add()
        child.node_id, child.local_name = len(graph.nodes), name
        node = graph.nodes.add()
        attribute = node.attributes.add()
        attribute.name, attribute.full_name = "VARIABLE_VALUE", name
        attribute.checkpoint_key = name + VALUE_SUFFIX
    return graph.SerializeToString()
