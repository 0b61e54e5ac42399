"""psclient.data refuses bad input with errors that name what was received and expected (no cluster)."""

import pytest
import tensorflow as tf

import psclient
from psclient import data


def make_dataset(shard):
    return tf.data.Dataset.range(shard.start, shard.end).batch(2)


def test_range_shards_cover_every_record_once():
    shards = data.range_shards(10, 4)
    assert [(s.start, s.end) for s in shards] == [(0, 4), (4, 8), (8, 10)]
    assert data.ShardedDataset(shards, make_dataset).num_records == 10


@pytest.mark.parametrize("args, match", [
    ((0, 4), r"Received: num_records=0\. Expected an integer >= 1"),
    ((10, 0), r"Received: shard_size=0\. Expected an integer >= 1"),
    ((10, 2.5), r"Received: shard_size=2.5"),
])
def test_bad_range_shards(args, match):
    with pytest.raises(ValueError, match=match):
        data.range_shards(*args)


def test_file_shards(tmp_path):
    paths = []
    for index, count in enumerate([5, 3]):
        path = str(tmp_path / f"part-{index}.tfrecord")
        with tf.io.TFRecordWriter(path) as writer:
            for i in range(count):
                writer.write(f"{index}:{i}".encode())
        paths.append(path)
    whole = data.file_shards(paths)
    assert [(s.file, s.start, s.end) for s in whole] == [(paths[0], 0, -1), (paths[1], 0, -1)]
    assert data.ShardedDataset(whole, make_dataset).num_records is None
    split = data.file_shards(paths, records_per_shard=2)
    assert [(s.file, s.start, s.end) for s in split] == [
        (paths[0], 0, 2), (paths[0], 2, 4), (paths[0], 4, 5), (paths[1], 0, 2), (paths[1], 2, 3)]

    def read(shard):
        return tf.data.TFRecordDataset(shard.file).skip(shard.start).take(shard.end - shard.start).batch(2)

    sharded = data.ShardedDataset(split, read)
    records = [r for batch in sharded.as_dataset() for r in batch.numpy()]
    assert sorted(records) == sorted(f"{f}:{i}".encode() for f, n in [(0, 5), (1, 3)] for i in range(n))
    with pytest.raises(FileNotFoundError, match=r"1 of 2 files do not exist\. Received: \['.*missing'\]"):
        data.file_shards([paths[0], str(tmp_path / "missing")])
    with pytest.raises(ValueError, match=r"Received: files=\[\]"):
        data.file_shards([])
    with pytest.raises(TypeError, match="Expected a list of file paths"):
        data.file_shards(paths[0])
    with pytest.raises(ValueError, match="records_per_shard=0"):
        data.file_shards(paths, records_per_shard=0)


def test_bad_sharded_dataset():
    with pytest.raises(ValueError, match=r"Received: shards=\[\]\. Expected a non-empty list"):
        data.ShardedDataset([], make_dataset)
    with pytest.raises(TypeError, match=r"Received: an element \(0, 4\) of type tuple"):
        data.ShardedDataset([(0, 4)], make_dataset)
    with pytest.raises(TypeError, match=r"signature f\(a, b\)\. Expected a function taking exactly one"):
        data.ShardedDataset(data.range_shards(4, 2), _two_arguments())
    with pytest.raises(TypeError, match="Received: make_dataset=3 of type int"):
        data.ShardedDataset(data.range_shards(4, 2), 3)
    for bad in (data.Shard(5, 2), data.Shard(-3, 2), data.Shard(0, -1), data.Shard(0.5, 2)):
        with pytest.raises(ValueError, match=r"Received: Shard\(start=.*Expected integer bounds 0 <= start < end"):
            data.ShardedDataset([data.Shard(0, 2), bad], make_dataset)
    with pytest.raises(FileNotFoundError, match=r"do not exist\. Received: \['/nonexistent/part-0'\]"):
        data.ShardedDataset([data.Shard(0, -1, "/nonexistent/part-0")], make_dataset)
    with pytest.raises(ValueError, match="seed=-1"):
        data.ShardedDataset(data.range_shards(4, 2), make_dataset, seed=-1)
    not_a_dataset = data.ShardedDataset(data.range_shards(4, 2), lambda shard: [shard.start])
    with pytest.raises(TypeError, match="returned an object of type list. Expected a tf.data.Dataset"):
        not_a_dataset.element_spec


def _two_arguments():
    def f(a, b):
        return None

    return f


def test_make_dataset_is_traced_once_with_tensors():
    calls = []

    def traced(shard):
        calls.append((type(shard.start).__name__, shard.file))
        return tf.data.Dataset.range(shard.start, shard.end).batch(2)

    sharded = data.ShardedDataset(data.range_shards(8, 3), traced)
    assert sharded.element_spec.dtype == tf.int64
    assert [b.numpy().tolist() for b in sharded.as_dataset()] == [[0, 1], [2], [3, 4], [5], [6, 7]]
    assert calls[0][1] is None and all(kind != "int" for kind, _ in calls)  # tensors, not Python ints


def test_public_names():
    assert psclient.data.ShardedDataset is data.ShardedDataset
    assert issubclass(data.LedgerMismatchError, psclient.PSClientError)


def test_a_dataset_of_unknown_size_is_cut_into_ranges_of_batches(tmp_path):
    from psclient._coordinator.data.finite import NondeterministicDatasetError, _refuse_nondeterministic, sharded_from_dataset
    from psclient._tf.data import make_deterministic, serialize_dataset

    filtered = tf.data.Dataset.range(50).filter(lambda i: i % 2 == 0).batch(3)
    sharded = sharded_from_dataset(filtered, num_workers=2)
    assert len(sharded.shards) == 5 and sharded.num_records == 9  # 9 batches, counted once
    batches = [b.numpy().tolist() for b in sharded.as_dataset()]
    assert batches == [b.numpy().tolist() for b in filtered]  # each batch once, in order
    with pytest.raises(ValueError, match="repeats forever"):
        sharded_from_dataset(tf.data.Dataset.range(5).repeat().filter(lambda i: i > 1), 2)
    csv = tmp_path / "data.csv"
    csv.write_text("a,b\n" + "".join(f"{i},{i % 3}\n" for i in range(20)))
    # make_csv_dataset's default shuffle (no seed, reshuffled per iteration), with a seed, and a
    # plain unseeded shuffle: rewritten to one order in every copy, so shards take each record once.
    for dataset in (tf.data.experimental.make_csv_dataset(str(csv), 4, num_epochs=1),
                    tf.data.experimental.make_csv_dataset(str(csv), 4, num_epochs=1, shuffle_seed=1),
                    tf.data.Dataset.range(20).shuffle(20).filter(lambda i: i >= 0).map(lambda i: {"a": i}).batch(4)):
        sharded = sharded_from_dataset(dataset, 2)
        copies = [[int(i) for batch in sharded.as_dataset() for i in batch["a"]] for _ in range(2)]
        assert sorted(copies[0]) == list(range(20)), copies[0]  # each record once
        assert copies[0] == copies[1]  # the same order in every copy

        def epoch_order(epoch):  # every shard of `epoch`, in list order, as a worker builds each
            return [int(i) for shard in sharded.shards for batch in sharded.make_dataset(data.Shard(
                tf.constant(shard.start, tf.int64), tf.constant(shard.end, tf.int64), None,
                tf.constant(epoch, tf.int64))) for i in batch["a"]]

        assert epoch_order(0) == copies[0]
        assert sorted(epoch_order(1)) == list(range(20)) and epoch_order(1) != copies[0]  # reshuffled per epoch
        assert epoch_order(1) == epoch_order(1)  # the same in every copy of that epoch
    # Parallel ops that may yield out of order (and sample_from_datasets' unseeded choices): made
    # to keep one order in every copy, so shards take each record once.
    sloppy = tf.data.Options()
    sloppy.deterministic = False
    ten = tf.data.Dataset.range(10)
    parallel = (
        tf.data.Dataset.range(2).interleave(lambda i: tf.data.Dataset.range(i, 10, 2), num_parallel_calls=2,
                                            deterministic=False),
        ten.map(lambda i: i + 0, num_parallel_calls=4, deterministic=False),
        ten.batch(1, num_parallel_calls=2, deterministic=False).unbatch(),
        ten.map(lambda i: i + 0, num_parallel_calls=4).with_options(sloppy),
    )
    for dataset in parallel:  # each rewritten (so small a pipeline rarely yields out of order anyway)
        assert make_deterministic(serialize_dataset(dataset).numpy())[1]
    sampled = tf.data.Dataset.sample_from_datasets([tf.data.Dataset.range(5), tf.data.Dataset.range(5, 10)],
                                                   stop_on_empty_dataset=False)
    for dataset in (*parallel, sampled):
        sharded = sharded_from_dataset(dataset.filter(lambda i: i >= 0).batch(2), 2)
        copies = [[int(i) for batch in sharded.as_dataset() for i in batch] for _ in range(2)]
        assert sorted(copies[0]) == list(range(10)) and copies[0] == copies[1], copies
    with pytest.raises(NondeterministicDatasetError, match="Received: a new order every iteration"):
        _refuse_nondeterministic(serialize_dataset(filtered.shuffle(4, seed=1)).numpy())
    for dataset in (tf.data.experimental.make_csv_dataset(str(csv), 4, num_epochs=1, shuffle=False),
                    filtered.shuffle(4, seed=1, reshuffle_each_iteration=False)):
        sharded = sharded_from_dataset(dataset, 2)
        first = [str(b) for b in sharded.as_dataset()]
        assert first == [str(b) for b in dataset] and len(first) == sharded.num_records  # each batch once
