"""evaluate's fixed cost: Keras `model.evaluate` on small tabular data, psclient against Keras in one process.

A tabular model as published structured-data examples build it: 13 named
inputs (6 numeric, 7 integer categories each through an Embedding of 4),
concatenated, Dense 32 relu, Dropout, Dense 1 sigmoid; binary cross-entropy and
accuracy. The data is `--rows` seeded rows (300 by default: 10 batches of 32),
so what is timed is mostly the cost of one evaluate call, not the batches.

Cases (evaluate's data, made anew for every call):

  dataset  `tf.data.Dataset.from_tensor_slices((features, labels)).batch(32)`
           (known size: a published example's validation data)
  arrays   the same columns as a dict of NumPy arrays, `batch_size=32`
  csv      the same rows in a CSV file, `make_csv_dataset(num_epochs=1,
           shuffle=False)` (size unknown to TF)

Paths, in one process, interleaved, each timed `--repeats` times after one
untimed evaluate that traces: `keras_local` (a model built outside any
strategy: Keras's own evaluate) and `psclient` (the same weights in a model
built in the scope of a psclient strategy on LocalCluster(2 workers, 1 ps)).

Prints one JSON object: per case and path the median wall seconds and CPU
seconds of one evaluate (for psclient the cluster's task processes too),
psclient / keras_local ratios, and whether both gave the same loss and
accuracy (relative 1e-5). `--psclient PATH` imports psclient from another
checkout (to time an older commit in the same run conditions).

    python benchmarks/keras_eval_small.py [--rows 300] [--repeats 7] [--out results.json]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.dirname(_HERE)]  # _common, and the psclient of this checkout
import _common  # noqa: E402

NUM_WORKERS, NUM_PS = 2, 1
NUMERIC = [f"n{i}" for i in range(6)]
CATEGORIES = [f"c{i}" for i in range(7)]
BATCH = 32
PATHS = ("keras_local", "psclient")


def make_data(rows: int):
    import numpy as np

    rng = np.random.default_rng(0)
    features = {name: rng.standard_normal(rows).astype("float32") for name in NUMERIC}
    features.update({name: rng.integers(0, 10, rows).astype("int32") for name in CATEGORIES})
    labels = rng.integers(0, 2, rows).astype("int32")
    return features, labels


def write_csv(path: str, features: dict, labels) -> None:
    # Columns in sorted order: make_csv_dataset yields an OrderedDict in the file's order, and
    # Keras 3.15's functional model flattens an OrderedDict in that order but its dict of inputs
    # sorted, so in another order it feeds columns to the wrong inputs (in one process too).
    names = sorted([*NUMERIC, *CATEGORIES])
    with open(path, "w") as f:
        f.write(",".join([*names, "label"]) + "\n")
        for row in range(len(labels)):
            f.write(",".join(
                f"{features[name][row]:.6f}" if name in NUMERIC else str(features[name][row]) for name in names
            ) + f",{labels[row]}\n")


def build_model():
    import keras

    inputs = {name: keras.Input((), name=name) for name in NUMERIC}
    inputs.update({name: keras.Input((), name=name, dtype="int32") for name in CATEGORIES})
    parts = [keras.ops.expand_dims(inputs[name], -1) for name in NUMERIC]
    parts += [keras.layers.Embedding(10, 4)(inputs[name]) for name in CATEGORIES]
    hidden = keras.layers.Dense(32, activation="relu")(keras.layers.Concatenate()(parts))
    outputs = keras.layers.Dense(1, activation="sigmoid")(keras.layers.Dropout(0.5)(hidden))
    model = keras.Model(inputs, outputs)
    model.compile(optimizer="adam", loss="binary_crossentropy", metrics=["accuracy"])
    return model


def cases(csv_path: str, features: dict, labels) -> dict:
    import tensorflow as tf

    def dataset():
        return {"x": tf.data.Dataset.from_tensor_slices((features, labels)).batch(BATCH)}

    def csv():
        return {"x": tf.data.experimental.make_csv_dataset(
            csv_path, batch_size=BATCH, label_name="label", num_epochs=1, shuffle=False,
            column_defaults=[tf.int32] * len(CATEGORIES) + [tf.float32] * len(NUMERIC) + [tf.int32])}

    return {"dataset": dataset, "arrays": lambda: {"x": features, "y": labels, "batch_size": BATCH}, "csv": csv}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=300, help="rows of data (default 300)")
    parser.add_argument("--repeats", type=int, default=7, help="timed evaluates per case and path (default 7)")
    parser.add_argument("--psclient", help="import psclient from this checkout instead of this one")
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args(argv)
    for name in ("rows", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1 (got {getattr(args, name)})")
    _common.use_psclient_from(args.psclient)
    import numpy as np

    import psclient

    config = {**_common.environment(sys.argv), "psclient_path": os.path.dirname(os.path.dirname(psclient.__file__)),
              "num_workers": NUM_WORKERS, "num_ps": NUM_PS, "rows": args.rows, "batch_size": BATCH,
              "repeats": args.repeats, "load_average": [round(v, 2) for v in os.getloadavg()]}
    times: dict = {}
    cpu_times: dict = {}
    results: dict = {}
    with tempfile.TemporaryDirectory() as directory:
        features, labels = make_data(args.rows)
        csv_path = os.path.join(directory, "data.csv")
        write_csv(csv_path, features, labels)
        data = cases(csv_path, features, labels)
        with _common.keras_side_by_side(build_model, NUM_WORKERS, NUM_PS) as (models, pids):
            for case, make in data.items():
                for path_name, model in models.items():
                    results[(case, path_name)] = model.evaluate(**make(), verbose=0, return_dict=True)
                for _ in range(args.repeats):
                    for path_name, model in models.items():
                        start, cpu = time.perf_counter(), _common.cpu_seconds(pids[path_name])
                        results[(case, path_name)] = model.evaluate(**make(), verbose=0, return_dict=True)
                        times.setdefault((case, path_name), []).append(time.perf_counter() - start)
                        cpu_times.setdefault((case, path_name), []).append(
                            _common.cpu_seconds(pids[path_name]) - cpu)
                _common.log(f"{case}: " + ", ".join(
                    f"{p} {_common.median(times[(case, p)]):.3f} s" for p in PATHS))
    summary = {}
    for case in data:
        seconds = {p: round(_common.median(times[(case, p)]), 3) for p in PATHS}
        cpu = {p: round(_common.median(cpu_times[(case, p)]), 3) for p in PATHS}
        want, got = results[(case, "keras_local")], results[(case, "psclient")]
        summary[case] = {
            "seconds": seconds,
            "all_seconds": {p: [round(t, 3) for t in times[(case, p)]] for p in PATHS},
            "cpu_seconds": cpu,
            "psclient_over_keras_local": round(seconds["psclient"] / seconds["keras_local"], 2),
            "cpu_psclient_over_keras_local": round(cpu["psclient"] / max(cpu["keras_local"], 1e-3), 2),
            "same_results": set(got) == set(want) and all(
                bool(np.isclose(got[k], want[k], rtol=1e-5, atol=1e-6)) for k in want),
        }
    _common.print_json({"config": config, "cases": summary}, also_to=args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
