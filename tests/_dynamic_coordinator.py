"""A coordinator process for test_dynamic_embedding_checkpoints.py, and the model both use.

    python _dynamic_coordinator.py train CLUSTER_JSON CHECKPOINT_DIR
        trains, checkpoints, prints {"path", "predicted"} (the cluster's predictions for KEYS at that
        checkpoint), then trains on until it is killed.
    python _dynamic_coordinator.py serve MODEL_KERAS
        loads an exported model with no cluster, importing psclient but not psclient.layers, and
        prints {"predicted", "unknown_rows"}.
"""

from __future__ import annotations

import importlib
import json
import sys

import numpy as np

CAPACITY = 300
#: Keys the predictions are compared on: seen ones, and ones no training ever sees (unknown).
UNKNOWN = [10**12 + i for i in range(3)]


def data(seed, n=512):
    """A frequent id (0..99) that sets the label, and a rare one (1000..2999, more than CAPACITY)."""
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.integers(0, 100, n), rng.integers(1000, 3000, n)], axis=1)
    return ids, (ids[:, :1] % 2).astype("float32")


def probe():
    """Inputs to compare predictions on: pairs of trained keys, and pairs with unknown keys."""
    seen = data(0, n=16)[0]
    return np.concatenate([seen, np.array([[u, u] for u in UNKNOWN]), np.array([[1, UNKNOWN[0]]])])


def make_model(name, optimizer=None):
    import keras

    from psclient.layers import DynamicEmbedding

    ids = keras.Input((2,), dtype="int64")
    layer = DynamicEmbedding(4, name=name, capacity=CAPACITY)
    logit = keras.layers.Dense(1)(keras.layers.Flatten()(layer(ids)))
    model = keras.Model(ids, logit)
    model.compile(optimizer=optimizer or keras.optimizers.Adagrad(0.5),
                  loss=keras.losses.BinaryCrossentropy(from_logits=True))
    return model, layer


def _train(cluster_file, checkpoint_dir):
    import psclient

    with open(cluster_file) as f:
        cluster = psclient.Cluster(json.load(f))
    strategy = psclient.ParameterServerStrategy(cluster, checkpoint_dir=checkpoint_dir)
    with strategy.scope():
        model, _ = make_model("ids")
    x, y = data(0)
    model.fit(x, y, epochs=1, batch_size=64, verbose=0)
    path = strategy.save_checkpoint()
    print(json.dumps({"path": path, "predicted": model.predict(probe(), verbose=0).tolist()}), flush=True)
    while True:  # until killed
        model.fit(x, y, epochs=1, batch_size=64, verbose=0)


def _serve(path):
    import keras
    import tensorflow as tf

    # For its side effect (not psclient.layers: the layer is registered when Keras loads).
    importlib.import_module("psclient")

    model = keras.models.load_model(path)
    unknown = model.get_layer("ids")(tf.constant(UNKNOWN, tf.int64)).numpy()
    print(json.dumps({"predicted": model.predict(probe(), verbose=0).tolist(), "unknown_rows": unknown.tolist()}),
          flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "train":
        _train(sys.argv[2], sys.argv[3])
    else:
        _serve(sys.argv[2])
