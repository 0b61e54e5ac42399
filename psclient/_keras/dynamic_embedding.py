"""`DynamicEmbedding`: an embedding without a vocabulary, its rows in hash tables on the ps.

The rows are not Keras variables (a table grows and shrinks), so the layer
joins Keras's training through two seams:

- Its output is the looked-up rows passed through a `tf.custom_gradient`
  identity that also takes a scalar "anchor" weight of the layer (always 0,
  gradient always 0). Asking the tape for the gradient of the model's
  trainable weights thus reaches the layer's gradient function, which keeps
  the rows' gradient (one row per distinct key of the batch) for the step.
- The optimizer's `apply` (psclient's one wrapper, `psclient._keras.optimizer_apply`,
  installed by `install`): when the
  variables it is given include a layer's anchor, the kept gradient is applied
  to the rows on their ps (`psclient._keras.dynamic_optimizers`) before the
  optimizer's own update of the other weights. The gradient is kept per
  graph being traced, so the training step that computed it applies it.

Storage, admission and eviction: `psclient._coordinator.tables.dynamic_tables`.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import weakref

import keras

import tensorflow as tf

from psclient._coordinator.tables.dynamic_tables import DynamicTable, mix64
from psclient._coordinator.runtime import ps_device, ps_index_of
from psclient._coordinator.serving.serving_table import ServingTable
from psclient._core.dynamic_tables import Policy
from psclient._keras import dynamic_optimizers, optimizer_apply, serving
from psclient._tf.gradients import custom_gradient
from psclient._tf.serving import at_export_end, current_export

__all__ = ["DynamicEmbedding", "epoch_logs", "install", "offered_snapshots"]

class _Kept:
    """Row gradients kept until the optimizer applies them: graph traced -> [(lookup state, gradient)]."""

    EAGER = type("Eager", (), {})()  # the key outside any tf.function

    def __init__(self):
        self.by_graph = weakref.WeakKeyDictionary()


class _Snapshot:
    """The layer's `ServingTable` for one export (by its token), a plain holder Keras does not track.

    `functions` keeps the shards' snapshot functions from one export to the
    next (`ServingTable.taken_from`): traced again at every export, they were
    about a sixth of an export's CPU.

    `offered`: a snapshot taken by the caller of the next export (`offered_snapshots`), used by that
    export instead of one of its own.
    """

    __slots__ = ("functions", "offered", "table", "token")

    def __init__(self):
        self.table, self.token, self.functions, self.offered = None, None, {}, None

    def take(self, token, table) -> None:
        self.table, self.token, self.offered = table, token, None

    def drop(self, token) -> None:
        if self.token is token:
            self.table, self.token = None, None


@contextlib.contextmanager
def offered_snapshots(layers, snapshots: dict):
    """While in it, the next export of each `DynamicEmbedding` of `layers` serves the snapshot of its table
    in `snapshots` (id of a `DynamicTable` -> a `ServingTable` taken of it) instead of taking its own:
    a `ServingExport`'s delta chain starts from the snapshot the full version holds, not from another
    one taken a moment apart, and the ps tasks hold one copy of the rows, not two."""
    offered = [layer for layer in layers if isinstance(layer, DynamicEmbedding) and id(layer.table) in snapshots]
    for layer in offered:
        layer._serving.offered = snapshots[id(layer.table)]
    try:
        yield
    finally:
        for layer in offered:
            layer._serving.offered = None


def install() -> None:
    """Exports read a snapshot of the rows; the optimizer's apply updates them
    (`psclient._keras.optimizer_apply`). Works without a strategy; idempotent."""
    serving.install()  # model.export and tf.saved_model.save read a snapshot of the rows
    optimizer_apply.install()


def dynamic_layers(model) -> list:
    """The `DynamicEmbedding` layers of `model` with a table, nested ones too (Keras's own walk)."""
    return [layer for layer in model._flatten_layers(include_self=True)  # noqa: SLF001 - Keras's own walk
            if isinstance(layer, DynamicEmbedding) and layer.table is not None]


def make_slots_ahead(model, optimizer) -> None:
    """Make the slot tables `optimizer` will update in every DynamicEmbedding of `model`, before the
    train step is traced.

    Made while the step is traced (`apply_kept_gradients`), they are variables the trace created,
    and `tf.function` then traces the step a second time (its first trace may only create them):
    the first `fit` of 26 layers took 40 s with that second trace, 30-34 s without
    (docs/dynamic_embeddings.md). Leaves an optimizer without support to the trace, which names
    the layer in its error as before.
    """
    layers = dynamic_layers(model)
    if not layers:
        return
    try:
        slots = dynamic_optimizers.slots_for(optimizer, layers[0].name)
    except dynamic_optimizers.UnsupportedOptimizerError:
        return
    for layer in layers:
        layer.table.ensure_slots(slots)


def epoch_logs(model) -> dict[str, float]:
    """Rows, admissions and evictions of every DynamicEmbedding in `model`: in total and per ps task.

    Keys `"<layer>/rows"`, `"<layer>/ps<k>/rows"` and the same for admissions
    and evictions: what fit adds to an epoch's logs when a TensorBoard
    callback is in use.
    """
    logs = {}
    for layer in dynamic_layers(model):
        per_ps = layer.table_stats()
        # A ps the recovery gave up on is left out (a lost one is waited for, table_stats);
        # a total over the others would read as a drop, so there is none then.
        readable = [(index, entry) for index, entry in enumerate(per_ps) if entry.get("available", True)]
        for name in ("rows", "admissions", "evictions"):
            if len(readable) == len(per_ps):
                logs[f"{layer.name}/{name}"] = float(sum(entry[name] for entry in per_ps))
            for index, entry in readable:
                logs[f"{layer.name}/ps{index}/{name}"] = float(entry[name])
    return logs


def _initializer(value) -> tuple:
    """`embeddings_initializer` as `initial_rows` takes it; raise for one it cannot draw per key."""
    init = keras.initializers.get(value)
    seed = getattr(init, "seed", None)
    seed = seed if isinstance(seed, int) else 0
    if isinstance(init, keras.initializers.RandomUniform):
        return ("uniform", float(init.minval), float(init.maxval), seed)
    if isinstance(init, keras.initializers.RandomNormal):
        return ("normal", float(init.mean), float(init.stddev), seed)
    if isinstance(init, keras.initializers.Zeros):
        return ("constant", 0.0, 0, 0)
    if isinstance(init, keras.initializers.Ones):
        return ("constant", 1.0, 0, 0)
    if isinstance(init, keras.initializers.Constant) and keras.ops.size(init.value) == 1:
        return ("constant", float(keras.ops.convert_to_numpy(init.value)), 0, 0)
    raise ValueError(
        f"Invalid value for argument `embeddings_initializer`. Received: embeddings_initializer={value!r}. "
        "Expected 'uniform', 'normal', 'zeros', 'ones', or a keras.initializers.RandomUniform, RandomNormal, "
        "Zeros, Ones or scalar Constant (a row is drawn per key, from a stream seeded by the key)."
    )


def _salt(name: str) -> int:
    """A feature name's 64-bit salt (int64): the same in every process and version."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little", signed=True)


@keras.saving.register_keras_serializable(package="psclient")
class DynamicEmbedding(keras.layers.Layer):
    """Embeds any int64 (or string) key without a vocabulary; rows live on the ps tasks.

    Args:
      output_dim: width of a row.
      key_dtype: "int64" (int32 inputs are widened) or "string" (keys are
        hashed to 64 bits first).
      embeddings_initializer: how a new key's row starts (drawn per key).
      min_frequency: a key gets a trained row of its own from its
        `min_frequency`-th sighting on; before, it reads zeros and is not updated.
      capacity: at most this many rows over all ps tasks; least recently used
        rows are evicted first. None: unbounded.
      ttl_steps: a key not seen for this many training steps is evicted. None: never.
      combiner: for `tf.RaggedTensor` inputs (multi-hot): "sum" or "mean" of a row's keys' rows.

    Called on a dict of features ({name: keys}), one layer embeds them all
    (a dict of outputs, by the same names): the same id in two features gets
    two rows (keys are salted with the feature's name), and the features
    share the layer's `capacity`. A step then costs one lookup and one
    update per ps task for all of them instead of one per layer
    (docs/dynamic_embeddings.md, "Many features").
    """

    def __init__(self, output_dim, key_dtype="int64", embeddings_initializer="uniform", min_frequency=1,
                 capacity=None, ttl_steps=None, combiner=None, name=None, **kwargs):
        super().__init__(name=name, **kwargs)
        if isinstance(output_dim, bool) or not isinstance(output_dim, int) or output_dim < 1:
            raise ValueError(f"Invalid value for argument `output_dim`. Received: output_dim={output_dim!r}. "
                             "Expected an integer >= 1.")
        if key_dtype not in ("int64", "string"):
            raise ValueError(f"Invalid value for argument `key_dtype`. Received: key_dtype={key_dtype!r}. "
                             "Expected 'int64' or 'string'.")
        if combiner not in (None, "sum", "mean"):
            raise ValueError(f"Invalid value for argument `combiner`. Received: combiner={combiner!r}. "
                             "Expected 'sum', 'mean' or None.")
        self._policy = Policy.checked(min_frequency, capacity, ttl_steps)
        self.output_dim, self.key_dtype, self.combiner = output_dim, key_dtype, combiner
        self.embeddings_initializer = keras.initializers.get(embeddings_initializer)
        self._init = _initializer(embeddings_initializer)
        self.supports_jit = False  # hash-table ops do not compile with XLA
        self._kept = _Kept()
        self.table = None
        self._serving = _Snapshot()
        install()

    # ------------------------------------------------------------ building
    def build(self, input_shape=None):
        anchor = self.add_weight(shape=(), initializer="zeros", name="anchor", trainable=True)
        anchor._psclient_dynamic_layer = weakref.ref(self)
        self._anchor = anchor
        # Built in a strategy's scope, the anchor went to a ps task: the table
        # goes to every ps task; else it is local (no cluster).
        devices, strategy = [None], None
        if ps_index_of(getattr(anchor.value, "device", None)) is not None:
            from psclient._engine import registry

            # The strategy whose scope the layer is built in (as a Keras layer learns of its
            # distribution strategy), handed to the table: nothing below looks it up again.
            strategy = registry.current()
            if strategy is not None:
                devices = [ps_device(i) for i in range(strategy.num_ps)]
        self.table = DynamicTable(self.name, self.output_dim, devices, self._init, self._policy, strategy)
        self.built = True

    def compute_output_shape(self, input_shape):
        if isinstance(input_shape, dict):
            return {name: self.compute_output_shape(shape) for name, shape in input_shape.items()}
        if self.combiner is not None:
            return tuple(input_shape[:-1]) + (self.output_dim,)
        return tuple(input_shape) + (self.output_dim,)

    def compute_output_spec(self, inputs, *args, **kwargs):
        if isinstance(inputs, dict):
            self.check_features(inputs)
            return {name: self.compute_output_spec(value) for name, value in inputs.items()}
        return keras.KerasTensor(self.compute_output_shape(inputs.shape), dtype="float32")

    # ---------------------------------------------------------------- call
    def check_features(self, features: dict) -> None:
        if not features or not all(isinstance(name, str) and name for name in features):
            raise ValueError(f"Invalid value for argument `inputs` of DynamicEmbedding {self.name!r}. Received: a "
                             f"dict with keys {sorted(map(repr, features))}. Expected a non-empty dict of features "
                             "by name (non-empty strings), or one tensor of keys.")

    def keys_of(self, inputs, argument: str = "inputs"):
        """(inputs, their int64 keys flattened) (strings hashed); raise for a dtype or rank the layer does not take.

        `argument`: how errors name the input (`inputs['user']` for a feature of a dict).
        """
        ragged = isinstance(inputs, tf.RaggedTensor)
        if isinstance(inputs, tf.SparseTensor):
            raise TypeError(f"Invalid value for argument `{argument}` of DynamicEmbedding {self.name!r}. Received: "
                            "a tf.SparseTensor. Expected a dense tensor of keys, or a tf.RaggedTensor with combiner.")
        if not ragged:
            inputs = tf.convert_to_tensor(inputs)
        dtype = inputs.dtype
        if self.key_dtype == "string":
            if dtype != tf.string:
                raise TypeError(f"Invalid dtype for argument `{argument}` of DynamicEmbedding {self.name!r}. "
                                f"Received: dtype={dtype.name}. Expected string keys (key_dtype='string').")
        elif dtype not in (tf.int64, tf.int32):
            raise TypeError(f"Invalid dtype for argument `{argument}` of DynamicEmbedding {self.name!r}. Received: "
                            f"dtype={dtype.name}. Expected int64 or int32 keys (key_dtype='int64'); float keys "
                            "are refused because they round.")
        rank = inputs.shape.rank
        if ragged and (self.combiner is None or rank != 2):
            raise ValueError(f"Invalid value for argument `{argument}` of DynamicEmbedding {self.name!r}. Received: "
                             f"a tf.RaggedTensor of rank {rank} with combiner={self.combiner!r}. Expected a rank-2 "
                             "RaggedTensor (batch, keys) and combiner='sum' or 'mean'.")
        if not ragged and (rank is None or rank < 1 or self.combiner is not None and rank < 2):
            raise ValueError(f"Invalid value for argument `{argument}` of DynamicEmbedding {self.name!r}. Received: "
                             f"shape={inputs.shape}. Expected a tensor of rank >= 1 (>= 2 with a combiner): "
                             "a batch of keys.")
        flat = inputs.flat_values if ragged else tf.reshape(inputs, [-1])
        if dtype == tf.string:
            flat = tf.strings.to_hash_bucket_fast(flat, 2**63 - 1)  # >= 0: never a reserved key
        return inputs, tf.cast(flat, tf.int64)

    def call(self, inputs, training=None):
        if isinstance(inputs, dict):
            return self.call_features(inputs, training)
        inputs, flat = self.keys_of(inputs)
        return self.shaped(inputs, self.rows_of(flat, training))

    def call_features(self, features: dict, training):
        """One lookup for every feature of the dict, their keys salted apart (see the class's docstring)."""
        self.check_features(features)
        names = sorted(features)
        parts = [self.keys_of(features[name], f"inputs[{name!r}]") for name in names]
        flat = tf.concat([mix64(keys + _salt(name)) for name, (_, keys) in zip(names, parts)], 0)
        found = tf.split(self.rows_of(flat, training), [tf.size(keys) for _, keys in parts])
        return {name: self.shaped(inputs, rows) for name, (inputs, _), rows in zip(names, parts, found)}

    def rows_of(self, flat, training):
        """A row for each of the int64 keys `flat` (admitted and watched for the gradient when training)."""
        unique, index, counts = tf.unique_with_counts(flat)
        if training:
            rows, state = self.table.train_lookup(unique, counts)
            rows = self.watched(rows, state)
        elif current_export() is not None:
            rows = self.serving_table().lookup(unique)  # stock TF, tracked by the SavedModel
        else:
            rows = self.table.lookup(unique)
        return tf.gather(rows, index)

    def serving_table(self) -> ServingTable:
        """The snapshot of the rows the export in progress on this thread serves (taken at its first
        trace of the layer, dropped when it ends; see psclient._tf.serving and docs/serving.md)."""
        token = current_export()
        if token is None:
            raise RuntimeError(f"DynamicEmbedding {self.name!r}: serving_table() is only made during an export "
                               "(model.export, tf.saved_model.save or psclient.export_servable).")
        if self._serving.token is not token:
            offered = self._serving.offered
            self._serving.take(token, offered if offered is not None
                               else ServingTable.taken_from(self.table, self._serving.functions))
            at_export_end(functools.partial(self._serving.drop, token))
        return self._serving.table

    def _trackable_children(self, save_type="checkpoint", **kwargs):
        # The export's snapshot is saved in the SavedModel, never in a checkpoint (training state is there).
        children = super()._trackable_children(save_type, **kwargs)
        if save_type == "savedmodel" and self._serving.table is not None and self._serving.token is current_export():
            children["serving_table"] = self._serving.table
        return children

    def shaped(self, inputs, found):
        """The rows `found` for the keys of `inputs`, in the inputs' shape (combined if multi-hot)."""
        if isinstance(inputs, tf.RaggedTensor):
            found = inputs.with_flat_values(found)
            return tf.reduce_sum(found, 1) if self.combiner == "sum" else tf.reduce_mean(found, 1)
        found = tf.reshape(found, tf.concat([tf.shape(inputs), [self.output_dim]], 0))
        if self.combiner == "sum":
            return tf.reduce_sum(found, -2)
        return tf.reduce_mean(found, -2) if self.combiner == "mean" else found

    def watched(self, rows, state):
        """`rows`, whose gradient is kept for `apply_kept_gradients` (through the anchor, see the module)."""
        # The gradient function lives as long as the graph that traced it (`custom_gradient`), and a
        # graph can outlive the layer: holding the layer there would keep its variables and its
        # tables' rows alive with every graph it was traced in.
        keep = weakref.WeakMethod(self.keep_gradient)

        @custom_gradient
        def watched(rows, anchor):
            def gradient(upstream):
                keep()(state, tf.convert_to_tensor(upstream))  # the layer lives while its model computes
                return tf.zeros_like(rows), tf.zeros_like(anchor)

            return tf.identity(rows), gradient

        return watched(rows, tf.convert_to_tensor(self._anchor.value))

    def keep_gradient(self, state, gradient):
        key = _Kept.EAGER if tf.executing_eagerly() else tf.compat.v1.get_default_graph()
        self._kept.by_graph.setdefault(key, []).append((state, gradient))

    def apply_kept_gradients(self, optimizer) -> tuple[list, object]:
        """Apply the gradients kept in this graph (or its outer graphs) to the rows, on their ps.

        A table without a capacity is updated here; a bounded one's shares are
        returned, with the optimizer's update rule, for `fused_admission.apply_parts`.
        """
        if tf.executing_eagerly():
            kept = self._kept.by_graph.pop(_Kept.EAGER, [])
        else:
            graph, kept = tf.compat.v1.get_default_graph(), []
            while graph is not None and not kept:
                kept = self._kept.by_graph.pop(graph, [])
                graph = getattr(graph, "outer_graph", None)
        if not kept:
            return [], None
        slots, rule = dynamic_optimizers.rule_for(optimizer, self.name)
        self.table.ensure_slots(slots)
        parts = []
        for state, gradient in kept:
            if self.table.shards[0].dense:
                parts += self.table.parts(state, gradient)
            else:
                self.table.apply(state, gradient, rule)
        return parts, rule

    # ------------------------------------------------------ state and saving
    def export_state(self) -> list[dict]:
        """The table's whole state, one dict of numpy arrays per ps task (see `DynamicTable.export_shard`)."""
        return [self.table.export_shard(i) for i in range(len(self.table.shards))]

    def import_state(self, states: list[dict]) -> None:
        """Load `export_state()`'s output, from any number of ps tasks (keys are split again)."""
        self.table.import_shards(states)

    def table_stats(self) -> list[dict]:
        """Per ps task: rows, keys tracked, admissions, evictions, clock (and `table_bytes` with a
        capacity); a lost ps is waited for until restored; one the recovery gave up on:
        `{"ps": k, "available": False, "error": ...}`."""
        return self.table.stats()

    def save_own_variables(self, store):
        # What serving needs: every row by key (slots and counters are training state).
        import numpy as np

        states = self.export_state()
        store["keys"] = np.concatenate([s["row_keys"] for s in states]).astype("int64")
        store["rows"] = np.concatenate([s["rows"] for s in states]).reshape(-1, self.output_dim)

    def load_own_variables(self, store):
        import numpy as np

        keys = np.asarray(store["keys"], dtype="int64")
        rows = np.asarray(store["rows"], dtype="float32").reshape(-1, self.output_dim)
        counters = np.stack([np.full(len(keys), self._policy.min_frequency), np.zeros(len(keys))], 1)
        self.import_state([{"keys": keys, "counters": counters, "row_keys": keys, "rows": rows, "slots": {},
                            "clock": 0, "admissions": len(keys), "evictions": 0}])

    def get_config(self):
        config = super().get_config()
        initializer = keras.initializers.serialize(self.embeddings_initializer)
        if "seed" in initializer.get("config", {}):
            # The seed the rows are drawn with (Keras draws one for an unseeded initializer
            # but does not save it): a copy of the layer draws the same first rows.
            initializer["config"]["seed"] = self._init[3]
        config.update({
            "output_dim": self.output_dim, "key_dtype": self.key_dtype,
            "embeddings_initializer": initializer,
            "min_frequency": self._policy.min_frequency, "capacity": self._policy.capacity,
            "ttl_steps": self._policy.ttl_steps, "combiner": self.combiner,
        })
        return config
