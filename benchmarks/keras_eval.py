"""Keras `model.evaluate` on a CSV file: psclient on a LocalCluster against Keras in one process.

The data is a seeded CSV file written to a temporary directory (`--rows` rows,
7 float feature columns and a 0/1 label), read with
`tf.data.experimental.make_csv_dataset` (one pass, no shuffle, batches of
`--batch-size`): a file-backed dataset of unknown size, whose every batch costs
file reading and parsing. The model takes the 7 columns as named inputs
(concatenated, Dense 32 relu, Dense 1 sigmoid), compiled with binary
cross-entropy and accuracy. The same data as NumPy arrays is a second case.

Paths, in one process (interleaved, each timed `--repeats` times after one
untimed evaluate that traces):

  keras_local   a model built outside any strategy: Keras's own evaluate
  psclient      the same weights in a model built in the scope of a
                psclient strategy on LocalCluster(2 workers, 1 ps):
                psclient's evaluate on the cluster

Prints one JSON object: per case and path the median seconds of one
evaluate and the median CPU seconds it used (this process; for psclient also
the cluster's task processes), psclient / keras_local ratios of both, and
whether both paths gave the same loss and accuracy (relative 1e-5). On a
shared machine the seconds move with the load (the load average is in
`config`); the CPU seconds move less.

    python benchmarks/keras_eval.py [--rows 20000] [--batch-size 64] [--repeats 5] [--out results.json]
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
COLUMNS = [f"f{i}" for i in range(7)]
PATHS = ("keras_local", "psclient")


def write_csv(path: str, rows: int):
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.standard_normal((rows, len(COLUMNS))).astype("float32")
    y = (x @ rng.standard_normal(len(COLUMNS)) > 0).astype("int32")
    with open(path, "w") as f:
        f.write(",".join([*COLUMNS, "label"]) + "\n")
        for features, label in zip(x, y):
            f.write(",".join(f"{v:.6f}" for v in features) + f",{label}\n")
    return x, y


def build_model():
    import keras

    inputs = {name: keras.Input((), name=name) for name in COLUMNS}
    stacked = keras.layers.Concatenate()([keras.ops.expand_dims(inputs[name], -1) for name in COLUMNS])
    hidden = keras.layers.Dense(32, activation="relu")(stacked)
    model = keras.Model(inputs, keras.layers.Dense(1, activation="sigmoid")(hidden))
    model.compile(loss="binary_crossentropy", metrics=["accuracy"])
    return model


def cases(path: str, x, y, batch_size: int) -> dict:
    """Case name -> function returning evaluate's data arguments, made anew for every call."""
    import tensorflow as tf

    def csv():
        data = tf.data.experimental.make_csv_dataset(
            path, batch_size=batch_size, label_name="label", num_epochs=1, shuffle=False,
        )
        return {"x": data}

    arrays = {name: x[:, i] for i, name in enumerate(COLUMNS)}
    return {"csv": csv, "arrays": lambda: {"x": arrays, "y": y, "batch_size": batch_size}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=20000, help="rows of the CSV file (default 20000)")
    parser.add_argument("--batch-size", type=int, default=64, help="batch size (default 64)")
    parser.add_argument("--repeats", type=int, default=5, help="timed evaluates per case and path (default 5)")
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args(argv)
    for name in ("rows", "batch_size", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1 (got {getattr(args, name)})")
    import numpy as np

    config = {**_common.environment(sys.argv), "num_workers": NUM_WORKERS, "num_ps": NUM_PS,
              "rows": args.rows, "batch_size": args.batch_size, "repeats": args.repeats,
              "load_average": [round(v, 2) for v in os.getloadavg()]}
    times: dict = {}
    cpu_times: dict = {}
    results: dict = {}
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "data.csv")
        x, y = write_csv(path, args.rows)
        data = cases(path, x, y, args.batch_size)
        # CPU of the processes each path uses: this one, and for psclient the tasks too.
        with _common.keras_side_by_side(build_model, NUM_WORKERS, NUM_PS) as (models, pids):
            for case, make in data.items():
                for path_name, model in models.items():
                    _common.log(f"{case} {path_name}: warm-up evaluate")
                    results[(case, path_name)] = model.evaluate(**make(), verbose=0, return_dict=True)
                for _ in range(args.repeats):
                    for path_name, model in models.items():
                        start, cpu = time.perf_counter(), _common.cpu_seconds(pids[path_name])
                        got = model.evaluate(**make(), verbose=0, return_dict=True)
                        times.setdefault((case, path_name), []).append(time.perf_counter() - start)
                        cpu_times.setdefault((case, path_name), []).append(
                            _common.cpu_seconds(pids[path_name]) - cpu)
                        results[(case, path_name)] = got
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
            "cpu_psclient_over_keras_local": round(cpu["psclient"] / cpu["keras_local"], 2),
            "same_results": set(got) == set(want) and all(
                bool(np.isclose(got[k], want[k], rtol=1e-5, atol=1e-6)) for k in want),
            "keras_local_results": want,
        }
    _common.print_json({"config": config, "cases": summary}, also_to=args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
