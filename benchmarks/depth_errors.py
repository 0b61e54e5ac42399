"""Calls lost beside a function's error above pipeline depth 1 (a measurement of a known limit).

Each round schedules one call that fails (an assertion in the function) and
joins it, then schedules `--calls` calls of the same function that succeed,
each adding 1.0 to a ps variable, and joins them. Every future resolves
without an error; the variable says whether each call's update was applied.
Counted: rounds where it was not, and calls lost, at the given depths, and
with `--no-error` the same rounds without the failing call. The calls are
scheduled right after the failing call's join (reading the variable in
between hid the loss). Prints JSON.

    python benchmarks/depth_errors.py --rounds 600 --depths 1,2
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import tensorflow as tf

import psclient
from psclient._cluster.local import LocalCluster


def measure(cluster, depth: int, rounds: int, calls: int, with_error: bool) -> dict:
    strategy = psclient.ParameterServerStrategy(cluster.cluster, pipeline_depth=depth)
    try:
        with strategy.scope():
            total = tf.Variable(0.0)

        @tf.function
        def checked(x):
            tf.debugging.assert_positive(x, message="x must be positive")
            total.assign_add(x)

        lossy_rounds, lost, failed_futures, timeouts = [], 0, 0, 0
        started = time.monotonic()
        for round_ in range(rounds):
            if with_error:
                strategy.schedule(checked, args=(tf.constant(-1.0),))
                try:
                    strategy.join(timeout=120)
                except tf.errors.InvalidArgumentError:
                    pass
            # Read only after the join: a read of the variable between the failing call's join
            # and the next calls gave the failing call time to settle, and nothing was lost then.
            futures = [strategy.schedule(checked, args=(tf.constant(1.0),)) for _ in range(calls)]
            try:
                strategy.join(timeout=120)
            except TimeoutError:
                timeouts += 1
                break
            failed_futures += sum(f.exception(timeout=0) is not None for f in futures)
            applied = int(total.numpy())
            missing = (round_ + 1) * calls - lost - applied
            if missing:
                lossy_rounds.append(round_)
                lost += missing
        return {"pipeline_depth": depth, "failing_call_each_round": with_error, "rounds": round_ + 1,
                "calls_per_round": calls, "rounds_with_lost_calls": len(lossy_rounds), "calls_lost": lost,
                "lossy_rounds": lossy_rounds, "futures_failed": failed_futures, "joins_timed_out": timeouts,
                "seconds": round(time.monotonic() - started, 1)}
    finally:
        strategy.shutdown()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=600)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--depths", default="1,2", help="comma-separated pipeline depths")
    parser.add_argument("--no-error", action="store_true", help="also run each depth without the failing call")
    args = parser.parse_args(argv)
    results = []
    for depth in [int(d) for d in args.depths.split(",")]:
        for with_error in ([True, False] if args.no_error else [True]):
            # A cluster of its own each time: TF keeps one connection per process and its streams.
            with LocalCluster(num_workers=2, num_ps=1, start_timeout=300) as cluster:
                results.append(measure(cluster, depth, args.rounds, args.calls, with_error))
            print(json.dumps(results[-1]), file=sys.stderr, flush=True)
    print(json.dumps({"benchmark": "depth_errors", "tensorflow": tf.__version__, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
