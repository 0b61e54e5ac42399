"""Relative file paths in a dataset's graph, made absolute before the graph leaves the coordinator.

TF opens a dataset's files when it is iterated, relative to the working
directory of the process that iterates it: in local Keras, the script's. A
graph rebuilt on a worker would look them up in the worker's working
directory instead (a `LocalCluster`'s tasks keep the one they started in;
a remote worker has its own). So before a dataset's graph is sent, every
relative path in it is joined to the coordinator's working directory at
that moment, which is when local Keras would have opened it:

- a string constant read directly by a file op (`TextLineDataset`,
  `TFRecordDataset`, `FixedLengthRecordDataset`, `CSVDataset`, `list_files`'
  `MatchingFiles`, `tf.io.read_file`...), in the graph or in its functions;
- a list of file names fed to a dataset (`from_tensor_slices(files)`, what
  `make_csv_dataset` builds): a string constant of a `TensorSliceDataset` or
  `TensorDataset` all of whose elements name files that exist here (so data
  that merely are strings is left alone).

URLs (`gs://...`) and absolute paths are left as they are.
"""

from __future__ import annotations

import os

import tensorflow as tf

__all__ = ["absolute_paths"]

#: Ops whose first input is file names or glob patterns.
_FILE_OPS = frozenset({
    "TextLineDataset", "TFRecordDataset", "TFRecordDatasetV2", "FixedLengthRecordDataset",
    "FixedLengthRecordDatasetV2", "CSVDataset", "CSVDatasetV2", "ExperimentalCSVDataset",
    "MatchingFiles", "MatchingFilesDataset", "ExperimentalMatchingFilesDataset", "ReadFile",
    "LMDBDataset", "ExperimentalLMDBDataset",
})
#: Datasets made from tensors: their string constants are paths only if every one exists.
_TENSOR_DATASETS = frozenset({"TensorSliceDataset", "TensorDataset"})
#: Cheap test on the serialized bytes: a graph without these op names has nothing to change.
_MARKERS = tuple(name.encode() for name in ("Dataset", "MatchingFiles", "ReadFile"))


def absolute_paths(serialized: bytes, cwd: str | None = None) -> tuple[bytes, list[str]]:
    """The dataset graph `serialized` with relative file paths joined to `cwd` (default: this
    process's working directory now). Returns the graph and the paths changed ("old -> new")."""
    if not any(marker in serialized for marker in _MARKERS):
        return serialized, []
    cwd = os.getcwd() if cwd is None else cwd
    graph = tf.compat.v1.GraphDef()
    graph.ParseFromString(serialized)
    changed: list[str] = []
    _rewrite(graph.node, cwd, changed)
    for function in graph.library.function:
        _rewrite(function.node_def, cwd, changed)
    if not changed:
        return serialized, []
    return graph.SerializeToString(), changed


def _rewrite(nodes, cwd: str, changed: list[str]) -> None:
    constants = {node.name: node for node in nodes if node.op == "Const"
                 and node.attr["value"].tensor.dtype == tf.string.as_datatype_enum}
    if not constants:
        return
    done: set[str] = set()
    for node in nodes:
        if node.op in _FILE_OPS:  # their file names or patterns are input 0 (others: delimiters...)
            inputs, must_exist = node.input[:1], False
        elif node.op in _TENSOR_DATASETS:
            inputs, must_exist = node.input, True
        else:
            continue
        for name in inputs:
            const = constants.get(name.lstrip("^").split(":")[0])
            if const is not None and const.name not in done:
                done.add(const.name)
                _absolute(const, cwd, must_exist, changed)


def _relative_path(value: bytes) -> bool:
    text = value.decode("utf-8", "replace")
    return bool(text) and not os.path.isabs(text) and "://" not in text


def _absolute(const, cwd: str, must_exist: bool, changed: list[str]) -> None:
    proto = const.attr["value"].tensor
    # parse_tensor reads string tensors packed in `tensor_content` too (make_ndarray cannot).
    values = list(tf.io.parse_tensor(proto.SerializeToString(), tf.string).numpy().reshape(-1))
    relative = [v for v in values if _relative_path(v)]
    if not relative:
        return
    if must_exist and not all(os.path.exists(os.path.join(cwd, v.decode())) for v in relative):
        return  # strings that are data, not (only) file names
    new = [os.path.join(cwd, v.decode()).encode() if _relative_path(v) else v for v in values]
    shape = [dim.size for dim in proto.tensor_shape.dim]
    proto.CopyFrom(tf.make_tensor_proto(new, dtype=tf.string, shape=shape))
    changed += [f"{old.decode()} -> {path.decode()}" for old, path in zip(values, new) if old != path]
