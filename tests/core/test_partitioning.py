"""The pure partitioning logic: shard counts, row ranges, shard tasks (TensorFlow only to cross-check)."""

import pytest

from psclient._core.partitioning import (
    PartitionError,
    can_split,
    min_size_shards,
    row_ranges,
    shard_count,
    shard_tasks,
)
from psclient._core.placement import Placer


@pytest.mark.parametrize("shape, expected", [
    (None, False), ((), False), ((1,), False), ((1, 100), False), ((0, 4), False),
    ((None, 4), False), ((2,), True), ((1000, 16), True),
])
def test_can_split(shape, expected):
    assert can_split(shape) is expected


def test_shard_count_accepts_lists_tuples_and_integer_likes():
    assert shard_count("v", (10, 4), [2, 1]) == 2
    assert shard_count("v", (10, 4), (10, 1)) == 10
    assert shard_count("v", (10,), [True]) == 1  # operator.index accepts it


@pytest.mark.parametrize("result, fragment", [
    (2, "Received: 2 of type int"),
    ([2.0, 1], "Received: [2.0, 1] of type list"),
    ([2], "1 numbers for a variable of rank 2"),
    ([0, 1], "a number below 1"),
    ([1, 2], "axis other than 0"),
    ([11, 1], "11 shards for 10 rows"),
])
def test_shard_count_errors_name_variable_received_and_expected(result, fragment):
    with pytest.raises(PartitionError) as info:
        shard_count("dense/kernel", (10, 4), result)
    message = str(info.value)
    assert "'dense/kernel'" in message and fragment in message
    assert "Expected a list of 2 positive integers" in message
    assert isinstance(info.value, ValueError)


def test_row_ranges_cut_like_tf_first_shards_one_row_longer():
    assert row_ranges(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert row_ranges(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert row_ranges(7, 1) == [(0, 7)]
    for rows in range(1, 30):
        for shards in range(1, rows + 1):
            ranges = row_ranges(rows, shards)
            sizes = [stop - start for start, stop in ranges]
            assert ranges[0][0] == 0 and ranges[-1][1] == rows
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
            assert max(sizes) - min(sizes) <= 1
    with pytest.raises(ValueError, match="shards=5 for rows=4"):
        row_ranges(4, 5)


def test_shard_tasks_consecutive_from_first_wrapping():
    assert shard_tasks(0, 2, 2) == [0, 1]
    assert shard_tasks(1, 2, 2) == [1, 0]
    assert shard_tasks(2, 4, 3) == [2, 0, 1, 2]
    with pytest.raises(ValueError, match="first=3"):
        shard_tasks(3, 1, 3)


def test_min_size_shards_matches_tf_arithmetic():
    kib = 1 << 10
    assert min_size_shards((256, 256), 4, 128 * kib, 2) == 2   # 256 KiB: two 128 KiB shards
    assert min_size_shards((256, 10), 4, 128 * kib, 2) == 1    # 10 KiB: whole
    assert min_size_shards((2_000_000, 16), 4, 256 * kib, 2) == 2
    assert min_size_shards((3, 1_000_000), 4, 1, 8) == 3       # never more shards than rows
    assert min_size_shards((100, 512), 4, 128 * kib, 2) == 2   # 200 KiB: TF rounds up (two of 100 KiB)
    assert min_size_shards((32, 1024), 4, 128 * kib, 2) == 1   # exactly 128 KiB: whole
    assert min_size_shards((2_000_000, 16), 4, 128 * kib, 8) == 8


def test_min_size_shards_agrees_with_tf_min_size_partitioner():
    tf = pytest.importorskip("tensorflow")
    kib = 1 << 10
    for shape in [(256, 256), (256, 10), (100, 512), (32, 1024), (33, 1024), (3, 1_000_000), (2_000_000, 16),
                  (65, 8), (5000,), (4, 3, 2)]:
        for min_bytes, max_shards in [(128 * kib, 2), (128 * kib, 3), (256 * kib, 2), (1, 8), (100, 4)]:
            partitioner = tf.distribute.experimental.partitioners.MinSizePartitioner(min_bytes, max_shards)
            want = partitioner(tf.TensorShape(shape), tf.float32)[0]
            assert min_size_shards(shape, 4, min_bytes, max_shards) == want, (shape, min_bytes, max_shards)


def test_recommended_setting_balances_the_issue_model_within_1_25x():
    """Dense(256) on 256 inputs + Dense(10), with Adam's two slots, on 2 ps.

    Replays what the strategy's creator does: the partitioner's count, the
    first shard on the least-loaded task, slots beside their variable.
    """
    kib, num_ps = 1 << 10, 2
    placer = Placer(num_ps)
    shapes = [(256, 256), (256,), (256, 10), (10,)]
    firsts = {}
    for copy in range(3):  # the variable, then Adam's momentum and velocity
        for shape in shapes:
            rows, row_bytes = shape[0], 4 * (shape[1] if len(shape) > 1 else 1)
            shards = min_size_shards(shape, 4, 128 * kib, num_ps) if can_split(shape) else 1
            first = placer.choose(rows * row_bytes) if copy == 0 else firsts[shape]
            firsts[shape] = first
            for (start, stop), ps in zip(row_ranges(rows, shards), shard_tasks(first, shards, num_ps)):
                placer.record(f"{shape}", (stop - start,) + shape[1:], "float32", (stop - start) * row_bytes, ps)
    loads = placer.bytes_per_ps()
    assert max(loads) / min(loads) <= 1.25, loads


def test_placer_records_shards():
    placer = Placer(2)
    entry = placer.record("t/part_1:0", (5, 4), "float32", 80, 1, part=(1, 2), rows=(5, 10), of="t")
    assert entry.part == (1, 2) and entry.rows == (5, 10) and entry.of == "t"
    report = placer.report()
    assert report["bytes_per_ps"] == [0, 80]
    assert report["variables"][0]["part"] == (1, 2)
