"""The pause of a checkpoint that finds a big variable scattered before the previous one, not since.

One `tf.Variable([rows, 32])` on one ps (1 worker), a few rows scattered by
some saves' steps and not by others', in this order: scattered, scattered,
not since, not since, scattered, not since. A save after scattering copies
the variable before its cut (`fuzzy_copy`); one after none reads it in the
cut, which in TF's copy-on-read mode (set by the scatters) copied it whole
in the pause, before psclient turned the mode off for such a variable. Per
save: the pause (`last_stall_seconds`), the snapshot's part of it, the bytes
copied before the cut. Prints JSON.

    python benchmarks/quiet_checkpoint.py --rows 8000000      # 1 GB
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import environment, log, median, print_json  # noqa: E402

ORDER = ("scattered", "scattered", "not since", "not since", "scattered", "not since")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=8_000_000, help="rows of the 32-wide float variable")
    parser.add_argument("--output", help="also write the JSON here")
    args = parser.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    import psclient

    saves = []
    with psclient.LocalCluster(num_workers=1, num_ps=1) as local, tempfile.TemporaryDirectory() as directory:
        strategy = psclient.ParameterServerStrategy(local.cluster, checkpoint_dir=directory,
                                                    variable_partitioner=None)
        try:
            with strategy.scope():
                big = tf.Variable(tf.zeros([args.rows, 32]))

            @tf.function
            def step():
                big.scatter_add(tf.IndexedSlices(tf.ones([64, 32]), tf.range(64, dtype=tf.int64)))

            for case in ORDER:
                if case == "scattered":
                    for _ in range(5):
                        strategy.schedule(step)
                    strategy.join()
                strategy.save_checkpoint()
                cost = strategy.stats(read_ps=False)["checkpoints"]
                saves.append({"case": case, "stall_s": round(cost["last_stall_seconds"], 4),
                              "snapshot_s": round(cost["last_snapshot_seconds"], 4),
                              "copied_mb": round((cost["last_copied_bytes"] or 0) / 2**20, 1)})
                log(f"{case}: paused {saves[-1]['stall_s']} s")
        finally:
            strategy.shutdown()
    later = saves[1:]  # the first save also makes the cut's function on the ps
    print_json({"benchmark": "quiet_checkpoint", "config": {**environment(sys.argv), **vars(args)},
                "variable_mb": round(args.rows * 32 * 4 / 2**20, 1), "saves": saves,
                "median_stall_s": {case: median([s["stall_s"] for s in later if s["case"] == case])
                                   for case in ("scattered", "not since")}}, also_to=args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
