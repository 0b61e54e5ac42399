"""A custom training loop that survives a coordinator restart.

Run it; kill it (Ctrl-C, SIGKILL, a lost machine); run the same command again:
it resumes from the newest checkpoint in --checkpoint-dir with the variables,
optimizer state, step and epoch counters of the last completed epoch. An epoch
is never repeated or skipped: each epoch ends with `strategy.save_checkpoint()`,
and an epoch cut off midway is rolled back to its start.

    # Terminal 1: a cluster (or use `psclient launch`, or your own tasks).
    # Terminal 2:
    python examples/resume_training.py --cluster cluster.json --checkpoint-dir /tmp/ckpt

With no --cluster, the cluster comes from TF_CONFIG (`psclient.Cluster.from_env()`).
The strategy also checkpoints on its own every --checkpoint-interval seconds, which
is what it restores from if a ps task restarts during training.
"""

import argparse
import json
import sys

import keras
import numpy as np
import tensorflow as tf

import psclient


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cluster", help="JSON file with the cluster's jobs (default: TF_CONFIG)")
    parser.add_argument("--checkpoint-dir", required=True)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--steps-per-epoch", type=int, default=50)
    parser.add_argument("--checkpoint-interval", type=float, default=60.0)
    args = parser.parse_args(argv)

    if args.cluster:
        with open(args.cluster) as f:
            cluster = psclient.Cluster.from_dict(json.load(f))
    else:
        cluster = psclient.Cluster.from_env()
    strategy = psclient.ParameterServerStrategy(
        cluster, checkpoint_dir=args.checkpoint_dir, checkpoint_interval=args.checkpoint_interval
    )
    try:
        # Create every variable first, always in the same order: checkpoints
        # match variables by creation order.
        with strategy.scope():
            model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, "relu"), keras.layers.Dense(1)])
            optimizer = keras.optimizers.SGD(0.01)
            optimizer.build(model.trainable_variables)
            epoch = tf.Variable(0, dtype=tf.int64, name="epoch")
            steps = tf.Variable(0, dtype=tf.int64, name="steps")
        restored = strategy.restore()
        start = int(epoch.numpy())
        print(json.dumps({"event": "start", "epoch": start, "steps": int(steps.numpy()),
                          "restored": restored}), flush=True)

        rng = np.random.default_rng(0)
        x = rng.normal(size=(4096, 16)).astype("float32")
        y = x.sum(axis=1, keepdims=True)
        dataset = strategy.distribute_datasets_from_function(
            lambda ctx: tf.data.Dataset.from_tensor_slices((x, y)).shard(
                ctx.num_input_pipelines, ctx.input_pipeline_id).repeat().shuffle(512).batch(64)
        )
        iterator = iter(dataset)

        @tf.function
        def train_step(it):
            features, labels = next(it)
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((model(features) - labels) ** 2)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            steps.assign_add(1)
            return loss

        for e in range(start, args.epochs):
            losses = [strategy.schedule(train_step, args=(iterator,)) for _ in range(args.steps_per_epoch)]
            strategy.join()
            epoch.assign(e + 1)
            path = strategy.save_checkpoint()
            print(json.dumps({"event": "epoch", "epoch": e + 1, "steps": int(steps.numpy()),
                              "loss": float(np.mean([f.result() for f in losses])),
                              "checkpoint": path}), flush=True)
        print(json.dumps({"event": "done", "epoch": int(epoch.numpy()), "steps": int(steps.numpy()),
                          "iterations": int(optimizer.iterations.numpy())}), flush=True)
        return 0
    finally:
        strategy.shutdown()


if __name__ == "__main__":
    sys.exit(main())
