"""How evaluate/predict data is read once and cut into ranges (no cluster)."""

import itertools

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from psclient._coordinator.data.per_worker import deserialize_dataset  # noqa: E402
from psclient._keras import ranges  # noqa: E402


@pytest.mark.parametrize("num_batches, workers, pieces", [
    (1, 2, 1), (7, 2, 1), (16, 2, 1), (40, 2, 2), (313, 2, 8), (100, 3, 6), (5, 4, 1), (1000, 4, 16)])
def test_known_sizes_cover_every_batch_in_ranges_within_one(num_batches, workers, pieces):
    sizes = list(ranges.range_sizes(num_batches, workers))
    assert sum(sizes) == num_batches
    # RANGES_PER_WORKER a worker, none under MIN_RANGE_BATCHES unless the data has fewer.
    assert len(sizes) == pieces
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= min(num_batches, ranges.MIN_RANGE_BATCHES)


def test_unknown_size_is_cut_in_fixed_ranges():
    sizes = ranges.range_sizes(None, 2)
    assert list(itertools.islice(sizes, 3)) == [ranges.UNKNOWN_SIZE_BATCHES] * 3


def test_cut_reads_lazily_and_keeps_every_batch_once_in_order():
    pulled = []

    def batches():
        for i in range(10):
            pulled.append(i)
            yield i

    pieces = ranges.cut(batches(), iter([4, 4, 4]), max_bytes=10**9, size_of=lambda b: 1)
    assert next(pieces) == [0, 1, 2, 3]
    assert pulled == [0, 1, 2, 3]  # nothing read ahead of the range asked for
    assert list(pieces) == [[4, 5, 6, 7], [8, 9]]


def test_cut_closes_a_range_at_max_bytes_and_carries_the_rest():
    pieces = list(ranges.cut(range(9), iter([5, 4]), max_bytes=3, size_of=lambda b: 1))
    assert pieces == [[0, 1, 2], [3, 4], [5, 6, 7], [8]]
    assert list(ranges.cut(range(3), iter([2, 2]), 10, lambda b: 1)) == [[0, 1], [2]]  # data ends first


def _values(dataset):
    return [tf.nest.map_structure(lambda t: t.numpy() if isinstance(t, tf.Tensor) else t, element)
            for element in dataset]


def _assert_same_batches(got, want):
    assert len(got) == len(want)
    for a, b in zip(got, want):
        tf.nest.assert_same_structure(a, b, expand_composites=True)
        for x, y in zip(tf.nest.flatten(a, expand_composites=True), tf.nest.flatten(b, expand_composites=True)):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_ranges_rebuilt_from_their_graph_give_the_batches_read():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((23, 3)).astype("float32")
    words = np.array([f"w{i}" for i in range(23)])
    dense = tf.data.Dataset.from_tensor_slices(({"x": x, "word": words}, np.arange(23))).batch(5)  # 5,5,5,5,3
    ragged = tf.data.Dataset.from_tensor_slices(
        tf.ragged.constant([[1], [2, 3], [], [4, 5, 6], [7]] * 3)
    ).batch(4)
    sparse = tf.data.Dataset.from_tensor_slices(
        tf.sparse.SparseTensor([[0, 1], [3, 0], [5, 2]], [1.0, 2.0, 3.0], [7, 3])
    ).batch(3)
    for dataset in (dense, ragged, sparse):
        want = list(dataset)
        read, starts = [], []
        for start, count, graph in ranges.read_ranges(dataset, None, 2):
            piece = list(deserialize_dataset(graph, dataset.element_spec))
            assert len(piece) == count
            starts.append(start)
            read += piece
        assert starts == list(range(0, len(want), ranges.UNKNOWN_SIZE_BATCHES))
        _assert_same_batches(read, want)
    # A known size in several ranges (none under MIN_RANGE_BATCHES), the short last batch in the last one.
    longer = tf.data.Dataset.from_tensor_slices(np.arange(163)).batch(5)  # 33 batches, the last of 3
    pieces = list(ranges.read_ranges(longer, 33, 1))
    assert [(start, count) for start, count, _ in pieces] == [(0, 17), (17, 16)]
    rebuilt = [b for _, _, graph in pieces for b in deserialize_dataset(graph, longer.element_spec)]
    _assert_same_batches(rebuilt, list(longer))
    assert [(start, count) for start, count, _ in ranges.read_ranges(dense, 5, 2)] == [(0, 5)]  # small: one


def test_small_self_contained_data_goes_whole_and_the_rest_is_read_here(tmp_path):
    x = np.arange(40, dtype="float32").reshape(20, 2)
    small = tf.data.Dataset.from_tensor_slices({"x": x, "y": np.arange(20)}).batch(3)  # 7 batches
    [(start, count, graph)] = list(ranges.read_ranges(small, 7, 2))
    assert (start, count) == (0, 7) and graph is not None
    assert ranges.whole_range(small, 7) is not None  # its own graph: nothing read here
    _assert_same_batches(list(deserialize_dataset(graph, small.element_spec)), list(small))
    (tmp_path / "lines.txt").write_text("".join(f"{i}\n" for i in range(5)))
    files = tf.data.TextLineDataset(str(tmp_path / "lines.txt")).batch(2)
    read_file = tf.data.Dataset.from_tensor_slices([str(tmp_path / "lines.txt")]).map(tf.io.read_file).batch(1)
    random_map = small.map(lambda b: {"x": b["x"] + tf.random.uniform([2]), "y": b["y"]})
    long = tf.data.Dataset.range(100).batch(2)
    # Files are read here (a worker may not see them), random maps too (not in a graph), and data
    # above MIN_RANGE_BATCHES or of unknown size is cut into ranges read here.
    for dataset, batches in ((files, 3), (read_file, 1), (random_map, 7), (long, 50), (small, None)):
        assert ranges.whole_range(dataset, batches) is None, dataset
