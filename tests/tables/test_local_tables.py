"""Lookup tables made before this process connects to a cluster keep working after it (psclient._tf.local_tables).

Connecting gives the process's CPU a new device: named tables would be lost. TF connects a
process once, so each check runs in a child process that connects to a cluster of its own
server alone (no task processes needed) the way psclient's first connection does.
"""

from _child_runs import run_script_for_json

_SCRIPT = r'''
import json, portpicker, tensorflow as tf
from psclient._tf import local_tables

static = tf.lookup.StaticHashTable(tf.lookup.KeyValueTensorInitializer(["a", "b"], [1, 2]), -1)
vocabulary = tf.lookup.StaticVocabularyTable(
    tf.lookup.KeyValueTensorInitializer(["x", "y"], tf.constant([0, 1], tf.int64)), num_oov_buckets=1)
mutable = tf.lookup.experimental.MutableHashTable(tf.string, tf.int64, default_value=-1)
mutable.insert(["m"], [7])
dense = tf.lookup.experimental.DenseHashTable(tf.int64, tf.int64, default_value=-1, empty_key=-2, deleted_key=-3)
dense.insert([5], [50])
anonymous = tf.lookup.StaticHashTable(tf.lookup.KeyValueTensorInitializer(["q"], [9]), -1,
                                      experimental_is_anonymous=True)
pipeline = tf.data.Dataset.from_tensor_slices(["b", "a", "z"]).map(static.lookup)
before = tf.config.list_logical_devices()

saved = local_tables.export_local_tables()
spec = tf.train.ClusterSpec({"localhost": [f"localhost:{portpicker.pick_unused_port()}"]})
tf.config.experimental_connect_to_cluster(spec, job_name="localhost", task_index=0, protocol="grpc")
local_tables.rebuild_tables(saved)

print(json.dumps({
    "carried": len(saved),
    "static": static.lookup(tf.constant(["a", "z"])).numpy().tolist(),
    "vocabulary": vocabulary.lookup(tf.constant(["y", "other"])).numpy().tolist(),
    "mutable": mutable.lookup(tf.constant(["m", "n"])).numpy().tolist(),
    "dense": dense.lookup(tf.constant([5, 6], tf.int64)).numpy().tolist(),
    "anonymous": anonymous.lookup(tf.constant(["q"])).numpy().tolist(),
    "pipeline": list(pipeline.as_numpy_iterator()),
    "serialized": len(pipeline._as_serialized_graph().numpy()) > 0,
    "device": tf.constant(1.0).device,
}, default=int))
'''


def test_tables_made_before_the_connection_keep_their_contents(tmp_path):
    result = run_script_for_json(_SCRIPT, tmp_path)
    assert result["carried"] == 4  # static, the vocabulary's inner table, mutable, dense; not the anonymous one
    assert result["static"] == [1, -1]
    assert result["vocabulary"] == [1, 2]
    assert result["mutable"] == [7, -1]
    assert result["dense"] == [50, -1]
    assert result["anonymous"] == [9]
    assert result["pipeline"] == [2, 1, -1]
    assert result["serialized"]
    assert result["device"] == "/job:localhost/replica:0/task:0/device:CPU:0"  # the name did not change
