"""fit on data made in Python: psclient against Keras in one process.

Published scripts often make their batches in Python: `tf.data.Dataset.from_generator`,
a `keras.utils.PyDataset`, a plain generator. psclient reads such data on the
coordinator, once per epoch, and sends each step's batch to a free worker
(docs/keras.md, "Data made in Python"). TF's own ParameterServerStrategy has no
such path (its workers build their datasets themselves, and a `from_generator`
dataset's Python lives in the coordinator), so the anchor is Keras in one process,
the way these scripts run without a cluster.

Data: `--rows` rows of 16 features, the target a seeded linear function of them;
batches of `--batch`. Model: Dense(64, relu), Dense(1), SGD, mse.

Cases:

  from_generator  `Dataset.from_generator(rows).batch(batch)`: size unknown to TF
  pydataset       a `keras.utils.PyDataset` of the batches (known size)
  generator       a Python generator of the batches, `steps_per_epoch` given
  tensor_slices   the reference: the same data held in a dataset's graph
                  (`from_tensor_slices`), which psclient sends the workers, who
                  read it themselves; what a step costs on the cluster without
                  the coordinator making its batch

Paths, in one process, interleaved: `keras_local` (a model built outside any
strategy) and `psclient` (built in the scope of a strategy on LocalCluster(2
workers, 1 ps)). Each fit is one epoch, timed `--repeats` times after one untimed
fit that traces. Per case and path: median wall seconds per epoch, CPU seconds of
the coordinator and of all processes (the cluster's tasks too), the elements the
data's Python made per epoch (each should be made once), and the psclient /
keras_local ratios. `--psclient PATH` imports psclient from another checkout (an
older commit, in the same run conditions; a case it refuses is reported as such).

    python benchmarks/host_data.py [--rows 6400] [--batch 64] [--repeats 5] [--out results.json]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.dirname(_HERE)]  # _common, and the psclient of this checkout
import _common  # noqa: E402

NUM_WORKERS, NUM_PS = 2, 1
FEATURES = 16
PATHS = ("keras_local", "psclient")


def make_sources(rows: int, batch: int):
    """{case: (make the fit arguments, count of elements made)} over one seeded data set."""
    import keras
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(0)
    x = rng.standard_normal((rows, FEATURES)).astype("float32")
    y = (x @ rng.standard_normal((FEATURES, 1)) + 0.1 * rng.standard_normal((rows, 1))).astype("float32")
    made = {"from_generator": 0, "pydataset": 0, "generator": 0, "tensor_slices": 0}
    steps = math.ceil(rows / batch)

    def rows_made():
        for i in range(rows):
            made["from_generator"] += 1
            yield x[i], y[i]

    class Batches(keras.utils.PyDataset):
        def __len__(self):
            return steps

        def __getitem__(self, index):
            made["pydataset"] += 1
            return x[index * batch:(index + 1) * batch], y[index * batch:(index + 1) * batch]

    def batches():
        for i in range(0, rows, batch):
            made["generator"] += 1
            yield x[i:i + batch], y[i:i + batch]

    spec = (tf.TensorSpec((FEATURES,), tf.float32), tf.TensorSpec((1,), tf.float32))
    return {
        "from_generator": lambda: {"x": tf.data.Dataset.from_generator(rows_made, output_signature=spec).batch(batch)},
        "pydataset": lambda: {"x": Batches()},
        "generator": lambda: {"x": batches(), "steps_per_epoch": steps},
        "tensor_slices": lambda: {"x": tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)},
    }, made


def build_model():
    import keras

    model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    return model


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=6400, help="rows of data (default 6400)")
    parser.add_argument("--batch", type=int, default=64, help="batch size (default 64)")
    parser.add_argument("--repeats", type=int, default=5, help="timed epochs per case and path (default 5)")
    parser.add_argument("--psclient", help="import psclient from this checkout instead of this one")
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args(argv)
    for name in ("rows", "batch", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1 (got {getattr(args, name)})")
    _common.use_psclient_from(args.psclient)
    import warnings

    import psclient

    warnings.filterwarnings("ignore", message=r".*(shuffle=True|ran out of data)")  # Keras's, in both paths
    config = {**_common.environment(sys.argv), "psclient_path": os.path.dirname(os.path.dirname(psclient.__file__)),
              "num_workers": NUM_WORKERS, "num_ps": NUM_PS, "rows": args.rows, "batch": args.batch,
              "repeats": args.repeats, "load_average": [round(v, 2) for v in os.getloadavg()]}
    sources, made = make_sources(args.rows, args.batch)
    runs: dict = {}
    refused: dict = {}
    with _common.keras_side_by_side(build_model, NUM_WORKERS, NUM_PS) as (models, pids):
        for case, make in sources.items():
            for path_name, model in models.items():
                try:
                    model.fit(**make(), epochs=1, verbose=0)  # traces
                except ValueError as error:  # an older psclient refused generators and PyDatasets
                    refused[(case, path_name)] = str(error).splitlines()[0]
            for _ in range(args.repeats):
                for path_name, model in models.items():
                    if (case, path_name) in refused:
                        continue
                    before = made[case]
                    start = time.perf_counter()
                    cpu = {"coordinator": _common.cpu_seconds([os.getpid()]),
                           "all": _common.cpu_seconds(pids[path_name])}
                    model.fit(**make(), epochs=1, verbose=0)
                    record = runs.setdefault((case, path_name),
                                             {"seconds": [], "coordinator": [], "all": [], "made": []})
                    record["seconds"].append(time.perf_counter() - start)
                    record["coordinator"].append(_common.cpu_seconds([os.getpid()]) - cpu["coordinator"])
                    record["all"].append(_common.cpu_seconds(pids[path_name]) - cpu["all"])
                    record["made"].append(made[case] - before)
            _common.log(f"{case}: " + ", ".join(
                f"{p} {_common.median(runs[(case, p)]['seconds']):.3f} s" for p in PATHS if (case, p) in runs))
    summary = {}
    for case in sources:
        entry: dict = {}
        for path_name in PATHS:
            if (case, path_name) in refused:
                entry[path_name] = {"refused": refused[(case, path_name)]}
                continue
            record = runs[(case, path_name)]
            entry[path_name] = {
                "seconds_per_epoch": round(_common.median(record["seconds"]), 3),
                "coordinator_cpu_seconds": round(_common.median(record["coordinator"]), 3),
                "all_cpu_seconds": round(_common.median(record["all"]), 3),
                "elements_made_per_epoch": int(_common.median(record["made"])),
                "all_seconds": [round(t, 3) for t in record["seconds"]],
            }
        if all("seconds_per_epoch" in entry[p] for p in PATHS):
            local, remote = entry["keras_local"], entry["psclient"]
            entry["psclient_over_keras_local"] = {
                "seconds": round(remote["seconds_per_epoch"] / local["seconds_per_epoch"], 2),
                "all_cpu": round(remote["all_cpu_seconds"] / max(local["all_cpu_seconds"], 1e-3), 2),
            }
        summary[case] = entry
    _common.print_json({"config": config, "cases": summary}, also_to=args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
