"""What Prometheus scrapes cost a Keras `fit`: steps/s with and without a scrape every second.

One LocalCluster (2 workers, 1 ps) and one strategy with `metrics_port=0`;
the model is keras_fit.py's MLP (784-512-512-10, batch 128, Adam(1e-4),
steps_per_execution 1). Each round fits `--steps` steps twice, once while a
thread of this process reads `/metrics` every `--interval` seconds (what a
Prometheus does) and once without, in alternating order; the summary is the
median of the per-round ratios (scraped / not scraped), so the machine's
drift between rounds cancels out. Also printed: how long one scrape takes
and how big it is.

Usage:
  python benchmarks/metrics_cost.py [--steps 300] [--rounds 5] [--interval 1.0]

Prints one JSON object (progress on stderr) and saves it under
benchmarks/results/metrics_cost-<date>.json.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
import urllib.request

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.dirname(_HERE)]  # _common, and the psclient of this checkout
import _common  # noqa: E402

UNITS, BATCH = (784, 512, 512, 10), 128


class Scraper:
    """Reads /metrics every `interval` seconds on its own thread until stopped."""

    def __init__(self, port: int, interval: float):
        self.url, self.interval = f"http://127.0.0.1:{port}/metrics", interval
        self.seconds: list[float] = []
        self.bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-scraper")

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.perf_counter()
            with urllib.request.urlopen(self.url, timeout=30) as response:
                self.bytes = len(response.read())
            self.seconds.append(time.perf_counter() - started)
            self._stop.wait(self.interval)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(60)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--interval", type=float, default=1.0)
    args = parser.parse_args()

    import keras
    import numpy as np

    import psclient

    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH, UNITS[0])).astype("float32")
    y = rng.integers(0, UNITS[-1], size=(BATCH,))
    rows = []
    with _common.local_cluster(2, 1) as (cluster, _pids):
        strategy = psclient.ParameterServerStrategy(cluster, metrics_port=0)
        try:
            import tensorflow as tf

            data = tf.data.Dataset.from_tensors((x, y)).repeat()
            with strategy.scope():
                model = keras.Sequential([keras.Input((UNITS[0],))] + [
                    keras.layers.Dense(u, activation="relu") for u in UNITS[1:-1]] + [keras.layers.Dense(UNITS[-1])])
                model.compile(optimizer=keras.optimizers.Adam(1e-4),
                              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
            model.fit(data, epochs=1, steps_per_epoch=40, verbose=0)  # tracing, excluded

            def timed() -> float:
                started = time.perf_counter()
                model.fit(data, epochs=1, steps_per_epoch=args.steps, verbose=0)
                return args.steps / (time.perf_counter() - started)

            scrape_seconds: list[float] = []
            scrape_bytes = 0
            for round_ in range(args.rounds):
                order = ("scraped", "plain") if round_ % 2 == 0 else ("plain", "scraped")
                row = {"round": round_}
                for kind in order:
                    if kind == "scraped":
                        with Scraper(strategy.metrics_port, args.interval) as scraper:
                            row[kind] = timed()
                        scrape_seconds += scraper.seconds
                        scrape_bytes = scraper.bytes
                    else:
                        row[kind] = timed()
                row["ratio"] = row["scraped"] / row["plain"]
                _common.log(f"round {round_}: plain {row['plain']:.1f} steps/s, scraped {row['scraped']:.1f}, "
                            f"ratio {row['ratio']:.3f}")
                rows.append(row)
        finally:
            strategy.shutdown()
    result = {
        "benchmark": "metrics_cost",
        "environment": _common.environment(sys.argv),
        "config": vars(args),
        "rounds": rows,
        "steps_per_s_plain_median": _common.median([r["plain"] for r in rows]),
        "steps_per_s_scraped_median": _common.median([r["scraped"] for r in rows]),
        "ratio_median": _common.median([r["ratio"] for r in rows]),
        "scrape_seconds_median": _common.median(scrape_seconds),
        "scrape_bytes": scrape_bytes,
    }
    _common.print_json(result, also_to=os.path.join(
        _HERE, "results", f"metrics_cost-{time.strftime('%Y-%m-%d')}.json"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
