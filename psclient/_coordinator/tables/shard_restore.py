"""A dense shard's restore sections traced once per form of shard, not once per shard.

A restore (or an import) writes each dense shard's state with a traced call
on its ps (`DenseShard.replace`, or `replace_row_keys` and `replace_counters`
for a shard restored in row ranges): traced, because run eagerly under the
ps's device each Python value in its ops would be converted there
(`DenseShard._on_ps`). Traced per shard, closing over that shard's
variables, every shard was traced, registered on every task and
instantiated on its ps on its own: the first restore of 26 small tables on 2
ps took 13-16 s, later ones 0.5-0.7 s (docs/dynamic_embeddings.md).

Here each section is one `tf.function` whose arguments are the shard's
storage (its variables, and its key index's and pending keys' table
handles, and its share of rows, made on the coordinator) and the state to
write; what shapes the graph and is not a tensor (the section, `dim`, the
slots' names and initial values) is its form. Alike shards (the tables of a
model mostly share a form, whatever their capacities) are written
by one concrete function: traced and registered once, instantiated once
per ps (the first call there). Every ps shares the trace: called eagerly
outside a distribution strategy's scope, a `tf.function` keys its traces
without the caller's device, and its ops run where the call is placed (the
shard's ps), beside the resources given. The state's tensors are given
with unknown dimensions (`_generalized`), so shards of other sizes, and
later restores, reuse the same trace.

Inside the trace the section runs `DenseShard`'s own code (`_replace`,
`_replace_row_keys`, `_replace_counters`) over a view of the shard
(`_view`) that holds the function's inputs in place of the shard's
variables and tables, and nothing else: a section that reached for
anything more of the shard would fail to trace, never capture it.
"""

from __future__ import annotations

import tensorflow as tf

from psclient._coordinator.runtime import coordinator_cpu
from psclient._coordinator.tables.key_index import KeyIndex
from psclient._tf.executors import streamed_function_registrations
from psclient._tf.registrations import Renewable, until_registered
from psclient._tf import write_marks as _write_marks

__all__ = ["SECTIONS", "form_of", "run", "storage_of", "trace_count"]

#: The sections a restore runs through here (`DenseShard` methods; their arguments as the shard passes them).
SECTIONS = ("_replace", "_replace_row_keys", "_replace_counters")


class _Table:
    """A lookup table's ops on a handle that is an input of the traced function (not captured)."""

    def __init__(self, handle, key_dtype, value_dtype):
        self.resource_handle, self.key_dtype, self.value_dtype = handle, key_dtype, value_dtype

    def export(self):
        return tf.raw_ops.LookupTableExportV2(table_handle=self.resource_handle, Tkeys=self.key_dtype,
                                              Tvalues=self.value_dtype)

    def insert(self, keys, values):
        return tf.raw_ops.LookupTableInsertV2(table_handle=self.resource_handle, keys=keys, values=values)

    def remove(self, keys):
        return tf.raw_ops.LookupTableRemoveV2(table_handle=self.resource_handle, keys=keys)


def storage_of(shard) -> dict:
    """The shard's storage as the traced function's inputs: its variables, its tables' handles, and
    its share (made on the coordinator: made under the ps's device, TF would copy it there inside
    the conversion, holding the GIL)."""
    with tf.device(coordinator_cpu()):
        share = tf.constant(shard.share, tf.int64)
    return {"share": share, "rows": shard.rows, "row_key": shard.row_key, "last": shard.last, "free": shard.free,
            "free_count": shard.free_count, "clock": shard.clock, "admissions": shard.admissions,
            "evictions": shard.evictions, "slots": dict(shard.slots), "index": shard.index.table.resource_handle,
            "index_removed": shard.index.removed, "pending": shard.pending.resource_handle}


def form_of(shard) -> tuple:
    """What of `shard` shapes a restore section's graph and is no tensor: (dim, slot defaults,
    pending's value dtype). Shards of one form share the section's trace."""
    return (shard.dim, tuple(sorted((name, shard.slot_defaults[name]) for name in shard.slots)),
            shard.pending.value_dtype.name)


def _view(shard_type, form: tuple, storage: dict):
    """A `shard_type` (DenseShard) whose storage is `storage` (the traced function's inputs), with
    nothing else set: its restore sections run on it inside the trace."""
    dim, slot_defaults, pending_dtype = form
    index = object.__new__(KeyIndex)  # the index's ops (reset, lookup) over the handle given
    index.table = _Table(storage["index"], tf.int64, tf.int32)
    index.removed = storage["index_removed"]
    view = object.__new__(shard_type)
    view.__dict__.update(
        dim=dim, share=storage["share"], slot_defaults=dict(slot_defaults), index=index,
        pending=_Table(storage["pending"], tf.int64, tf.as_dtype(pending_dtype)),
        **{name: storage[name] for name in ("rows", "row_key", "last", "free", "free_count", "clock",
                                            "admissions", "evictions", "slots")})
    return view


def _run_section(shard_type, name: str, form: tuple, storage: dict, args: tuple):
    view = _view(shard_type, form, storage)
    getattr(view, name)(*args)


#: Traced per form; made anew (`renew`) should a trace's registration never reach a task.
_section = Renewable(_run_section, autograph=False)


#: (shard type, section, form, the arguments' specs) -> the section's concrete function: found here, not
#: looked up by `_section` in its traces before every call.
_traced: dict = {}


def _generalized(value):
    """A tensor's spec with each dimension unknown (its rank kept): one trace for every size."""
    return tf.TensorSpec([None] * value.shape.rank, value.dtype)


def run(shard, name: str, *args) -> None:
    """Section `name` (of `SECTIONS`) of `shard` with `args` (tensors on its ps, or on the coordinator
    to be copied there), as one call of the section's trace for the shard's form; eagerly, under the
    shard's device."""
    if name not in SECTIONS:
        raise ValueError(f"Invalid value for argument `name`. Received: name={name!r}. Expected one of {SECTIONS}.")
    form, storage = form_of(shard), storage_of(shard)
    specs = tf.nest.map_structure(lambda a: _generalized(a) if isinstance(a, tf.Tensor) else a, args)
    key = (type(shard), name, form, repr(tf.nest.map_structure(lambda _: 0, specs)), tuple(tf.nest.flatten(specs)))

    def trace():  # once per form with unknown dimensions: tensors of any size take it
        # Its functions (the section's conditionals' branches too) are registered on every task:
        # streamed, or TF waits for each task with the GIL held (a `model.load_weights` of a
        # DynamicEmbedding model froze the coordinator for as long as a worker hung).
        with _write_marks.unmarked(), streamed_function_registrations():
            # unmarked: counted in `restores` instead (a traced mark ran on the ps: unknown device)
            _traced[key] = _section.get_concrete_function(type(shard), name, form, storage, specs)

    def trace_anew():  # the trace's registration never reached a task: a new function, registered afresh
        _section.renew()
        trace()

    if key not in _traced:
        trace()
    shard.fresh = False  # written: a save must read it (`DenseShard.fresh`)
    shard.restores += 1  # written through the storage given, unmarked: a copy taken before is stale
    # Made again while the ps does not know the function yet (its streamed registration overtaken).
    until_registered(lambda: _traced[key](type(shard), name, form, storage, args), remake=trace_anew)


def trace_count() -> int:
    """How many times the sections were traced in this process (all forms and sections together)."""
    return _section.tracing_count()
