"""A model fit locally first, then one fit on a cluster, in the same process (a notebook's way).

The local fit traces psclient's module-level functions (a DynamicEmbedding's slot start, its
sections) before the process connects. TF registered functions traced before a first connection on
no task: the cluster fit then failed on the ps ("'__inference__slot_start_...' is neither a type of a
primitive operation nor a name of a function registered"). A process connects once, so the check
runs in a child process with a LocalCluster of its own.
"""

import pytest
from _child_runs import run_script_for_json

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

_SCRIPT = r'''
import json
import keras, numpy as np, psclient


def model():
    ids = keras.Input([1], dtype="int64")
    embedded = psclient.layers.DynamicEmbedding(4, capacity=100, name="table")(ids)
    built = keras.Model(ids, keras.layers.Dense(1)(keras.layers.Flatten()(embedded)))
    built.compile(optimizer="adagrad", loss="mse")
    return built


x = np.arange(64, dtype=np.int64)[:, None]
y = (x % 2).astype("float32")
local = model()
local_loss = local.fit(x, y, batch_size=16, epochs=2, verbose=0).history["loss"]
with psclient.LocalCluster(1, 1) as cluster:
    strategy = psclient.ParameterServerStrategy(cluster.cluster)
    try:
        with strategy.scope():
            remote = model()
        remote_loss = remote.fit(x, y, batch_size=16, epochs=2, verbose=0).history["loss"]
        rows = strategy.stats()["dynamic_embeddings"]["table"][0]["rows"]
    finally:
        strategy.shutdown()
print(json.dumps({"local": local_loss, "cluster": remote_loss, "rows": int(rows)}))
'''


def test_a_cluster_fit_after_a_local_fit_in_the_same_process(tmp_path):
    result = run_script_for_json(_SCRIPT, tmp_path)
    assert len(result["local"]) == 2 and len(result["cluster"]) == 2, result
    assert result["cluster"][1] < result["cluster"][0], result  # it trained
    assert result["rows"] == 64, result  # every id admitted on the ps
