"""Checkpoints of many embedding tables: the pause of each save and the time of each restore.

A click model of `--tables` features (dynamic_many_tables.py's: one embedding layer per feature,
Dense(32, relu), Dense(1), Adagrad), fitted a few steps on LocalCluster(num_workers=1, num_ps=2),
then `--saves` calls of `strategy.save_checkpoint()` and `--restores` calls of `strategy.restore()`
in a row, for two kinds of table side by side on the same cluster:

  dynamic   N DynamicEmbedding(dim, capacity=rows)
  hashing   N Hashing(num_bins=rows) + Embedding(rows, dim) (the hashing trick: plain variables)

Printed per kind: for each save, how long dispatch was paused (`stall_s`: the cut, in which each
ps takes its snapshot) and the call's time; for each restore, its time. The first of each is apart
(`first_*`): a process traces each table shard's save when its optimizer slots are made, and its
restore at the first restore. Then the ratio dynamic / hashing of the later saves' median pause.

    python benchmarks/table_checkpoint.py                       # 26 tables
    python benchmarks/table_checkpoint.py --tables 4 --saves 3 --restores 2

Prints one JSON object (progress on stderr).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import environment, log, median, print_json  # noqa: E402
from dynamic_many_tables import build  # noqa: E402

KINDS = ("dynamic", "hashing")


def one_kind(keras, psclient, cluster, kind: str, args) -> dict:
    with tempfile.TemporaryDirectory() as directory:
        strategy = psclient.ParameterServerStrategy(cluster, checkpoint_dir=directory)
        try:
            with strategy.scope():
                model = build(keras, kind, args.tables, args.rows, args.dim)
            rng = np.random.default_rng(0)
            x = rng.integers(0, 10 * args.rows, (args.steps * 64, args.tables))
            y = rng.integers(0, 2, (args.steps * 64, 1)).astype("float32")
            started = time.perf_counter()
            model.fit(x, y, epochs=1, batch_size=64, verbose=0)
            fit_s = time.perf_counter() - started
            saves, restores = [], []
            for _ in range(args.saves):
                started = time.perf_counter()
                strategy.save_checkpoint()
                call_s = time.perf_counter() - started
                stall = strategy.stats(read_ps=False)["checkpoints"]["last_stall_seconds"]
                saves.append({"stall_s": round(stall, 4), "call_s": round(call_s, 3)})
            for _ in range(args.restores):
                started = time.perf_counter()
                strategy.restore()
                restores.append(round(time.perf_counter() - started, 3))
        finally:
            strategy.shutdown()
    later = saves[1:] or saves
    return {
        "fit_s": round(fit_s, 2), "saves": saves, "restores_s": restores,
        "first_save_stall_s": saves[0]["stall_s"],
        "median_later_save_stall_s": median([s["stall_s"] for s in later]),
        "first_restore_s": restores[0] if restores else None,
        "median_later_restore_s": median(restores[1:] or restores) if restores else None,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tables", type=int, default=26)
    parser.add_argument("--rows", type=int, default=2000, help="capacity (or hashing bins) per table")
    parser.add_argument("--dim", type=int, default=8)
    parser.add_argument("--steps", type=int, default=16, help="fit steps before the checkpoints")
    parser.add_argument("--saves", type=int, default=4)
    parser.add_argument("--restores", type=int, default=3)
    parser.add_argument("--paths", default=",".join(KINDS))
    args = parser.parse_args(argv)
    kinds = [k for k in args.paths.split(",") if k]
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown or args.saves < 1 or args.tables < 1:
        parser.error(f"--paths takes {', '.join(KINDS)} (received {unknown}); --saves and --tables >= 1")

    import keras

    import psclient

    output = {"benchmark": "table_checkpoint", "config": vars(args), "environment": environment(sys.argv),
              "results": {}}
    with psclient.LocalCluster(num_workers=1, num_ps=2) as local:
        for kind in kinds:
            log(f"{kind}: {args.tables} tables")
            result = output["results"][kind] = one_kind(keras, psclient, local.cluster, kind, args)
            log(f"{kind}: save pause first {result['first_save_stall_s']:.3f} s, later "
                f"{result['median_later_save_stall_s']:.3f} s; restore first {result['first_restore_s']} s, "
                f"later {result['median_later_restore_s']} s")
    results = output["results"]
    if "dynamic" in results and "hashing" in results and results["hashing"]["median_later_save_stall_s"]:
        output["dynamic/hashing median_later_save_stall_s"] = round(
            results["dynamic"]["median_later_save_stall_s"] / results["hashing"]["median_later_save_stall_s"], 2)
    print_json(output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
