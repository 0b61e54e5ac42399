"""Datasets sent to the workers (psclient._tf.data): relative file paths made absolute, and a pipeline that cannot be sent.

No cluster: the rewritten graph is rebuilt and read in this process from another working directory,
as a worker would read it from its own.
"""

import os

import pytest
import tensorflow as tf

from psclient._tf.data import deserialize_dataset, serialize_dataset
from psclient._tf.data_paths import absolute_paths


@pytest.fixture
def data_dir(tmp_path, monkeypatch):
    (tmp_path / "a.csv").write_text("x,y\n1,2\n3,4\n")
    (tmp_path / "b.csv").write_text("x,y\n5,6\n")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _read_elsewhere(dataset, elsewhere):
    """The dataset's graph as a worker gets it, read from another working directory."""
    graph = serialize_dataset(dataset)
    os.chdir(elsewhere)
    return list(deserialize_dataset(graph, dataset.element_spec).as_numpy_iterator())


def test_text_lines_from_a_relative_path(data_dir, tmp_path_factory):
    dataset = tf.data.TextLineDataset("a.csv").skip(1)
    assert _read_elsewhere(dataset, tmp_path_factory.mktemp("w")) == [b"1,2", b"3,4"]


def test_file_list_and_glob(data_dir, tmp_path_factory):
    listed = tf.data.Dataset.from_tensor_slices(["a.csv", "b.csv"]).interleave(tf.data.TextLineDataset)
    globbed = tf.data.Dataset.list_files("*.csv", shuffle=False).interleave(tf.data.TextLineDataset)
    elsewhere = tmp_path_factory.mktemp("w")
    assert sorted(_read_elsewhere(listed, elsewhere)) == sorted([b"x,y", b"1,2", b"3,4", b"x,y", b"5,6"])
    os.chdir(data_dir)
    assert sorted(_read_elsewhere(globbed, elsewhere)) == sorted([b"x,y", b"1,2", b"3,4", b"x,y", b"5,6"])


def test_make_csv_dataset(data_dir, tmp_path_factory):
    dataset = tf.data.experimental.make_csv_dataset("a.csv", batch_size=2, num_epochs=1, shuffle=False)
    batches = _read_elsewhere(dataset, tmp_path_factory.mktemp("w"))
    assert [list(batch["x"]) for batch in batches] == [[1, 3]]


def test_strings_that_are_data_are_left_alone(data_dir):
    # "a.csv" exists here, "zebra" does not: a constant that is not all file names is data.
    words = tf.data.Dataset.from_tensor_slices(["a.csv", "zebra"])
    csv = tf.data.experimental.CsvDataset("a.csv", [tf.int32, tf.int32], header=True, field_delim=",")
    remote = tf.data.TFRecordDataset("gs://bucket/file.tfrecord")
    for dataset in (words, remote):
        graph = dataset._as_serialized_graph().numpy()
        assert absolute_paths(graph, str(data_dir)) == (graph, [])
    _, changed = absolute_paths(csv._as_serialized_graph().numpy(), str(data_dir))
    assert changed == [f"a.csv -> {data_dir / 'a.csv'}"]  # the file, not the delimiter


def test_a_pipeline_whose_resource_is_gone_says_what_to_do():
    # A resource that no longer exists, as one made on a device the process lost would be.
    table = tf.lookup.StaticHashTable(tf.lookup.KeyValueTensorInitializer(["a"], [1]), -1)
    dataset = tf.data.Dataset.from_tensor_slices(["a", "b"]).map(table.lookup)
    tf.raw_ops.DestroyResourceOp(resource=table.resource_handle)
    with pytest.raises(ValueError, match=r"Cannot send this tf\.data\.Dataset to the workers.*made before "
                                         r"psclient\.ParameterServerStrategy\(\.\.\.\) connected this process"):
        serialize_dataset(dataset)
