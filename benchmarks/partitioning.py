"""What partitioning costs here: variable_partitioner="auto" (the default) vs None.

Two models on one LocalCluster (2 workers, 2 ps), Keras 3 `model.fit`:

- mlp: the MLP of benchmarks/keras_fit.py (784-512-512-10, batch 128, Adam,
  steps_per_execution 1). With "auto" its two big kernels (1.6 MB, 1 MB) and
  their Adam slots are split in two: 12 shards.
- ctr: the model of examples/ctr_embeddings.py (four 100,000 x 16 tables and
  four 100,000 x 1 weights, hashed ids, Adagrad, batch 512,
  steps_per_execution 4). With "auto" the 8 tables and their accumulators are
  split: 16 partitioned variables.

Each run builds the model, then one `fit` of 3 epochs; the first epoch
(tracing) is timed on its own, and steps/s and task CPU per step (every task
process and this coordinator, user + system) come from epochs 2 and 3. The
two settings alternate, `--repeats` times each, in this one coordinator
process (one strategy at a time); medians are reported. CPU per step is the
steadier figure on a shared machine: wall time moves with other load.

    python benchmarks/partitioning.py [--repeats 3] [--models mlp,ctr] [--out results.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time

import _common

NUM_WORKERS, NUM_PS = 2, 2
SETTINGS = ("auto", "none")
_EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "ctr_embeddings.py")


def _ctr_module():
    spec = importlib.util.spec_from_file_location("ctr_embeddings", _EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def mlp(keras, steps_per_epoch: int):
    import numpy as np
    import tensorflow as tf

    model = keras.Sequential([keras.Input((784,)), keras.layers.Dense(512, activation="relu"),
                              keras.layers.Dense(512, activation="relu"), keras.layers.Dense(10)])
    model.compile(optimizer=keras.optimizers.Adam(1e-4),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), steps_per_execution=1)

    def dataset(context):
        rng = np.random.default_rng(0)
        x, y = rng.standard_normal((1024, 784)).astype("float32"), rng.integers(0, 10, 1024)
        return tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(128)

    return model, {"x": dataset, "steps_per_epoch": steps_per_epoch}


_CTR: dict = {}  # the example's module and data, made once


def ctr(keras, steps_per_epoch: int):
    if not _CTR:
        module = _ctr_module()
        ids, dense, clicks, _, _ = module.ClickModel(0).sample(steps_per_epoch * 512, seed=1)
        _CTR.update(module=module, arrays=([ids, dense], clicks))
    model = _CTR["module"].build_model(keras, 100_000, 16)
    model.compile(optimizer=keras.optimizers.Adagrad(0.2),
                  loss=keras.losses.BinaryCrossentropy(from_logits=True), steps_per_execution=4)
    x, y = _CTR["arrays"]
    return model, {"x": x, "y": y, "batch_size": 512}


MODELS = {"mlp": (mlp, 150), "ctr": (ctr, 300)}


def measure(cluster, pids, name: str, setting: str) -> dict:
    import keras

    import psclient

    build, steps_per_epoch = MODELS[name]
    strategy = psclient.ParameterServerStrategy(cluster, variable_partitioner=None if setting == "none" else "auto")
    try:
        with strategy.scope():
            model, fit_args = build(keras, steps_per_epoch)
        marks = []

        class Marks(keras.callbacks.Callback):
            def on_epoch_begin(self, epoch, logs=None):
                marks.append((time.perf_counter(), _common.cpu_seconds(pids)))

            def on_epoch_end(self, epoch, logs=None):
                marks.append((time.perf_counter(), _common.cpu_seconds(pids)))

        model.fit(epochs=3, verbose=0, callbacks=[Marks()], **fit_args)
        placement = strategy.placement()
    finally:
        strategy.shutdown()
    steps = 2 * steps_per_epoch
    (start, cpu_start), (end, cpu_end) = marks[2], marks[-1]
    return {
        "first_epoch_s": round(marks[1][0] - marks[0][0], 2),
        "steps_per_s": round(steps / (end - start), 1),
        "cpu_ms_per_step": round(1000 * (cpu_end - cpu_start) / steps, 2),
        "shards": sum(1 for entry in placement["variables"] if entry["part"] is not None),
        "bytes_per_ps": placement["bytes_per_ps"],
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--models", default="mlp,ctr", help=f"comma-separated subset of {','.join(MODELS)}")
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args(argv)
    models = args.models.split(",")
    unknown = sorted(set(models) - set(MODELS))
    if unknown or args.repeats < 1:
        parser.error(f"--models must name some of {sorted(MODELS)} (got {unknown}), --repeats >= 1")
    config = {**_common.environment(sys.argv), "num_workers": NUM_WORKERS, "num_ps": NUM_PS}
    runs = {name: {setting: [] for setting in SETTINGS} for name in models}
    with _common.local_cluster(NUM_WORKERS, NUM_PS) as (cluster, task_pids):
        pids = [*task_pids.values(), os.getpid()]
        for repeat in range(args.repeats):
            for name in models:
                # Alternate which setting goes first: neighbours see similar load.
                for setting in SETTINGS if repeat % 2 == 0 else SETTINGS[::-1]:
                    _common.log(f"{name} variable_partitioner={setting} (repeat {repeat + 1}/{args.repeats})")
                    result = measure(cluster, pids, name, setting)
                    _common.log(json.dumps(result))
                    runs[name][setting].append(result)
    summary = {
        name: {
            setting: {key: _common.median([r[key] for r in results])
                      for key in ("first_epoch_s", "steps_per_s", "cpu_ms_per_step")}
            for setting, results in by_setting.items()
        }
        for name, by_setting in runs.items()
    }
    result = {"config": config, "median": summary, "runs": runs}
    _common.print_json(result, also_to=args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
