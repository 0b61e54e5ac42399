"""What each way out of the cluster costs: SavedModel exports, the .keras file, a strategy checkpoint.

One coordinator (this process) on a LocalCluster(num_workers=1, num_ps=2). Model: a partitioned
Embedding(rows, 32) and a DynamicEmbedding(32, capacity=dynamic_rows) -> Dense(1), Adagrad; a few fit
steps (so the optimizer's slots exist), then the dynamic table is filled with `dynamic_rows` rows
through `import_state` (setup, not measured). Then, in turn, each path `--calls` times (2 by default; the first traces):

  export            model.export(path)                 Keras's SavedModel (what export_servable writes)
  saved_model_save  tf.saved_model.save(model, path)
  keras_file        model.save("m.keras")             needs psclient to load (DynamicEmbedding)
  checkpoint        strategy.save_checkpoint()         each ps writes its own part (training state too)

Per path and call: seconds, the bytes written, each ps task's peak resident memory and its growth
during the call (VmHWM of the task process, reset before the call), and the coordinator's resident
memory growth at its peak during the call (the kernel's exact peak, VmHWM, reset before the call; sampled every 10 ms with
psutil where there is no /proc/self/clear_refs; memory freed before the call is first handed back to the
OS with glibc's `malloc_trim`, else a second call reuses it unseen) over the bytes written; `traces`: how
many times the call traced the model (calls of the model's `Dense` layer's `call`, which only a trace
makes: the model is never run eagerly here); `load`: the machine's 1-minute load average before the call.

    nice -n 10 python benchmarks/serving_export.py                         # 1M rows + 200k dynamic rows
    nice -n 10 python benchmarks/serving_export.py --rows 4000000 --dynamic-rows 1000000
    nice -n 10 python benchmarks/serving_export.py --paths export,checkpoint --calls 5 --interleave

Prints one JSON object (progress on stderr). Noisy machine: compare the paths within one run.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import gc
import os
import shutil
import sys
import tempfile
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import environment, log, print_json  # noqa: E402

DIM = 32


class PeakRSS:
    """The process's resident memory at its peak while the block runs: exact on Linux (the kernel's peak,
    VmHWM, reset to the present through /proc/self/clear_refs), else sampled by a thread every `interval`."""

    def __init__(self, interval=0.01):
        import psutil

        self.process, self.interval, self.peak = psutil.Process(), interval, 0
        self.exact = os.path.exists("/proc/self/clear_refs")
        self._stop = threading.Event()

    @staticmethod
    def _status_bytes(field: str) -> int:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith(field + ":")) * 1024

    def _sample(self):
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, self.process.memory_info().rss)

    def __enter__(self):
        if self.exact:
            with open("/proc/self/clear_refs", "w") as clear_refs:
                clear_refs.write("5")  # VmHWM := VmRSS
        self.before = self.peak = self.process.memory_info().rss
        if not self.exact:
            self._thread = threading.Thread(target=self._sample, name="rss-sampler", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        if self.exact:
            self.peak = self._status_bytes("VmHWM")
        else:
            self._stop.set()
            self._thread.join()
        self.peak = max(self.peak, self.process.memory_info().rss)

    @property
    def growth(self) -> int:
        return self.peak - self.before


class TaskPeaks:
    """Each task process's resident memory at its peak while the block runs (the kernel's VmHWM of
    `/proc/<pid>`, reset through its clear_refs; Linux only, else None)."""

    def __init__(self, pids: list[int]):
        self.pids = pids
        self.exact = all(os.path.exists(f"/proc/{pid}/clear_refs") for pid in pids)

    @staticmethod
    def _status_mb(pid: int, field: str) -> float:
        with open(f"/proc/{pid}/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith(field + ":")) / 1024

    def __enter__(self):
        if self.exact:
            for pid in self.pids:
                try:
                    with open(f"/proc/{pid}/clear_refs", "w") as clear_refs:
                        clear_refs.write("5")
                except PermissionError:  # not ours to reset (not root): no exact peak
                    self.exact = False
        self.before = [self._status_mb(pid, "VmRSS") for pid in self.pids] if self.exact else None
        return self

    def __exit__(self, *exc):
        self.peak = [self._status_mb(pid, "VmHWM") for pid in self.pids] if self.exact else None

    def report(self) -> dict:
        if not self.exact:
            return {"ps_peak_mb": None, "ps_rss_growth_mb": None}
        return {"ps_peak_mb": [round(p, 1) for p in self.peak],
                "ps_rss_growth_mb": [round(p - b, 1) for p, b in zip(self.peak, self.before)]}


def release_freed_memory() -> None:
    """Hand the memory freed so far back to the OS (glibc's `malloc_trim`), so that a call's growth is
    measured from what the process really holds: memory freed by an earlier call and kept by the
    allocator would otherwise be reused unseen (a second export then seemed to grow by 0 MB)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: growth may be understated after the first call
        pass


def tree_bytes(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def trace_counter(layer_class) -> dict:
    """Count the calls of `layer_class.call` from now on (in this benchmark, one per trace of the model)."""
    counter, stock = {"calls": 0}, layer_class.call

    @functools.wraps(stock)  # Keras reads `call`'s signature
    def call(self, *args, **kwargs):
        counter["calls"] += 1
        return stock(self, *args, **kwargs)

    layer_class.call = call
    return counter


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000, help="rows of the partitioned Embedding")
    parser.add_argument("--dynamic-rows", type=int, default=200_000, help="rows held by the DynamicEmbedding")
    parser.add_argument("--paths", default="export,saved_model_save,keras_file,checkpoint",
                        help="comma-separated paths to measure, in this order")
    parser.add_argument("--calls", type=int, default=2, help="calls of each path (the first traces)")
    parser.add_argument("--interleave", action="store_true",
                        help="call the paths in turn (export, checkpoint, export, ...) rather than each path's "
                             "calls in a row: on a shared machine both see the same load")
    args = parser.parse_args(argv)

    import keras
    import tensorflow as tf

    import psclient
    from psclient.layers import DynamicEmbedding

    work = tempfile.mkdtemp(prefix="psclient-serving-bench-")
    result = {"config": {**environment(sys.argv), "rows": args.rows, "dynamic_rows": args.dynamic_rows, "dim": DIM},
              "weights_mb": round((args.rows + args.dynamic_rows) * DIM * 4 / 2**20, 1)}
    try:
        with psclient.LocalCluster(num_workers=1, num_ps=2, start_method="spawn") as cluster:
            strategy = psclient.ParameterServerStrategy(
                cluster.cluster, checkpoint_dir=os.path.join(work, "checkpoints"),
                variable_partitioner=tf.distribute.experimental.partitioners.FixedShardsPartitioner(2))
            with strategy.scope():
                ids = keras.Input((2,), dtype="int64")
                dynamic = DynamicEmbedding(DIM, capacity=args.dynamic_rows + 1024, name="dynamic")
                embedded = keras.layers.Concatenate()([
                    keras.layers.Flatten()(keras.layers.Embedding(args.rows, DIM)(ids)),
                    keras.layers.Flatten()(dynamic(ids))])
                model = keras.Model(ids, keras.layers.Dense(1)(embedded))
                model.compile(optimizer=keras.optimizers.Adagrad(0.05), loss="mse")
            rng = np.random.default_rng(0)
            x = rng.integers(0, min(args.rows, 10_000), (512, 2))
            model.fit(x, rng.standard_normal((512, 1)).astype("float32"), batch_size=64, epochs=1, verbose=0)
            log("filling the dynamic table")
            keys = np.arange(10_000, 10_000 + args.dynamic_rows, dtype="int64")
            dynamic.import_state([{"keys": keys, "counters": np.stack([np.ones_like(keys), np.zeros_like(keys)], 1),
                                   "row_keys": keys, "rows": rng.standard_normal((len(keys), DIM)).astype("float32"),
                                   "slots": {}, "clock": 1, "admissions": len(keys), "evictions": 0}])
            del keys
            ps_pids = [cluster.pid("ps", i) for i in range(2)]
            traces = trace_counter(keras.layers.Dense)
            paths = {
                "export": lambda out: model.export(out, verbose=False),
                "saved_model_save": lambda out: tf.saved_model.save(model, out),
                "keras_file": lambda out: model.save(out + ".keras"),
                "checkpoint": lambda out: strategy.save_checkpoint(),
            }
            names = args.paths.split(",")
            order = ([(name, call) for call in range(args.calls) for name in names] if args.interleave
                     else [(name, call) for name in names for call in range(args.calls)])
            for name in names:
                result[name] = []
            for name, call in order:
                out = os.path.join(work, f"{name}_{call}")
                release_freed_memory()
                log(f"{name} #{call + 1}")
                load, traced = os.getloadavg()[0], traces["calls"]
                start = time.perf_counter()
                with PeakRSS() as rss, TaskPeaks(ps_pids) as ps_peaks:
                    written = paths[name](out)
                seconds = time.perf_counter() - start
                if name == "checkpoint":  # a prefix or a directory: its files
                    size = tree_bytes(written) if os.path.isdir(written) else sum(
                        os.path.getsize(os.path.join(os.path.dirname(written), f))
                        for f in os.listdir(os.path.dirname(written)) if f.startswith(os.path.basename(written)))
                else:
                    size = tree_bytes(out + ".keras" if name == "keras_file" else out)
                result[name].append({"seconds": round(seconds, 2), "bytes_mb": round(size / 2**20, 1),
                                     "coordinator_rss_growth_mb": round(rss.growth / 2**20, 1),
                                     "rss_growth_over_bytes": round(rss.growth / max(size, 1), 3),
                                     **ps_peaks.report(), "traces": traces["calls"] - traced,
                                     "load": round(load, 2)})
            strategy.shutdown()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print_json(result)


if __name__ == "__main__":
    main()
