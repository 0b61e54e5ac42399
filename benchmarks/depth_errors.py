"""Calls beside a function's error, at each pipeline depth: lost, or applied though they failed.

Each round schedules one call that fails (an assertion in the function) and
joins it, then schedules `--calls` calls of the same function that succeed,
each adding 1.0 to a ps variable, and joins them (no call's result fetched).
Two forms of the function:

  guarded    the addition runs under `tf.control_dependencies([assertion])`
  unguarded  the assertion and the addition one after the other, unordered:
             as in TF without a cluster, where the failing call's addition
             of -1.0 runs although its assertion failed (the call raises)

The variable, read at the end of each round, tells whether the round added
as many as its successful calls, or one less (with the unguarded form: the
failing call's own -1.0; with the guarded one it would be a call lost), or
anything else. Counted at the given depths; `--no-error` adds rounds without
the failing call. Prints JSON.

    python benchmarks/depth_errors.py --rounds 600 --depths 2,1
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import tensorflow as tf

import psclient
from psclient._cluster.local import LocalCluster

FORMS = ("guarded", "unguarded")


def function_of(form: str, total):
    @tf.function
    def checked(x):
        check = tf.debugging.assert_positive(x, message="x must be positive")
        with tf.control_dependencies([check] if form == "guarded" else []):
            total.assign_add(x)

    return checked


def measure(cluster, depth: int, form: str, rounds: int, calls: int, with_error: bool) -> dict:
    strategy = psclient.ParameterServerStrategy(cluster.cluster, pipeline_depth=depth)
    try:
        with strategy.scope():
            total = tf.Variable(0.0)
        checked = function_of(form, total)
        one_less, other, failed_futures, timeouts = [], [], 0, 0
        began = 0.0  # the variable at the start of the round
        started = time.monotonic()
        for round_ in range(rounds):
            if with_error:
                strategy.schedule(checked, args=(tf.constant(-1.0),))
                try:
                    strategy.join(timeout=120)
                except tf.errors.InvalidArgumentError:
                    pass
            futures = [strategy.schedule(checked, args=(tf.constant(1.0),)) for _ in range(calls)]
            try:
                strategy.join(timeout=120)
            except TimeoutError:
                timeouts += 1
                break
            failed_futures += sum(f.exception(timeout=0) is not None for f in futures)
            succeeded = sum(f.exception(timeout=0) is None for f in futures)
            ended = float(total.numpy())
            added = ended - began - succeeded
            if with_error and added == -1.0:
                one_less.append(round_)
            elif added != 0.0:
                other.append({"round": round_, "added_beyond_the_calls": added})
            began = ended
        return {"pipeline_depth": depth, "form": form, "failing_call_each_round": with_error,
                "rounds": round_ + 1, "calls_per_round": calls,
                "rounds_one_less": len(one_less), "which": one_less[:50],
                "rounds_otherwise_off": other[:50], "futures_failed": failed_futures,
                "joins_timed_out": timeouts, "seconds": round(time.monotonic() - started, 1)}
    finally:
        strategy.shutdown()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=600)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--depths", default="1,2", help="comma-separated pipeline depths")
    parser.add_argument("--forms", default=",".join(FORMS), help="comma-separated: guarded, unguarded")
    parser.add_argument("--no-error", action="store_true", help="also run each depth without the failing call")
    args = parser.parse_args(argv)
    forms = args.forms.split(",")
    unknown = sorted(set(forms) - set(FORMS))
    if unknown:
        parser.error(f"--forms: received {','.join(unknown)}; expected a comma-separated choice of {', '.join(FORMS)}")
    results = []
    for depth in [int(d) for d in args.depths.split(",")]:
        for form in forms:
            for with_error in ([True, False] if args.no_error else [True]):
                # A cluster of its own each time: TF keeps one connection per process and its streams.
                with LocalCluster(num_workers=2, num_ps=1, start_timeout=300) as cluster:
                    results.append(measure(cluster, depth, form, args.rounds, args.calls, with_error))
                print(json.dumps(results[-1]), file=sys.stderr, flush=True)
    print(json.dumps({"benchmark": "depth_errors", "tensorflow": tf.__version__, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
