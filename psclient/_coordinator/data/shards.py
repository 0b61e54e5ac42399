"""Shards of a data set, and `ShardedDataset`: data read once per epoch.

A shard is records `[start, end)` of an indexed source (`range_shards`) or of
one file (`file_shards`). `ShardedDataset(shards, make_dataset)` describes an
epoch as every shard once: `make_dataset(shard)` returns the `tf.data.Dataset`
of one shard's batches. It is traced once, inside the function each closure
runs, with the shard's bounds as tensors (`shard.start`, `shard.end`: int64
scalars; `shard.file`: a string scalar for file shards, None otherwise), so a
new shard costs no new trace. How shards are handed to workers and tracked is
`psclient._coordinator.data.shard_feed`.
"""

from __future__ import annotations

import numbers
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import tensorflow as tf

from psclient._core.checks import signature_refusing_one_argument
from psclient._core.ledger import ShardKey
from psclient._tf.executors import streamed_function_registrations

__all__ = ["Shard", "ShardedDataset", "file_shards", "range_shards"]


@dataclass(frozen=True)
class Shard:
    """Records `[start, end)` of `file` (None: of an indexed source).

    In the lists `range_shards` and `file_shards` return, the fields are
    Python values; `end` is -1 for "to the end of the file" (a file whose
    records were not counted). Inside `make_dataset` they are tensors:
    `start`/`end` int64 scalars and `file` a string scalar (or None), and
    `epoch` is the epoch being run, an int64 scalar (0 in evaluate and
    predict; None in the lists).
    `dataset.skip(shard.start).take(shard.end - shard.start)` reads exactly
    the shard in both cases (`take(-1)` takes everything).
    """

    start: Any
    end: Any
    file: Any = None
    epoch: Any = None

    @property
    def num_records(self) -> int | None:
        """The shard's record count (None when `end` is -1: unknown)."""
        return None if self.end < 0 else self.end - self.start

    def key(self) -> ShardKey:
        return ShardKey(int(self.start), int(self.end), None if self.file is None else str(self.file))


def _check_count(name: str, value: Any, minimum: int = 1) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(
            f"Invalid value for argument `{name}`. Received: {name}={value!r}. "
            f"Expected an integer >= {minimum}."
        )
    return value


def range_shards(num_records: int, shard_size: int) -> list[Shard]:
    """Shards of `shard_size` records covering records `[0, num_records)` (the last may be smaller)."""
    _check_count("num_records", num_records)
    _check_count("shard_size", shard_size)
    return [Shard(start, min(start + shard_size, num_records)) for start in range(0, num_records, shard_size)]


def file_shards(files: Sequence[str | os.PathLike], records_per_shard: int | None = None) -> list[Shard]:
    """One shard per file, or with `records_per_shard`, ranges of that many records of each file.

    Counting a file's records reads it once, here, as TFRecord files
    (`tf.data.TFRecordDataset`); for other formats give one shard per file,
    or build the `Shard` list yourself. Every file must exist.
    """
    if isinstance(files, (str, os.PathLike)) or not isinstance(files, Sequence):
        raise TypeError(
            f"Invalid value for argument `files`. Received: files={files!r} of type "
            f"{type(files).__name__}. Expected a list of file paths."
        )
    if not files:
        raise ValueError("Invalid value for argument `files`. Received: files=[]. Expected at least one file.")
    paths = [os.fspath(f) for f in files]
    missing = [p for p in paths if not _exists(p)]
    if missing:
        raise FileNotFoundError(
            f"Invalid value for argument `files`: {len(missing)} of {len(paths)} files do not exist. "
            f"Received: {missing[:5]}{' ...' if len(missing) > 5 else ''}. Expected existing files."
        )
    if records_per_shard is None:
        return [Shard(0, -1, p) for p in paths]
    _check_count("records_per_shard", records_per_shard)
    shards = []
    for path in paths:
        count = _count_records(path)
        shards.extend(Shard(s, min(s + records_per_shard, count), path) for s in range(0, count, records_per_shard))
    if not shards:
        raise ValueError(f"Invalid value for argument `files`. Received: {paths[:5]}, which hold no records. "
                         "Expected files with at least one record.")
    return shards


def _exists(path: str) -> bool:
    if "://" in path:  # remote storage: ask TF's file system layer
        return tf.io.gfile.exists(path)
    return os.path.isfile(path)


def _count_records(path: str) -> int:
    return int(tf.data.TFRecordDataset(path).reduce(tf.constant(0, tf.int64), lambda n, _: n + 1))


def _valid_bounds(shard: Shard) -> bool:
    ints = all(isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in (shard.start, shard.end))
    if not ints or shard.start < 0:
        return False
    return shard.start < shard.end or (shard.end == -1 and shard.file is not None)


class ShardedDataset:
    """Data whose epoch is every shard once (module doc).

    Args:
      shards: a non-empty list of `Shard` (`range_shards`, `file_shards`).
      make_dataset: `make_dataset(shard) -> tf.data.Dataset` of that shard's
        batches, with the shard's fields as tensors.
      seed: None hands shards out in list order every epoch; an int shuffles
        the order per epoch, the same in every run (and after a restart).
    """

    def __init__(self, shards: Sequence[Shard], make_dataset: Callable, *, seed: int | None = None):
        if not isinstance(shards, Sequence) or not shards:
            raise ValueError(
                f"Invalid value for argument `shards`. Received: shards={_short(shards)}. Expected a "
                "non-empty list of psclient.data.Shard (from range_shards or file_shards)."
            )
        wrong = [s for s in shards if not isinstance(s, Shard)]
        if wrong:
            raise TypeError(
                f"Invalid value for argument `shards`. Received: an element {wrong[0]!r} of type "
                f"{type(wrong[0]).__name__}. Expected psclient.data.Shard (from range_shards or file_shards)."
            )
        bad = [s for s in shards if not _valid_bounds(s)]
        if bad:
            raise ValueError(
                f"Invalid value for argument `shards`. Received: {bad[0]!r}. Expected integer bounds "
                "0 <= start < end (records [start, end)), or end=-1 (to the end) for a file shard."
            )
        kinds = {s.file is None for s in shards}
        if len(kinds) > 1:
            raise ValueError("Invalid value for argument `shards`. Received: range shards and file shards "
                             "mixed. Expected shards of one kind.")
        missing = sorted({s.file for s in shards if s.file is not None and not _exists(s.file)})
        if missing:
            raise FileNotFoundError(
                f"Invalid value for argument `shards`: the files of {len(missing)} shard file(s) do not exist. "
                f"Received: {missing[:5]}{' ...' if len(missing) > 5 else ''}. Expected existing files."
            )
        if seed is not None:
            _check_count("seed", seed, minimum=0)
        _check_make_dataset(make_dataset)
        self.shards = tuple(shards)
        self.make_dataset = make_dataset
        self.seed = seed
        self.has_files = shards[0].file is not None
        self._element_spec = None

    @property
    def num_records(self) -> int | None:
        """Records per epoch, when every shard's count is known."""
        counts = [s.num_records for s in self.shards]
        return None if None in counts else sum(counts)

    def keys(self) -> list[ShardKey]:
        return [s.key() for s in self.shards]

    def shard_tensors(self, shard: Shard | None = None, *, symbolic: bool = False) -> Shard:
        """`shard` as make_dataset receives it (tensors), or TensorSpecs when `symbolic`."""
        if symbolic:
            return Shard(tf.TensorSpec([], tf.int64), tf.TensorSpec([], tf.int64), tf.TensorSpec([], tf.string),
                         tf.TensorSpec([], tf.int64))
        return Shard(tf.constant(shard.start, tf.int64), tf.constant(shard.end, tf.int64),
                     tf.constant(shard.file or "", tf.string))

    def call(self, start, end, file, epoch):
        """`make_dataset` on tensors (inside a traced function), checked to return a dataset."""
        dataset = self.make_dataset(Shard(start, end, file if self.has_files else None, epoch))
        if not isinstance(dataset, tf.data.Dataset):
            raise TypeError(
                f"Invalid value for argument `make_dataset`: it returned an object of type "
                f"{type(dataset).__name__}. Expected a tf.data.Dataset of the shard's batches."
            )
        return dataset

    @property
    def element_spec(self):
        """The spec of one batch, from one trace of `make_dataset` on the coordinator."""
        if self._element_spec is None:
            spec = self.shard_tensors(symbolic=True)
            # Traced here only: registered on every task without waiting (a hung worker froze
            # the coordinator in `get_concrete_function`, which holds the GIL while it registers).
            with streamed_function_registrations():
                concrete = tf.function(self.call, autograph=False).get_concrete_function(
                    spec.start, spec.end, spec.file, spec.epoch)
            self._element_spec = concrete.structured_outputs.element_spec
        return self._element_spec

    def as_dataset(self):
        """Every shard in list order as one finite dataset (evaluate, predict)."""
        starts = [s.start for s in self.shards]
        ends = [s.end for s in self.shards]
        files = [s.file or "" for s in self.shards]
        table = tf.data.Dataset.from_tensor_slices((tf.constant(starts, tf.int64), tf.constant(ends, tf.int64),
                                                    tf.constant(files, tf.string)))
        return table.flat_map(lambda start, end, file: self.call(start, end, file, tf.constant(0, tf.int64)))

    def __repr__(self) -> str:
        records = self.num_records
        return (f"<psclient.data.ShardedDataset: {len(self.shards)} {'file' if self.has_files else 'range'} "
                f"shards, {'unknown' if records is None else records} records, seed={self.seed}>")


def _check_make_dataset(make_dataset: Any) -> None:
    if not callable(make_dataset):
        raise TypeError(
            f"Invalid value for argument `make_dataset`. Received: make_dataset={make_dataset!r} of type "
            f"{type(make_dataset).__name__}. Expected a function shard -> tf.data.Dataset."
        )
    signature = signature_refusing_one_argument(make_dataset)
    if signature is not None:
        raise TypeError(
            f"Invalid value for argument `make_dataset`. Received: a function with signature "
            f"{getattr(make_dataset, '__name__', 'make_dataset')}{signature}. Expected a function taking "
            "exactly one argument, the shard (shard.start, shard.end, shard.file), and returning a "
            "tf.data.Dataset of its batches."
        )


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
