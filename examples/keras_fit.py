"""Train a Keras 3 classifier with an ordinary `model.fit` on a local parameter-server cluster.

Offline by default: the data is scikit-learn's bundled handwritten digits
(8x8 images, 1,797 examples). With `--data mnist` it uses MNIST from
TensorFlow Datasets when `tensorflow_datasets` is installed and the data is
already downloaded (or mocked, as the tests do).

It starts a LocalCluster (2 workers, 1 ps on 127.0.0.1), creates and compiles
the model inside `strategy.scope()` (so weights, optimizer slots and metrics
live on the ps), then calls plain `model.fit` with a progress bar, validation,
a best-model checkpoint and psclient's atomic BackupAndRestore, and finishes
with `model.evaluate` on held-out data and a reload of the saved model without
any cluster.

    python examples/keras_fit.py [--epochs 15] [--workers 2] [--ps 1] [--data digits|mnist]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import numpy as np


def load_digits_split(seed: int = 0):
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")
    y = digits.target.astype("int64")
    return train_test_split(x, y, test_size=0.2, random_state=seed, stratify=y)


def load_mnist_split(limit: int | None = None):
    import tensorflow_datasets as tfds

    def arrays(split):
        dataset = tfds.load("mnist", split=split, as_supervised=True)
        if limit:
            dataset = dataset.take(limit)
        # One big batch rather than tfds's batch_size=-1, which aborts the
        # process under tfds.testing.mock_data with TF 2.21 (std::length_error).
        x, y = next(iter(tfds.as_numpy(dataset.batch(100_000))))
        return (x.reshape(len(x), -1) / 255.0).astype("float32"), y.astype("int64")

    (x_train, y_train), (x_test, y_test) = arrays("train"), arrays("test")
    return x_train, x_test, y_train, y_test


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--ps", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--steps-per-execution", type=int, default=4)
    parser.add_argument("--data", choices=("digits", "mnist"), default="digits")
    parser.add_argument("--limit", type=int, help="use only this many examples per split (mnist)")
    parser.add_argument("--target", type=float, default=0.95, help="exit 1 below this test accuracy")
    parser.add_argument("--out", help="directory for checkpoints (a temporary one by default)")
    parser.add_argument("--verbose", type=int, default=1, choices=(0, 1, 2))
    args = parser.parse_args(argv)

    import keras

    import psclient

    keras.utils.set_random_seed(0)
    if args.data == "digits":
        x_train, x_test, y_train, y_test = load_digits_split()
    else:
        x_train, x_test, y_train, y_test = load_mnist_split(args.limit)
    features = x_train.shape[1]
    out = args.out or tempfile.mkdtemp(prefix="psclient-keras-fit-")
    os.makedirs(out, exist_ok=True)

    print(f"Starting a local cluster: {args.workers} workers, {args.ps} ps (127.0.0.1 only) ...", flush=True)
    with psclient.LocalCluster(num_workers=args.workers, num_ps=args.ps) as cluster:
        strategy = psclient.ParameterServerStrategy(cluster.cluster)
        try:
            with strategy.scope():
                model = keras.Sequential([
                    keras.Input((features,)),
                    keras.layers.Dense(128, activation="relu"),
                    keras.layers.Dense(10),
                ])
                # The rate decays to zero over the run: asynchronous updates
                # from several workers make the last epochs noisy at a fixed
                # rate, and the weights the run ends with are the ones evaluated.
                steps = args.epochs * -(-len(x_train) // args.batch_size)
                model.compile(
                    optimizer=keras.optimizers.Adam(keras.optimizers.schedules.CosineDecay(1e-2, steps)),
                    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                    metrics=["accuracy"],
                    steps_per_execution=args.steps_per_execution,
                )
            best = os.path.join(out, "best.keras")
            model.fit(
                x_train, y_train,
                batch_size=args.batch_size,
                epochs=args.epochs,
                validation_data=(x_test, y_test),
                verbose=args.verbose,
                callbacks=[
                    keras.callbacks.ModelCheckpoint(best, monitor="val_accuracy", save_best_only=True),
                    psclient.BackupAndRestore(os.path.join(out, "backup")),
                ],
            )
            results = model.evaluate(x_test, y_test, batch_size=256, verbose=0, return_dict=True)
            print(f"test loss {results['loss']:.4f}, test accuracy {results['accuracy']:.4f} "
                  f"(evaluated on the cluster, every example once)")
            print("placement:", strategy.placement()["bytes_per_ps"], "bytes per ps")
        finally:
            strategy.shutdown()

        # The checkpoint is an ordinary Keras file: loaded outside the scope,
        # the model lives in this process. (Done before the cluster closes:
        # TensorFlow keeps this process connected to the tasks, and Keras's
        # local predict waits on every connected device.)
        reloaded = keras.saving.load_model(best)
        accuracy = float(np.mean(np.argmax(reloaded.predict(x_test, verbose=0), axis=1) == y_test))
        print(f"best checkpoint {best}: test accuracy {accuracy:.4f} (reloaded, run in this process)")
    if results["accuracy"] < args.target:
        print(f"test accuracy {results['accuracy']:.4f} is below the target {args.target}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
