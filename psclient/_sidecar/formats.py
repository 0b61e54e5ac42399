"""The checkpoint formats the sidecar evaluator reads, and the rules for reading them safely.

Two formats:

- "tf": `tf.train.CheckpointManager` directories. TensorFlow rewrites the
  state file `checkpoint` (atomically) only after a checkpoint's data files are
  complete, so a prefix is seen only through that file, never by listing the
  directory: a half-written `ckpt-N.*` is invisible. `psclient.ModelCheckpoint`
  directories (each ps wrote its own part; the coordinator the state file, last)
  read the same way; they are told apart by their `psclient_layout` entry, and
  the model's weights are restored by position (see `_restore_psclient`).
- "keras": `*.weights.h5` and `*.keras` files from Keras 3's `ModelCheckpoint`.
  Keras writes them in place, so a file may be seen half-written; the settle
  rule of `psclient._sidecar.evaluator.Planner` decides when one may be read.

Scanning is cheap and imports nothing heavy; loading imports TensorFlow/h5py.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import re
import warnings
import zipfile
from collections import deque
from dataclasses import dataclass
from typing import Any

import tensorflow as tf
from tensorflow.core.protobuf import trackable_object_graph_pb2

from psclient._core.errors import CheckpointUnreadableError, PSClientError

TF = "tf"
KERAS = "keras"
KERAS_SUFFIXES = (".weights.h5", ".keras")
_CKPT_NUMBER = re.compile(r"-(\d+)$")
# Keras 3 optimizers hold `iterations` as their first variable.
_H5_ITERATIONS = "optimizer/vars/0"
_VALUE = "/.ATTRIBUTES/VARIABLE_VALUE"
#: Present in checkpoints written by psclient's ps tasks (ModelCheckpoint, BackupAndRestore, the strategy's).
_PSCLIENT_LAYOUT = "psclient_layout"
_log = logging.getLogger("psclient.sidecar")


class CheckpointMismatchError(PSClientError, ValueError):
    """The evaluator's model does not match a checkpoint's variables.

    `missing`: the model's variables the checkpoint lacks; `extra`: the
    checkpoint's model variables the model lacks (both "name shape" strings).
    """

    def __init__(self, message: str, *, missing=(), extra=()):
        super().__init__(message)
        self.missing = list(missing)
        self.extra = list(extra)


@dataclass(frozen=True)
class CheckpointRef:
    """One checkpoint as a directory scan saw it.

    `order` is the modification time (ns) of its newest file: larger is newer.
    A Keras file rewritten in place is a new version (new `order`/`size`).
    """

    path: str  # A file, or a TF prefix; absolute.
    name: str  # Relative to the checkpoint directory: what logs and markers use.
    kind: str  # TF or KERAS.
    order: int
    size: int = 0
    number: int | None = None  # The N of a TF prefix `ckpt-N`.

    @property
    def version(self) -> tuple[str, int, int]:
        return (self.name, self.order, self.size)


def _stat(path: str) -> os.stat_result | None:
    try:
        return os.stat(path)
    except OSError:
        return None


def scan(checkpoint_dir: str, ignore: frozenset[str] = frozenset()) -> list[CheckpointRef] | None:
    """Every checkpoint in `checkpoint_dir`, oldest first; None if the directory is missing.

    `ignore` holds absolute paths to leave out (the evaluator's own exports).
    """
    if not os.path.isdir(checkpoint_dir):
        return None
    refs = _scan_tf(checkpoint_dir)
    try:
        names = os.listdir(checkpoint_dir)
    except OSError:
        return None
    for name in names:
        # Dot-files are temporaries of atomic writers: never complete under that name.
        if name.startswith(".") or not name.endswith(KERAS_SUFFIXES):
            continue
        path = os.path.join(checkpoint_dir, name)
        st = _stat(path)
        if path in ignore or st is None or not os.path.isfile(path):
            continue
        refs.append(CheckpointRef(path, name, KERAS, st.st_mtime_ns, st.st_size))
    return sorted(refs, key=lambda r: (r.order, r.name))


def _scan_tf(checkpoint_dir: str) -> list[CheckpointRef]:
    state_path = os.path.join(checkpoint_dir, "checkpoint")
    if not os.path.exists(state_path):
        return []  # Cheap check first: opening TF's reader is not.
    # TF returns None (and logs why) for a state file it cannot read or parse.
    try:
        state = tf.train.get_checkpoint_state(checkpoint_dir)
    except ValueError as e:  # A state file that names no checkpoint: none to read yet.
        _log.debug("no checkpoint in %s: %s", state_path, e)
        return []
    if state is None:
        return []
    prefixes = list(state.all_model_checkpoint_paths) or [state.model_checkpoint_path]
    refs = []
    for prefix in prefixes:
        if not prefix:
            continue
        path = prefix if os.path.isabs(prefix) else os.path.join(checkpoint_dir, prefix)
        st = _stat(path + ".index")
        if st is None:
            continue  # Deleted by max_to_keep since the state file was written.
        match = _CKPT_NUMBER.search(path)
        refs.append(CheckpointRef(
            path, os.path.relpath(path, checkpoint_dir), TF, st.st_mtime_ns,
            number=int(match.group(1)) if match else None,
        ))
    return refs


# Reading ------------------------------------------------------------------------


def _read_errors(kind: str) -> tuple[type[BaseException], ...]:
    """What reading a half-written, corrupt or deleted checkpoint of `kind` raises."""
    if kind == TF:
        from google.protobuf.message import DecodeError

        # IndexError: TF's checkpoint reader reports a truncated data file
        # (OUT_OF_RANGE, "Read less bytes than requested") as one.
        return (tf.errors.OpError, OSError, IndexError, DecodeError)
    # h5py: OSError ("truncated file"); a .keras file: a zip archive.
    return (OSError, zipfile.BadZipFile, EOFError)


@contextlib.contextmanager
def _reading(ref: CheckpointRef):
    """Turns the errors of reading a damaged checkpoint into CheckpointUnreadableError.

    Wraps only the calls that read files: an error in the logic around them
    (a bug) propagates as it is, and is never reported as "unreadable".
    """
    try:
        yield
    except CheckpointUnreadableError:
        raise
    except _read_errors(ref.kind) as e:
        raise CheckpointUnreadableError(f"cannot read {ref.name}: {type(e).__name__}: {e}") from e


# Steps --------------------------------------------------------------------------


def tf_step(ref: CheckpointRef) -> int | None:
    """The training step of a TF checkpoint, best source first.

    The root's `step` variable, else the optimizer's `iterations` (saved at the
    root or inside the model), else None (the caller falls back to `ckpt-N`).
    """
    with _reading(ref):
        reader = tf.train.load_checkpoint(ref.path)
    for key in ("step", "optimizer/_iterations", "optimizer/iterations",
                "model/optimizer/_iterations", "model/optimizer/iterations"):
        full = key + "/.ATTRIBUTES/VARIABLE_VALUE"
        if reader.has_tensor(full):
            with _reading(ref):
                value = reader.get_tensor(full)
            if getattr(value, "shape", ()) == () and str(getattr(value, "dtype", "")).startswith(("int", "uint")):
                return int(value)
    return None


def _open_h5(ref: CheckpointRef):
    import h5py

    if ref.path.endswith(".keras"):  # A zip that holds model.weights.h5.
        with zipfile.ZipFile(ref.path) as archive:
            try:
                data = archive.read("model.weights.h5")
            except KeyError as e:  # Another zip, or a .keras file being written.
                raise CheckpointUnreadableError(f"cannot read {ref.name}: it holds no model.weights.h5") from e
        return h5py.File(io.BytesIO(data), "r")
    return h5py.File(ref.path, "r")


def keras_step(ref: CheckpointRef) -> int | None:
    """The optimizer's `iterations` saved in a Keras file, or None (no optimizer saved)."""
    with _reading(ref), _open_h5(ref) as f:
        if _H5_ITERATIONS in f and f[_H5_ITERATIONS].shape == ():
            return int(f[_H5_ITERATIONS][()])
    return None


# Structure checks ---------------------------------------------------------------


def _h5_variables(f) -> dict[str, tuple]:
    """{dataset path: shape} of a Keras weights file, optimizer state left out."""
    found: dict[str, tuple] = {}

    def visit(name, obj):
        if hasattr(obj, "shape") and not name.startswith("optimizer"):
            found[name] = tuple(obj.shape)

    f.visititems(visit)
    return found


def _mismatch_error(where: str, missing: list[str], extra: list[str]) -> CheckpointMismatchError:
    parts = []
    if missing:
        parts.append(f"missing from the checkpoint (the model has them): {', '.join(missing)}")
    if extra:
        parts.append(f"extra in the checkpoint (the model lacks them): {', '.join(extra)}")
    return CheckpointMismatchError(
        f"Invalid value for argument `model`: it does not match the checkpoint {where}. "
        f"Variables {'; '.join(parts)}. Expected the model that training saves "
        "(same layers, names and shapes; build it the same way).",
        missing=missing, extra=extra,
    )


def check_keras_structure(ref: CheckpointRef, expected: dict[str, tuple]) -> None:
    """Raises CheckpointMismatchError when the file's model variables differ from `expected`.

    Keras itself ignores a file's extra layers silently; this names them.
    """
    with _reading(ref), _open_h5(ref) as f:
        found = _h5_variables(f)
    missing = [f"{k} {list(s)}" for k, s in expected.items() if k not in found]
    extra = [f"{k} {list(s)}" for k, s in found.items() if k not in expected]
    shapes = [f"{k} {list(expected[k])} (checkpoint: {list(s)})"
              for k, s in found.items() if k in expected and expected[k] != s]
    if missing or extra or shapes:
        raise _mismatch_error(ref.name, missing + shapes, extra)


def keras_expected_variables(model: Any, scratch_dir: str) -> dict[str, tuple]:
    """What a Keras weights file of `model` holds: written once to `scratch_dir`."""
    import h5py

    path = os.path.join(scratch_dir, "reference.weights.h5")
    model.save_weights(path)
    with h5py.File(path, "r") as f:
        return _h5_variables(f)


def _graph(reader) -> Any:
    graph = trackable_object_graph_pb2.TrackableObjectGraph()
    graph.ParseFromString(reader.get_tensor("_CHECKPOINTABLE_OBJECT_GRAPH"))
    return graph


def check_tf_structure(ref: CheckpointRef, model: Any, model_key: str) -> None:
    """Raises CheckpointMismatchError when `model` and the checkpoint's `model_key` differ.

    Matches the model's object tree against the checkpoint's object graph edge
    by edge, as TensorFlow's restore does. Optimizer state is left out: the
    evaluator's optimizer is never built.
    """
    with _reading(ref):
        reader = tf.train.load_checkpoint(ref.path)
        shapes = reader.get_variable_to_shape_map()
        graph = _graph(reader)
    roots = {c.local_name: c.node_id for c in graph.nodes[0].children}
    if model_key not in roots:
        raise CheckpointMismatchError(
            f"Invalid value for argument `model_key`. Received: model_key={model_key!r}. "
            f"Expected one of the checkpoint {ref.name}'s root objects: {sorted(roots)}."
        )

    def ckpt_variable(node_id: int) -> str | None:
        for attribute in graph.nodes[node_id].attributes:
            if attribute.name == "VARIABLE_VALUE":
                return attribute.checkpoint_key
        return None

    # The checkpoint's model variables: every variable node reachable from the model.
    in_ckpt: dict[int, str] = {}
    seen, queue = {roots[model_key]}, deque([(roots[model_key], model_key)])
    while queue:
        node_id, path = queue.popleft()
        if ckpt_variable(node_id) is not None:
            in_ckpt[node_id] = path
        for child in graph.nodes[node_id].children:
            if child.node_id not in seen and "optimizer" not in child.local_name:
                seen.add(child.node_id)
                queue.append((child.node_id, f"{path}/{child.local_name}"))

    weights = {id(w) for w in model.weights}
    view = tf.train.TrackableView(model)
    matched: set[int] = set()
    missing: list[str] = []
    bad_shape: list[str] = []
    seen_objects, stack = {id(model)}, [(model, roots[model_key])]
    while stack:
        obj, node_id = stack.pop()
        for name, child in view.children(obj).items():
            if id(child) in seen_objects or "optimizer" in name:
                continue
            seen_objects.add(id(child))
            node = next((c.node_id for c in graph.nodes[node_id].children if c.local_name == name), None) \
                if node_id is not None else None
            if id(child) in weights:
                label = f"{child.path} {list(child.shape)}"
                key = ckpt_variable(node) if node is not None else None
                if key is None:
                    missing.append(label)
                else:
                    matched.add(node)
                    if list(shapes.get(key, [])) != list(child.shape):
                        bad_shape.append(f"{label} (checkpoint: {list(shapes.get(key, []))})")
            stack.append((child, node))
    extra = [f"{path} {list(shapes.get(ckpt_variable(n), []))}"
             for n, path in in_ckpt.items() if n not in matched]
    if missing or extra or bad_shape:
        raise _mismatch_error(ref.name, missing + bad_shape, extra)


# Loading ------------------------------------------------------------------------


def restore(ref: CheckpointRef, model: Any, model_key: str, keras_expected: dict[str, tuple] | None) -> None:
    """Checks that `ref` matches `model`, then restores it into `model`.

    `keras_expected` is `keras_expected_variables(model, ...)`, needed for Keras files.

    Raises:
        CheckpointMismatchError: the model and the checkpoint differ.
        CheckpointUnreadableError: the checkpoint cannot be read (it may still
            be being written, be corrupt, or have been deleted).
    """
    if ref.kind == TF:
        with _reading(ref):
            reader = tf.train.load_checkpoint(ref.path)
            layout = _psclient_layout(reader)
        if layout is not None:
            _restore_psclient(ref, reader, layout, model)
            return
        check_tf_structure(ref, model, model_key)
        with _reading(ref):
            tf.train.Checkpoint(**{model_key: model}).read(ref.path).expect_partial()
    else:
        check_keras_structure(ref, keras_expected or {})
        with _reading(ref), warnings.catch_warnings():
            # The evaluator never trains: its optimizer is not built, and
            # Keras warns on every load that it skips the saved optimizer state.
            warnings.filterwarnings("ignore", message="Skipping variable loading for optimizer")
            model.load_weights(ref.path)


def _psclient_layout(reader) -> dict | None:
    """The layout a psclient checkpoint (written by each ps) records, or None for another checkpoint."""
    if not reader.has_tensor(_PSCLIENT_LAYOUT):
        return None
    return json.loads(reader.get_tensor(_PSCLIENT_LAYOUT))


def _restore_psclient(ref: CheckpointRef, reader, layout: dict, model: Any) -> None:
    """Restores the weights of `model` by position from a `psclient.ModelCheckpoint` checkpoint.

    The values of every ps's part are read here, into this process: the
    evaluator needs the model's memory.
    """
    if layout.get("keys") != "keras_position":
        raise CheckpointMismatchError(
            f"The checkpoint {ref.name} is one of ParameterServerStrategy's own checkpoints (variables "
            "keyed by creation order, for strategy.restore() and ps recovery), which the evaluator "
            "cannot match to a model. Expected checkpoints written with "
            "`model.fit(callbacks=[psclient.ModelCheckpoint(dir)])` (the model's weights by position).")
    with _reading(ref):
        shapes = reader.get_variable_to_shape_map()
    saved = list(layout.get("model_weights") or [])
    weights = list(model.weights)
    keys = [f"model/{i:04d}{_VALUE}" for i in range(len(weights))]
    missing = [f"{w.path} {list(w.shape)}" for w, k in zip(weights, keys) if k not in shapes]
    bad = [f"{w.path} {list(w.shape)} (checkpoint: {saved[i] if i < len(saved) else k} {list(shapes[k])})"
           for i, (w, k) in enumerate(zip(weights, keys)) if k in shapes and list(shapes[k]) != list(w.shape)]
    extra = [f"{path} {list(shapes.get(f'model/{i:04d}{_VALUE}', []))}"
             for i, path in enumerate(saved) if i >= len(weights)]
    saved_tables = layout.get("tables") or {}
    tables = _dynamic_tables(model)
    if len(tables) != len(saved_tables):
        missing.extend(f"dynamic table {key} ({table.name!r})" for key, table in tables.items()
                       if key not in saved_tables)
        extra.extend(f"dynamic table {key} ({entry.get('name')!r})" for key, entry in saved_tables.items()
                     if key not in tables)
    if missing or bad or extra:
        raise _mismatch_error(ref.name, missing + bad, extra)
    from psclient._coordinator.checkpoints.table_checkpoint import read_local

    with _reading(ref):
        values = [reader.get_tensor(k) for k in keys]  # every value read before any is assigned
        rows = {key: read_local(reader, key, saved_tables[key]) for key in tables}
    for variable, value in zip(weights, values):
        variable.assign(value)
    for key, table in tables.items():
        table.import_shards(rows[key])


def _dynamic_tables(model: Any) -> dict[str, Any]:
    """The tables of the model's DynamicEmbedding layers, keyed as `psclient.ModelCheckpoint` saves them.

    The same walk as `psclient._keras.checkpoints.model_tables` (by position), without importing Keras.
    """
    from psclient._coordinator.tables.dynamic_tables import DynamicTable

    found, todo = [], [model]
    while todo:
        layer = todo.pop(0)
        if isinstance(getattr(layer, "table", None), DynamicTable):
            found.append(layer.table)
        todo[:0] = list(getattr(layer, "layers", []))
    return {f"model_table/{index:04d}": table for index, table in enumerate(found)}


def step_of(ref: CheckpointRef) -> int | None:
    """The checkpoint's saved training step, or None when it holds none.

    Raises:
        CheckpointUnreadableError: it cannot be read (e.g. deleted since `restore`).
    """
    return tf_step(ref) if ref.kind == TF else keras_step(ref)
