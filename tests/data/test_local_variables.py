"""A dataset that reads variables made before this process connected serializes (psclient._tf.local_variables).

Connecting gives the process's CPU a new device, and serializing a dataset looks its variables
up there by name. TF connects a process once, so the check runs in a child process that connects
to a cluster of its own server alone (no task processes needed), as tests/tables/test_local_tables.py.
"""


import numpy as np

from _child_runs import run_script_for_json

_SCRIPT = r'''
import json, logging, portpicker, tensorflow as tf, keras
from psclient._tf import local_variables
from psclient._tf.data import deserialize_dataset, serialize_dataset

class Count(logging.Handler):
    registered = 0
    def emit(self, record):
        Count.registered += "registered again" in record.getMessage()
logging.getLogger("psclient").addHandler(Count()); logging.getLogger("psclient").setLevel(logging.INFO)

offset = tf.Variable([5, 0], dtype=tf.int64)
offset.assign([7, 0])  # the serialized graph holds the value a read gives when it is sent
scale = keras.Variable(2.0)  # a Keras variable: a tf.Variable inside
generator = keras.random.SeedGenerator(3)
pipeline = tf.data.Dataset.range(3).map(lambda x: x * tf.cast(scale, tf.int64) + offset[0])
randoms = tf.data.Dataset.range(2).map(lambda x: keras.random.uniform((), seed=generator))
flips = tf.data.Dataset.from_tensors(tf.reshape(tf.range(12.0), (1, 2, 2, 3))).map(keras.layers.RandomFlip())

spec = tf.train.ClusterSpec({"localhost": [f"localhost:{portpicker.pick_unused_port()}"]})
tf.config.experimental_connect_to_cluster(spec, job_name="localhost", task_index=0, protocol="grpc")

sent = {name: (serialize_dataset(dataset), dataset.element_spec)
        for name, dataset in (("pipeline", pipeline), ("randoms", randoms), ("flips", flips))}
results = {"registered": Count.registered}
# The copies registered for the serializations are gone again: the new device holds no such variable.
# (Checked before the graphs are rebuilt here: a rebuilt graph makes its own variable of that name.)
proto = local_variables.handle_proto(offset.handle)
probe = tf.raw_ops.VarHandleOp(dtype=tf.int64, shape=[2], container=proto.container, shared_name=proto.name)
results["copy_left"] = bool(tf.raw_ops.VarIsInitializedOp(resource=probe))
after = tf.Variable(1, dtype=tf.int64)  # made after the connection: on the new device already
made_after = tf.data.Dataset.range(2).map(lambda x: x + after)
sent["made_after"] = (serialize_dataset(made_after), made_after.element_spec)
results["registered_after"] = Count.registered - results["registered"]
for name, (graph, spec) in sent.items():
    results[name] = [x.tolist() for x in deserialize_dataset(graph, spec).as_numpy_iterator()]
results["offset"] = offset.numpy().tolist()
print(json.dumps(results, default=int))
'''


def test_datasets_reading_variables_made_before_the_connection_serialize_with_their_values(tmp_path):
    result = run_script_for_json(_SCRIPT, tmp_path)
    assert result["pipeline"] == [7, 9, 11]  # the offset's value when sent, the Keras variable's too
    assert len(result["randoms"]) == 2 and all(0.0 <= x < 1.0 for x in result["randoms"])
    flipped = np.asarray(result["flips"])  # one batch of one 2x2 image: its pixels, maybe mirrored
    assert flipped.shape == (1, 1, 2, 2, 3) and sorted(flipped.ravel()) == list(range(12))
    assert result["registered"] >= 3  # offset, scale and the generator's state (RandomFlip's: per Keras version)
    assert result["made_after"] == [1, 2] and result["registered_after"] == 0
    assert result["copy_left"] is False
    assert result["offset"] == [7, 0]
