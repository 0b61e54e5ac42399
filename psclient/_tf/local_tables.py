"""Lookup tables made before this process connected to a cluster, carried across the connection.

Connecting gives this process's CPU a new TF device under the same name
(`/job:localhost/replica:0/task:0/device:CPU:0`). TF would keep the old device
only if the server's session config serialized exactly as the context's
(`AreLocalDevicesCompatible` in TF's context_distributed_manager.cc); with TF
2.21 it made a new one whatever config it was given here (the context's own,
an empty one, one without `device_count`). Handles keep working for
state TF keeps in the handle itself (variables, datasets, iterators, anonymous
tables), but a lookup table created with a name (`tf.lookup.StaticHashTable`,
`MutableHashTable`, `DenseHashTable`, and what is built on them: Keras's
`StringLookup`, `IntegerLookup`, `TextVectorization`) lives in the old device's
resource manager, which the new device does not see. So before the first
connection every such table's contents are exported, and after it the table
is made again on the new device under its own name and the contents imported:
every handle made before (in a dataset's map function, a traced function, the
table object) then finds it, and a dataset graph that uses it serializes with
its contents, as it would have without the connection.

TF keeps no list of tables; Python's garbage collector is asked for the live
table objects, once per process (on the first connection).
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import warnings

import tensorflow as tf
from tensorflow.python.eager import context
from tensorflow.python.ops import gen_lookup_ops, lookup_ops

__all__ = ["SavedTable", "export_local_tables", "rebuild_tables", "subclasses"]

log = logging.getLogger("psclient")

#: Table classes that own their resource (StaticVocabularyTable and
#: IdTableWithHashBuckets wrap one of these, found on its own).
_OWNERS = (lookup_ops.StaticHashTable, lookup_ops.MutableHashTable, lookup_ops.DenseHashTable)


@dataclasses.dataclass
class SavedTable:
    """One table's contents, exported before the connection."""

    table: object  # the Python table object (kept alive until rebuilt)
    device: str
    keys: tf.Tensor
    values: tf.Tensor


def export_local_tables() -> list[SavedTable]:
    """Every live named lookup table on this process's own devices, its contents exported now.

    Nothing when TF's eager context was not made yet (then nothing was).
    """
    if not context.context()._initialized:  # noqa: SLF001 - no public "was anything made" test
        return []
    local = context.context().host_address_space()
    owners = subclasses(_OWNERS)
    saved, seen = [], set()
    # `type(...) in` a set, not isinstance: with Keras imported the heap holds some
    # 350,000 objects, and isinstance took 1.5 s over them here, the set 0.3 s.
    for table in [candidate for candidate in gc.get_objects() if type(candidate) in owners]:
        if getattr(table, "_is_anonymous", False):
            continue  # anonymous tables live in their handle, which survives
        handle = getattr(table, "_resource_handle", None)
        if handle is None or not hasattr(handle, "numpy") or not handle.device.startswith(local):
            continue  # not made yet, made in a graph, or on a remote task
        key = (handle.device, table._shared_name)  # noqa: SLF001
        if key in seen:
            continue
        seen.add(key)
        try:
            with tf.device(handle.device):
                keys, values = gen_lookup_ops.lookup_table_export_v2(
                    handle, Tkeys=table.key_dtype, Tvalues=table.value_dtype)
        except tf.errors.OpError as error:  # a table kind whose kernel cannot export
            warnings.warn(
                f"Lookup table {table._shared_name!r} ({type(table).__name__}) was made before "  # noqa: SLF001
                "psclient.ParameterServerStrategy(...) connected this process to the cluster and "
                f"cannot be carried over ({type(error).__name__}: {str(error).splitlines()[0]}); "
                "anything that uses it afterwards fails. Make it after creating the strategy.",
                RuntimeWarning, stacklevel=2,
            )
            continue
        saved.append(SavedTable(table, handle.device, keys, values))
    return saved


def subclasses(classes) -> set:
    """`classes` and every subclass of theirs defined so far."""
    found, pending = set(), list(classes)
    while pending:
        cls = pending.pop()
        if cls not in found:
            found.add(cls)
            pending.extend(cls.__subclasses__())
    return found


def rebuild_tables(saved: list[SavedTable]) -> None:
    """After the connection: each exported table made again under its name, its contents imported."""
    for entry in saved:
        with tf.device(entry.device):
            handle = entry.table._create_resource()  # noqa: SLF001 - the same op, the same shared name
            gen_lookup_ops.lookup_table_import_v2(handle, entry.keys, entry.values)
    if saved:
        log.info("carried %d lookup table(s) made before the connection onto this process's new device",
                 len(saved))
