"""What keeping order costs a parallel map: `deterministic=False` against the rewrite psclient makes.

`fit` on finite data of unknown size makes every parallel op that may yield
out of order keep the data's order (`psclient._tf.data.make_deterministic`).
This times one pass over a pipeline in one process, as a worker reads it,
three ways: as written with `deterministic=False`, after psclient's rewrite
(`deterministic=True`), and, for scale, with no parallelism. Elements take
uneven times (a matrix product of a size that varies from element to element,
`--spread` times between the cheapest and the dearest): the case where order
costs most, since a finished element waits for a slower one before it.

Prints one JSON object: median seconds of one pass per way (`--repeats`
passes each, interleaved) and their ratios.

    python benchmarks/deterministic_map.py [--elements 2000] [--parallel 4] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.dirname(_HERE)]
import _common  # noqa: E402


def pipelines(elements: int, parallel: int, spread: int) -> dict:
    import tensorflow as tf

    from psclient._tf.data import deserialize_dataset, make_deterministic, serialize_dataset

    def work(i):
        # Sizes 16..16*sqrt(spread), scattered: every few elements one is far dearer.
        size = 16 + tf.cast(tf.math.floormod(i * 7919, 97), tf.int32) * (int(16 * spread ** 0.5) - 16) // 96
        m = tf.random.stateless_uniform([size, size], seed=[1, 2])
        return tf.reduce_sum(tf.linalg.matmul(m, m))

    source = tf.data.Dataset.range(elements)
    sloppy = source.map(work, num_parallel_calls=parallel, deterministic=False).batch(32)
    graph, changed = make_deterministic(serialize_dataset(sloppy).numpy())
    assert changed, "the rewrite changed nothing"
    ordered = deserialize_dataset(tf.constant(graph), sloppy.element_spec)
    return {"deterministic_false": sloppy, "made_deterministic": ordered, "sequential": source.map(work).batch(32)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--elements", type=int, default=2000)
    parser.add_argument("--parallel", type=int, default=4, help="num_parallel_calls (default 4)")
    parser.add_argument("--spread", type=int, default=64, help="dearest / cheapest element (default 64)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args(argv)
    for name in ("elements", "parallel", "spread", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1 (got {getattr(args, name)})")
    ways = pipelines(args.elements, args.parallel, args.spread)
    times: dict = {name: [] for name in ways}
    for dataset in ways.values():  # warm-up
        for _ in dataset:
            pass
    for _ in range(args.repeats):
        for name, dataset in ways.items():
            start = time.perf_counter()
            for _ in dataset:
                pass
            times[name].append(time.perf_counter() - start)
    seconds = {name: round(_common.median(values), 3) for name, values in times.items()}
    config = {**_common.environment(sys.argv), "elements": args.elements, "parallel": args.parallel,
              "spread": args.spread, "repeats": args.repeats,
              "load_average": [round(v, 2) for v in os.getloadavg()]}
    _common.print_json({"config": config, "seconds": seconds,
                        "all_seconds": {n: [round(t, 3) for t in v] for n, v in times.items()},
                        "made_deterministic_over_false": round(
                            seconds["made_deterministic"] / seconds["deterministic_false"], 2),
                        "sequential_over_false": round(seconds["sequential"] / seconds["deterministic_false"], 2)},
                       also_to=args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
