"""Bytes per step of Adafactor on partitioned variables: split on the ps vs whole on the worker.

One LocalCluster (2 workers, 2 ps), the MLP of benchmarks/partitioning.py
(784-512-512-10, batch 128, steps_per_execution 1) under the default
partitioner ("auto": the two big kernels, 1.6 MB and 1 MB, and their
Adafactor `v` split in two). Three optimizers, one after the other, each a
`fit` of 2 epochs (the second measured):

- sgd: SGD(0.01), the floor: gradients up, weights down;
- adafactor: Adafactor(1e-3) with psclient's update of a partitioned variable
  on each shard's ps (`psclient._keras.adafactor`);
- adafactor_whole: the same with Keras's own `update_step` put back, so each
  partitioned kernel is updated whole on the worker (what psclient did
  before): the kernel and its `v` read to the worker and written back.

Bytes are TCP payload over the cluster's connections (`_common.LoopbackBytes`);
steps/s and task CPU per step are printed too, but on a shared 2-core machine
only the bytes are steady.

    python benchmarks/adafactor_bytes.py [--steps 60] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import _common

NUM_WORKERS, NUM_PS = 2, 2
OPTIMIZERS = ("sgd", "adafactor", "adafactor_whole")


def measure(cluster, task_pids: dict, name: str, steps: int) -> dict:
    import keras
    import numpy as np
    import tensorflow as tf
    from keras.src.optimizers.adafactor import Adafactor

    import psclient
    from psclient._keras import install

    install.install()  # what a strategy's scope does first: psclient's update_step in place
    patched = Adafactor.update_step
    if name == "adafactor_whole":
        Adafactor.update_step = patched.__wrapped__  # Keras's own (functools.update_wrapper)
    strategy = psclient.ParameterServerStrategy(cluster)
    try:
        with strategy.scope():
            model = keras.Sequential([keras.Input((784,)), keras.layers.Dense(512, activation="relu"),
                                      keras.layers.Dense(512, activation="relu"), keras.layers.Dense(10)])
            optimizer = keras.optimizers.SGD(0.01) if name == "sgd" else keras.optimizers.Adafactor(1e-3)
            model.compile(optimizer=optimizer, steps_per_execution=1,
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))

        def dataset(context):
            rng = np.random.default_rng(0)
            x, y = rng.standard_normal((1024, 784)).astype("float32"), rng.integers(0, 10, 1024)
            return tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(128)

        meter = _common.LoopbackBytes(cluster.jobs, coordinator_pid=os.getpid(), task_pids=task_pids)
        pids = [*task_pids.values(), os.getpid()]
        marks: list = []

        class Marks(keras.callbacks.Callback):
            def on_epoch_begin(self, epoch, logs=None):
                if epoch == 1:
                    marks.append((time.perf_counter(), _common.cpu_seconds(pids), meter.snapshot()))

            def on_epoch_end(self, epoch, logs=None):
                if epoch == 1:
                    marks.append((time.perf_counter(), _common.cpu_seconds(pids), meter.snapshot()))

        model.fit(dataset, epochs=2, steps_per_epoch=steps, verbose=0, callbacks=[Marks()])
        split = sum(1 for entry in strategy.placement()["variables"] if entry["part"] is not None)
    finally:
        strategy.shutdown()
        Adafactor.update_step = patched
    (start, cpu0, bytes0), (end, cpu1, bytes1) = marks
    moved = meter.per_step(bytes0, bytes1, steps)
    return {
        "steps_per_s": round(steps / (end - start), 1),
        "cpu_ms_per_step": round(1000 * (cpu1 - cpu0) / steps, 2),
        "mb_per_step": None if moved["total"] is None else round(moved["total"] / 1e6, 3),
        "bytes_per_step": moved,
        "shards": split,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60, help="steps in the measured epoch (default 60)")
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be >= 1 (got {args.steps})")
    result = {"config": {**_common.environment(sys.argv), "num_workers": NUM_WORKERS, "num_ps": NUM_PS,
                         "steps": args.steps}, "runs": {}}
    with _common.local_cluster(NUM_WORKERS, NUM_PS) as (cluster, task_pids):
        for name in OPTIMIZERS:
            _common.log(f"{name}: fit, 2 epochs of {args.steps} steps")
            result["runs"][name] = measure(cluster, task_pids, name, args.steps)
            _common.log(json.dumps({k: v for k, v in result["runs"][name].items() if k != "bytes_per_step"}))
    runs = result["runs"]
    if all(runs[n]["mb_per_step"] for n in OPTIMIZERS):
        result["ratios"] = {
            "adafactor_bytes_over_sgd": round(runs["adafactor"]["mb_per_step"] / runs["sgd"]["mb_per_step"], 2),
            "adafactor_whole_bytes_over_adafactor": round(
                runs["adafactor_whole"]["mb_per_step"] / runs["adafactor"]["mb_per_step"], 2),
        }
    _common.print_json(result, also_to=args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
