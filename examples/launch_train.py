"""A training script for `psclient launch`, with a sidecar evaluator beside it.

Trains a small Keras 3 classifier on scikit-learn's bundled digits (offline)
with psclient's custom loop, on the cluster that `psclient launch` hands over
through TF_CONFIG. After each epoch it saves a `tf.train.CheckpointManager`
checkpoint (the model and its optimizer; the step is the optimizer's
iterations), and at the end it writes psclient's final marker, which stops the
evaluator.

    psclient launch --workers 2 --ps 1 \\
        --evaluator "psclient evaluate --checkpoint-dir /tmp/ckpts \\
                     --model examples/launch_train.py:model --data examples/launch_train.py:data" \\
        -- python examples/launch_train.py --checkpoint-dir /tmp/ckpts --epochs 3

`model()` and `data()` are what the evaluator needs: the same architecture,
compiled with the metrics to report, and the held-out data.
"""

from __future__ import annotations

import argparse
import sys


def _split():
    import numpy as np
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    return train_test_split(x, digits.target.astype(np.int64), test_size=0.2, random_state=0,
                            stratify=digits.target)


def model(compile_metrics: bool = True):
    """The classifier, built and (for evaluation) compiled with loss and accuracy."""
    import keras

    net = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)])
    if compile_metrics:
        net.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    return net


def data():
    """The held-out split, as the (x, y) tuple that model.evaluate takes."""
    _, x_test, _, y_test = _split()
    return x_test, y_test


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint-dir", required=True)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--steps-per-epoch", type=int, default=10)
    args = parser.parse_args(argv)

    import keras
    import tensorflow as tf

    import psclient
    from psclient._sidecar.evaluator import write_final_marker

    keras.utils.set_random_seed(0)
    x_train, _, y_train, _ = _split()
    strategy = psclient.ParameterServerStrategy(psclient.Cluster.from_env())
    try:
        with strategy.scope():
            net = model(compile_metrics=False)
            optimizer = keras.optimizers.Adam(3e-3)
            optimizer.build(net.trainable_variables)
        loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

        def dataset_fn(ctx):
            return (tf.data.Dataset.from_tensor_slices((x_train, y_train))
                    .shard(ctx.num_input_pipelines, ctx.input_pipeline_id).repeat().batch(32))

        iterator = iter(strategy.distribute_datasets_from_function(dataset_fn))

        @tf.function
        def train_step(iterator):
            x, y = next(iterator)
            with tf.GradientTape() as tape:
                loss = loss_fn(y, net(x, training=True))
            grads = tape.gradient(loss, net.trainable_variables)
            optimizer.apply_gradients(zip(grads, net.trainable_variables))
            return loss

        checkpoint = tf.train.Checkpoint(model=net, optimizer=optimizer)
        manager = tf.train.CheckpointManager(checkpoint, args.checkpoint_dir, max_to_keep=None)
        for epoch in range(1, args.epochs + 1):
            futures = [strategy.schedule(train_step, args=(iterator,)) for _ in range(args.steps_per_epoch)]
            strategy.join()
            path = manager.save()  # Reads the variables from the ps tasks.
            print(f"epoch {epoch}/{args.epochs}: loss {futures[-1].result():.4f}; saved {path}", flush=True)
        write_final_marker(args.checkpoint_dir, path, step=int(optimizer.iterations.numpy()))
        print("training done", flush=True)
    finally:
        strategy.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
