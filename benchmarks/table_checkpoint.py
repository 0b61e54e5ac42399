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
Per save also: the copy made before the cut (`copy_s`, `copied_mb`: a big table's storage copied
while training goes on, `checkpoints/table_copy`) and the rows the cut read again; and each ps's
peak resident memory during the saves over its table bytes (`ps_save_peaks`; each save's own in
`saves[i].ps_peak_over_table`, from the same memory before the first save), and each save's peak
above that memory in each of its phases (`saves[i].ps_peak_mb_by_phase`: the copy before the cut,
the pause, the write; the phases' bounds from the save's own times in `stats()`). With `--fill`, each
ps's resident memory grown by the imported rows (`ps_rss_growth_mb_from_fill`): the tables' own
bytes where `table_stats()` has none (hash storage), on `--ps-malloc`.
`--checkpoint-cut copy` saves every table packed in the cut (`StrategyConfig.checkpoint_cut`), for
the pause's dependence on the table's size; `--train-beside` saves while `model.fit` trains in
another thread (new keys admitted, rows evicted and trained during each copy; per save, the longest
time between two steps' batch ends around it, `longest_step_gap_s`); `--storage hash`
keeps the dynamic tables in hash tables (`StrategyConfig.dynamic_table_storage`), which the cut
exports whole:

    python benchmarks/table_checkpoint.py --tables 1 --rows 2000000 --dim 32 --fill 0.9 \
        --saves 4 --restores 0 --paths dynamic --train-beside --checkpoint-cut rows   # (and copy)

Each restore's peak resident memory on each ps (psutil every 5 ms, after the saves' memory was
given back): `ps_restore_peaks`, with `peak_over_table` = 1 + growth / that ps's table bytes
(`table_stats()`'s `table_bytes`: rows, slots, counters, key index; the tables are in the RSS
before). `--fill F` fills each dynamic table to F of its capacity (imported rows, after the fit)
so that a restore moves table-sized data; `--ps-malloc` starts the ps tasks with glibc's mmap
threshold at 1 MiB and oneDNN off, so that what a restore frees goes back to the system and the
next one's peak shows (TF's default CPU allocator keeps freed memory and reuses it unseen).

    python benchmarks/table_checkpoint.py --tables 1 --rows 2000000 --dim 32 --fill 0.9 \
        --saves 1 --restores 3 --paths dynamic --ps-malloc       # one big table: restore peak

    python benchmarks/table_checkpoint.py                       # 26 tables
    python benchmarks/table_checkpoint.py --tables 4 --saves 3 --restores 2

`--ps-losses N` (dynamic tables only): after the saves, ps 1 is killed and started again N times;
each time, the wall time from its restart until `stats()` counts its recovery (its variables and
table shards made again and restored: the first of them is then the process's first restore, of
that ps's shards), and the recovery's own `last_recovery_s`:

    python benchmarks/table_checkpoint.py --paths dynamic --ps-losses 2 --restores 2

`--deltas N` (dynamic tables only): incremental checkpoints on (`delta_checkpoint_every`); after
the saves, N phases of DELTA_STEPS fit steps, each on ids of its own (new keys admitted, rows and
slots trained), each write a delta of the newest full checkpoint, and every restore applies the full
checkpoint and its N deltas. A first restore, not measured, drops the deltas' base (the previous
cut's export each ps keeps for the next diff: a restore ends the chain), so that the measured
restores start from the tables alone:

    python benchmarks/table_checkpoint.py --tables 1 --rows 2000000 --dim 32 --fill 0.9 \
        --saves 1 --restores 3 --paths dynamic --ps-malloc --deltas 2   # restore peak with 2 deltas

`--restore-ps N` (dynamic tables only): the saves (and deltas) are written by 2 ps, the restores
read into N ps (the cluster then has max(2, N) ps; a new coordinator's run on its first N, the same
model restored once, not measured, so that its tables and slots are in the RSS before, then the restores):
each ps reads the saved shards and keeps the keys it owns now. `table_mb` is then that run's:

    python benchmarks/table_checkpoint.py --tables 1 --rows 2000000 --dim 32 --fill 0.9 \
        --saves 1 --restores 3 --paths dynamic --ps-malloc --restore-ps 1   # 2 ps saved, 1 restores

Prints one JSON object (progress on stderr).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import environment, log, median, print_json  # noqa: E402
from big_model_checkpoint import PeakRss, _settle  # noqa: E402
from dynamic_many_tables import build  # noqa: E402

KINDS = ("dynamic", "hashing")
#: Fit steps between two deltas (`--deltas`): the steps of one phase, and `delta_checkpoint_every`.
DELTA_STEPS = 4


def fill_tables(model, fraction: float) -> int:
    """Each DynamicEmbedding's table filled to `fraction` of its capacity with imported rows (and
    optimizer slots): returns the rows imported."""
    from psclient.layers import DynamicEmbedding

    rng, total = np.random.default_rng(1), 0
    for layer in [layer for layer in model.layers if isinstance(layer, DynamicEmbedding)]:
        table = layer.table
        n = int(table.policy.capacity * fraction)
        keys = rng.choice(2**40, n, replace=False).astype(np.int64)
        rows = rng.standard_normal((n, table.dim), dtype=np.float32)
        slots = {name: rng.random((n, table.dim), dtype=np.float32) for name in table.slot_defaults}
        layer.import_state([{"keys": keys, "counters": np.stack([np.ones(n, np.int64), np.zeros(n, np.int64)], 1),
                             "row_keys": keys, "rows": rows, "slots": slots, "clock": np.int64(1),
                             "admissions": np.int64(n), "evictions": np.int64(0)}])
        total += n
        del keys, rows, slots
    return total


class TrainingBeside:
    """`model.fit` on (x, y) again and again in a thread of its own while the block runs: the saves
    then copy and cut tables that training writes (`--train-beside`)."""

    def __init__(self, model, x, y):
        import threading

        import keras

        self._stop, self.errors = threading.Event(), []
        self.ends: list[float] = []  # when each step's batch ended, as fit's callbacks hear it
        ended = keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: self.ends.append(time.perf_counter()))

        def run():
            for _ in range(10_000):  # bounded: stopped when the saves end
                if self._stop.is_set():
                    return
                try:
                    model.fit(x, y, epochs=1, batch_size=64, verbose=0, callbacks=[ended])
                except Exception as error:  # noqa: BLE001 - re-raised by __exit__
                    self.errors.append(error)
                    return
        self._thread = threading.Thread(target=run, name="benchmark-training-beside")

    def __enter__(self):
        self._thread.start()
        return self

    def longest_gap(self, start: float, end: float) -> float | None:
        """The longest time between two steps' batch ends (of those around [start, end], the first
        after `end` included): how long training made no step around a save."""
        ends = list(self.ends)
        around = [t for t in ends if start <= t <= end]
        before = [t for t in ends if t < start][-1:]
        after = [t for t in ends if t > end][:1]
        times = before + around + after
        return round(max(b - a for a, b in zip(times, times[1:])), 4) if len(times) > 1 else None

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(600)
        if self._thread.is_alive():
            raise TimeoutError("the training beside the saves did not stop within 600 s")
        if self.errors:
            raise self.errors[0]
        return False


class PhasedRss(PeakRss):
    """`PeakRss` that also keeps its samples (perf_counter time, bytes), for each save's peak by phase."""

    def __init__(self, pid: int):
        super().__init__(pid)
        self.samples: list[tuple[float, int]] = []

    def _run(self):
        import psutil

        while not self._stop.wait(0.005):
            try:
                rss = self._process.memory_info().rss
            except psutil.Error:  # the process ended: its peak so far stands
                return
            self.peak = max(self.peak, rss)
            self.samples.append((time.perf_counter(), rss))

    def peak_between(self, start: float, end: float) -> int | None:
        inside = [rss for t, rss in self.samples if start <= t <= end]
        return max(inside) if inside else None


def phase_peaks(memory: list, started: float, ended: float, stats: dict) -> dict:
    """Each ps's peak above its memory before the saves (MB) in each phase of the save that ran from
    `started` to `ended`: the copy before the cut (training going on), the pause (draining the
    running steps and the cut), the write after it. The phases' bounds are the save's own times in
    `stats()["checkpoints"]` laid end to end from the call's start (the write is the rest)."""
    copy_end = started + (stats["last_copy_seconds"] or 0.0)
    cut_end = copy_end + (stats["last_stall_seconds"] or 0.0)
    out = {}
    for phase, (start, end) in (("copy", (started, copy_end)), ("pause", (copy_end, cut_end)),
                                ("write", (cut_end, ended))):
        out[phase] = [None if m.peak_between(start, end) is None else round((m.peak_between(start, end) - m.before) / 2**20, 1)
                      for m in memory]
    return out


def rss_mb(pids: list[int]) -> list[float]:
    import psutil

    return [psutil.Process(pid).memory_info().rss / 2**20 for pid in pids]


def table_bytes_by_ps(model) -> list[int]:
    """Per ps, the bytes of the dynamic tables' storage there (`table_stats()`'s `table_bytes`)."""
    from psclient.layers import DynamicEmbedding

    out: dict[int, int] = {}
    for layer in [layer for layer in model.layers if isinstance(layer, DynamicEmbedding)]:
        for index, entry in enumerate(layer.table_stats()):
            out[index] = out.get(index, 0) + int(entry.get("table_bytes", 0))
    return [out[i] for i in sorted(out)]


def write_deltas(model, strategy, args) -> list[dict]:
    """`args.deltas` phases of DELTA_STEPS fit steps, each on ids of its own: each writes one delta
    (waited for: the strategy writes it in the background)."""
    written = []
    for phase in range(args.deltas):
        rng = np.random.default_rng(100 + phase)
        start = (20 + phase) * args.rows  # ids apart from the first fit's (below 10 * rows) and each other's
        x = rng.integers(start, start + args.rows, (DELTA_STEPS * 64, args.tables))
        y = rng.integers(0, 2, (DELTA_STEPS * 64, 1)).astype("float32")
        before = strategy.stats(read_ps=False)["checkpoints"]["deltas_written"]
        model.fit(x, y, epochs=1, batch_size=64, verbose=0)
        deadline = time.monotonic() + 300
        while strategy.stats(read_ps=False)["checkpoints"]["deltas_written"] <= before:
            if time.monotonic() > deadline:
                raise TimeoutError(f"delta {phase + 1} of --deltas {args.deltas} was not written within 300 s")
            time.sleep(0.05)  # a benchmark's wait for the background write
        stats = strategy.stats(read_ps=False)["checkpoints"]
        written.append({"bytes": stats["last_delta_bytes"], "rows": stats["last_delta_rows"],
                        "write_s": round(stats["last_delta_seconds"], 3)})
    return written


def lose_ps(local, strategy, ps: int, timeout: float = 600.0) -> dict:
    """Kill ps `ps`, start it again, and wait for its recovery (its variables and table shards made
    again and restored from the newest checkpoint): the wall time from its restart until `stats()`
    counts the recovery, and the recovery's own time (`last_recovery_s`: from the task being back
    to its state restored)."""
    recoveries = strategy.stats(read_ps=False)["ps"][ps]["recoveries"]
    try:
        local.kill("ps", ps)
    finally:
        local.restart("ps", ps)
    started = time.perf_counter()
    strategy.stats()  # meets the restarted ps: the recovery starts (if dispatch has not met it yet)
    while True:  # a benchmark, not a test: polled, every 10 ms
        entry = strategy.stats(read_ps=False)["ps"][ps]
        if entry["recoveries"] > recoveries:
            break
        if time.perf_counter() - started > timeout:
            raise TimeoutError(f"ps {ps} restarted {timeout:g} s ago; its recovery is still not counted "
                               f"(recoveries {entry['recoveries']}, expected {recoveries + 1})")
        time.sleep(0.01)
    return {"restart_to_recovered_s": round(time.perf_counter() - started, 3),
            "last_recovery_s": round(entry["last_recovery_s"], 3)}


def on_ps(psclient, local, num_ps: int):
    """The cluster with the first `num_ps` of its ps tasks (no chief: a coordinator picks its own port)."""
    spec = local.cluster.training_spec()
    return psclient.Cluster({"worker": list(spec["worker"]), "ps": list(spec["ps"][:num_ps])})


def restoring_run(keras, psclient, local, directory: str, args, kind: str):
    """`--restore-ps`: a new coordinator's run on the first `args.restore_ps` ps, the same model built
    and restored once (not measured: its tables and slots are then made there and in the RSS before
    the measured restores), its checkpoint dir the saves'."""
    strategy = psclient.ParameterServerStrategy(on_ps(psclient, local, args.restore_ps), checkpoint_dir=directory,
                                                dynamic_table_storage=args.storage)
    with strategy.scope():
        model = build(keras, kind, args.tables, args.rows, args.dim)
    strategy.restore()
    return strategy, model


def one_kind(keras, psclient, local, kind: str, args, ps_pids: list[int]) -> dict:
    cluster = on_ps(psclient, local, 2)
    with tempfile.TemporaryDirectory() as directory:
        deltas = args.deltas if kind == "dynamic" else 0
        more = {"delta_checkpoint_every": DELTA_STEPS} if deltas else {}
        strategy = psclient.ParameterServerStrategy(cluster, checkpoint_dir=directory,
                                                    checkpoint_cut=args.checkpoint_cut,
                                                    dynamic_table_storage=args.storage, **more)
        try:
            with strategy.scope():
                model = build(keras, kind, args.tables, args.rows, args.dim)
            rng = np.random.default_rng(0)
            x = rng.integers(0, 10 * args.rows, (args.steps * 64, args.tables))
            y = rng.integers(0, 2, (args.steps * 64, 1)).astype("float32")
            started = time.perf_counter()
            model.fit(x, y, epochs=1, batch_size=64, verbose=0)
            fit_s = time.perf_counter() - started
            fill_growth = None
            if kind == "dynamic" and args.fill:
                _settle(ps_pids)
                before_fill = rss_mb(ps_pids)
            filled = fill_tables(model, args.fill) if kind == "dynamic" and args.fill else 0
            if filled:  # the imported rows' resident memory (all of it given back after, on --ps-malloc)
                _settle(ps_pids)
                fill_growth = [round(after - before, 1) for after, before in zip(rss_mb(ps_pids), before_fill)]
            table_bytes = table_bytes_by_ps(model) if kind == "dynamic" else []
            saves, restores = [], []
            _settle(ps_pids)
            with contextlib.ExitStack() as stack:
                memory = [stack.enter_context(PhasedRss(pid)) for pid in ps_pids]
                beside = stack.enter_context(TrainingBeside(model, x, y)) if args.train_beside else None
                for _ in range(args.saves):
                    peak_so_far = [m.peak for m in memory]
                    for m in memory:  # each save's own peak too (the first also makes its functions)
                        m.peak = m.before
                    started = time.perf_counter()
                    newest = strategy.save_checkpoint()
                    call_s = time.perf_counter() - started
                    if beside is not None:  # the first step after the save ended, to measure the gap
                        deadline = time.perf_counter() + 30
                        while not [t for t in list(beside.ends) if t > started + call_s] and time.perf_counter() < deadline:
                            time.sleep(0.01)  # a benchmark's wait for training's next step
                    stats = strategy.stats(read_ps=False)["checkpoints"]
                    own = [round(1 + (m.peak - m.before) / table_bytes[i], 3) if i < len(table_bytes) and table_bytes[i]
                           else None for i, m in enumerate(memory)]
                    for m, earlier in zip(memory, peak_so_far):
                        m.peak = max(m.peak, earlier)
                    saves.append({"stall_s": round(stats["last_stall_seconds"], 4), "call_s": round(call_s, 3),
                                  "ps_peak_over_table": own,
                                  "ps_peak_mb_by_phase": phase_peaks(memory, started, started + call_s, stats),
                                  "copy_s": None if stats["last_copy_seconds"] is None
                                  else round(stats["last_copy_seconds"], 3),
                                  "copied_mb": round(stats["last_copied_bytes"] / 2**20, 1),
                                  "rows_read_again": stats["last_rows_read_again"],
                                  "longest_step_gap_s": None if beside is None
                                  else beside.longest_gap(started, started + call_s)})
            save_peaks = [{"rss_mb_before": round(m.before / 2**20, 1), "rss_mb_peak": round(m.peak / 2**20, 1),
                           **({"table_mb": round(table_bytes[i] / 2**20, 1),
                               "peak_over_table": round(1 + (m.peak - m.before) / table_bytes[i], 3)}
                              if i < len(table_bytes) and table_bytes[i] else {})} for i, m in enumerate(memory)]
            # The dynamic tables only: `stats()` reads them on the ps, which meets the lost one (the
            # hashing trick's model has nothing there that `stats()` reads: no recovery would start).
            written = write_deltas(model, strategy, args) if deltas else []
            if deltas and not args.restore_ps:
                strategy.restore()  # not measured: it drops the deltas' base kept on each ps
            losses = [lose_ps(local, strategy, 1) for _ in range(args.ps_losses if kind == "dynamic" else 0)]
            ps_pids = [local.pid("ps", i) for i in range(len(ps_pids))]  # ps 1's, once restarted
            if args.restore_ps:  # the saving run ends; the restores are another run's, on N ps
                strategy.shutdown()
                strategy, model = restoring_run(keras, psclient, local, directory, args, kind)
                table_bytes = table_bytes_by_ps(model)
                ps_pids = [local.pid("ps", i) for i in range(args.restore_ps)]
            peaks, applied = [], []
            for _ in range(args.restores):
                _settle(ps_pids)  # what the saves (or the restore before) freed given back: the baseline
                with contextlib.ExitStack() as stack:
                    memory = [stack.enter_context(PeakRss(pid)) for pid in ps_pids]
                    started = time.perf_counter()
                    result = strategy.restore()
                    restores.append(round(time.perf_counter() - started, 3))
                peaks.append([{"rss_mb_before": round(m.before / 2**20, 1), "rss_mb_peak": round(m.peak / 2**20, 1),
                               **({"table_mb": round(table_bytes[i] / 2**20, 1),
                                   "peak_over_table": round(1 + (m.peak - m.before) / table_bytes[i], 3)}
                                  if i < len(table_bytes) and table_bytes[i] else {})}
                              for i, m in enumerate(memory)])
                applied.append(len(result.get("deltas") or []))
                if args.restore_ps and result["path"] != newest:  # not one the restoring run's fit wrote
                    raise RuntimeError(f"--restore-ps restored {result['path']}, not the saves' newest {newest}")
        finally:
            strategy.shutdown()
    later = saves[1:] or saves
    return {
        "fit_s": round(fit_s, 2), "saves": saves, "restores_s": restores,
        "first_save_stall_s": saves[0]["stall_s"],
        "median_later_save_stall_s": median([s["stall_s"] for s in later]),
        "first_restore_s": restores[0] if restores else None,
        "median_later_restore_s": median(restores[1:] or restores) if restores else None,
        "rows_imported": filled, "ps_rss_growth_mb_from_fill": fill_growth, "deltas_written": written, "deltas_applied_per_restore": applied,
        "ps_losses": losses, "ps_restore_peaks": peaks, "ps_save_peaks": save_peaks,
        "max_peak_over_table": max((p["peak_over_table"] for run in peaks for p in run if "peak_over_table" in p),
                                   default=None),
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
    parser.add_argument("--fill", type=float, default=0.0,
                        help="fill each dynamic table to this fraction of its capacity before the checkpoints")
    parser.add_argument("--ps-losses", type=int, default=0,
                        help="after the saves, lose ps 1 (killed, started again) this many times, each "
                             "recovery waited for, before the restores")
    parser.add_argument("--deltas", type=int, default=0,
                        help="dynamic tables: write this many deltas after the saves; the restores apply them")
    parser.add_argument("--restore-ps", type=int, default=0,
                        help="dynamic tables: restore into this many ps (the saves are 2 ps's), in a new run")
    parser.add_argument("--checkpoint-cut", choices=("rows", "copy"), default="rows",
                        help="StrategyConfig.checkpoint_cut: copy the tables before the cut (rows) or in it (copy)")
    parser.add_argument("--storage", choices=("dense", "hash"), default="dense",
                        help="StrategyConfig.dynamic_table_storage of the dynamic tables (hash: exported in the cut)")
    parser.add_argument("--train-beside", action="store_true",
                        help="the saves run while model.fit trains in another thread")
    parser.add_argument("--ps-malloc", action="store_true",
                        help="ps tasks give freed memory back (glibc mmap threshold 1 MiB, oneDNN off)")
    args = parser.parse_args(argv)
    kinds = [k for k in args.paths.split(",") if k]
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown or args.saves < 1 or args.tables < 1:
        parser.error(f"--paths takes {', '.join(KINDS)} (received {unknown}); --saves and --tables >= 1")
    if args.deltas < 0 or (args.deltas and "dynamic" not in kinds):
        parser.error(f"--deltas must be an integer >= 0, with dynamic in --paths. Received: --deltas {args.deltas}, "
                     f"--paths {args.paths}")

    if args.restore_ps < 0 or (args.restore_ps and (kinds != ["dynamic"] or args.ps_losses)):
        parser.error(f"--restore-ps must be an integer >= 0, with --paths dynamic and no --ps-losses. Received: "
                     f"--restore-ps {args.restore_ps}, --paths {args.paths}, --ps-losses {args.ps_losses}")

    import keras

    import psclient

    output = {"benchmark": "table_checkpoint", "config": vars(args), "environment": environment(sys.argv),
              "results": {}}
    env = {"TF_ENABLE_ONEDNN_OPTS": "0", "MALLOC_MMAP_THRESHOLD_": str(1 << 20)} if args.ps_malloc else None
    with psclient.LocalCluster(num_workers=1, num_ps=max(2, args.restore_ps), env=env, start_timeout=300,
                               start_method="spawn") as local:
        ps_pids = [local.pid("ps", i) for i in range(2)]
        for kind in kinds:
            log(f"{kind}: {args.tables} tables")
            result = output["results"][kind] = one_kind(keras, psclient, local, kind, args, ps_pids)
            log(f"{kind}: restore peak over the tables {result['max_peak_over_table']}")
            for loss in result["ps_losses"]:
                log(f"{kind}: ps 1 lost: restart to recovered {loss['restart_to_recovered_s']} s "
                    f"(last_recovery_s {loss['last_recovery_s']} s)")
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
