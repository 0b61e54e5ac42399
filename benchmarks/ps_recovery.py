"""What one lost ps costs: `ps_recovery="part"`, the same with delta checkpoints, and `"all"`, side by side.

Each mode runs in its own coordinator subprocess, which owns a fresh
`psclient.LocalCluster` (2 workers, 4 ps) and a
`ParameterServerStrategy(checkpoint_dir=..., **MODE_OPTIONS[mode])`:
"part" and "all" are `ps_recovery=mode`; "part_delta" is `ps_recovery="part"`
with `delta_checkpoint_every=8` (incremental checkpoints: each ps writes the
rows changed since the previous checkpoint, every 8 completed closures, and a
lost ps comes back at the newest delta). All train the same model on the
same data with the same seed:

  model  Embedding(rows, 32) -> GlobalAveragePooling1D -> Dense(1) (frozen),
         logistic loss, SGD. The table (4,200,000 x 32 float32 = 538 MB by
         default) is split by psclient's default partitioner into one shard
         per ps; the frozen Dense kernel keeps the high learning rate stable
         (each row's gradient is divided by batch x ids per example).
  data   a fixed pool of examples (ids uniform over the rows, so every ps
         holds a quarter of what is learned; random labels, memorised); step
         i trains batch i mod (pool / batch), passed as arguments, so both
         modes see the same batches in the same order.

Per mode, with `schedule` + `join` (the kill falls between closures, so the
closures rolled back are exactly those since the checkpoint):

  1. --steps-before steps, join; evaluate the whole pool (loss "at checkpoint");
  2. strategy.save_checkpoint(), timed (nothing runs meanwhile: its duration
     is the pause dispatch sees), while every ps's VmRSS is sampled;
  3. --steps-between steps, by 8: after each 8 a join and an evaluation of
     the pool (the last is the loss "before kill");
  4. SIGKILL ps 1; schedule an evaluation at once (dispatch meets the dead
     ps); restart ps 1 at its address (as the tests do: LocalCluster.restart,
     which returns once it serves). That evaluation is the first closure to
     complete after the recovery: its completion ends "kill to training
     again", and its loss is that of the recovered state. Every ps's VmRSS
     is sampled from the kill until then (the restarted ps 1's VmHWM is its
     peak since it started). Then --steps-after steps, by 8 as in 3.

Every ps's VmRSS is also sampled through 1 (with deltas: the first deltas,
and the copy of each shard each ps keeps as the diff's base) and through 3
(the deltas on the saved checkpoint). Before the save, and before the last
8 steps ahead of the kill, the benchmark waits until QUIET_S (2.5 s) pass
with no checkpoint written or in flight: psclient checks what is due once a
round (1 s), so every delta due was taken and written. The last 8 steps and
their evaluation follow, then the kill (after any write in flight): under
"part_delta" ps 1 rolls back those 9 closures, or fewer if a round cut a
delta among them (the same waits in every mode). Every checkpoint written in the background (each delta's stall, write
seconds, bytes and rows; the full ones') is read from `stats()["checkpoints"]`
as it ends, with the phase it fell in.

Reports per mode: closures rolled back and each ps's
`stats()["ps"][k]["rolled_back"]`, seconds from the kill to the task serving
again and to the first closure completing, psclient's own
`last_recovery_s`, the evaluation losses before the kill and after
recovery (and the steps it took to get back within 1% of the loss before
the kill), the training loss per pass over the pool, the fraction of the
progress since the checkpoint that the recovery lost, the checkpoint's
stall and bytes, the deltas' (under "part_delta"), and each ps's RSS before
and at its peak during training, the save and the recovery. With --repeats N
the modes run N times, interleaved (part, part_delta, all, part, ...);
`summary` gives each figure's median per mode and `ratios` the ratios of
those medians (part/all, part_delta/all, part_delta/part); `runs` holds
every run.

    nice -n 15 python benchmarks/ps_recovery.py                    # 538 MB table, the three modes
    nice -n 15 python benchmarks/ps_recovery.py --quick            # 12.8 MB table, fewer steps
    nice -n 15 python benchmarks/ps_recovery.py --repeats 2 --output benchmarks/results/ps_recovery-DATE.json
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import threading
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

#: Mode -> ParameterServerStrategy options beside checkpoint_dir. "part_delta": "part" with incremental
#: checkpoints every DELTA_EVERY completed closures (the benchmark joins every EVAL_EVERY steps + 1
#: evaluation, so the kill falls a few closures past the newest delta).
DELTA_EVERY = 8
MODE_OPTIONS = {
    "part": {"ps_recovery": "part"},
    "part_delta": {"ps_recovery": "part", "delta_checkpoint_every": DELTA_EVERY},
    "all": {"ps_recovery": "all"},
}
MODES = tuple(MODE_OPTIONS)
NUM_WORKERS, NUM_PS = 2, 4
LOST_PS = 1
DIM, IDS_PER_EXAMPLE = 32, 4
POOL, BATCH = 4096, 256
LEARNING_RATE = 500.0
SEED = 0
#: Training-loss curve: the mean of each window of this many steps (one pass over the pool).
WINDOW = POOL // BATCH
#: Between the checkpoint and the kill, and after it: an evaluation of the pool every this many steps.
EVAL_EVERY = 8
#: Seconds with no checkpoint written before a save or the kill: 2.5 rounds of psclient's recovery
#: thread (min(1 s, hang_timeout / 4): 1 s with the default hang_timeout), which takes a delta due.
QUIET_S = 2.5
#: Seconds a restarted ps may take to serve (TensorFlow's import on a loaded machine).
RESTART_TIMEOUT_S = 300.0
DEFAULTS = {"rows": 4_200_000, "steps_before": 32, "steps_between": 48, "steps_after": 64}
QUICK = {"rows": 100_000, "steps_before": 16, "steps_between": 16, "steps_after": 32}


# --------------------------------------------------------------- memory
def _status_kb(pid: int, field: str) -> int | None:
    """A `VmRSS`/`VmHWM` line of /proc/<pid>/status, in kB (None: the process is gone)."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None


def _mb(kb: int | None) -> float | None:
    return None if kb is None else round(kb / 1024, 1)


class PsMemory:
    """Samples every ps task's VmRSS every 20 ms while a window is open; owned and joined by its user.

    `pids()` is asked at each sample, so a restarted ps is followed to its new process.
    """

    def __init__(self, pids):
        self._pids = pids
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._before: dict[str, int | None] = {}
        self._peak: dict[str, int] = {}
        self._open = False
        self._thread = threading.Thread(target=self._run, name="ps-memory", daemon=True)
        self._thread.start()

    def _sample(self) -> dict[str, int]:
        out = {}
        for name, pid in self._pids().items():
            kb = None if pid is None else _status_kb(pid, "VmRSS")
            if kb is not None:
                out[name] = kb
        return out

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            with self._lock:
                if not self._open:
                    continue
                for name, kb in self._sample().items():
                    self._peak[name] = max(self._peak.get(name, 0), kb)

    def open(self) -> None:
        with self._lock:
            sample = self._sample()
            self._before = {name: sample.get(name) for name in self._pids()}
            self._peak = dict(sample)
            self._open = True

    def close(self) -> dict:
        """Per ps: RSS (MB) when the window opened, its peak during it, and VmHWM now."""
        with self._lock:
            self._open = False
            for name, kb in self._sample().items():  # the last moment counts too
                self._peak[name] = max(self._peak.get(name, 0), kb)
            pids = self._pids()
            return {name: {"rss_mb_before": _mb(self._before.get(name)), "rss_mb_peak": _mb(self._peak.get(name)),
                           "vm_hwm_mb": _mb(None if pids[name] is None else _status_kb(pids[name], "VmHWM"))}
                    for name in pids}

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


class CheckpointLog:
    """Every checkpoint the strategy writes in the background, read from `stats()` every 20 ms.

    A write ends -> `background_writes` grows; a delta's also grows `deltas_written`, and
    its `last_delta_*` figures are that delta's (one write at a time: the next cut waits
    for it). `phase` (set by the user) labels the entries; `missed` counts writes that ended
    between two polls beyond the first (their figures were overwritten before being read).
    """

    def __init__(self, strategy):
        self._strategy = strategy
        self.phase = "setup"
        self.entries: list[dict] = []
        self.missed = 0
        self._writes = self._deltas = 0
        self._lock = threading.Lock()  # polled by its thread and by wait_quiet
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="checkpoint-log", daemon=True)
        self._thread.start()

    def _poll(self) -> dict:
        with self._lock:
            return self._poll_locked()

    def _poll_locked(self) -> dict:
        stats = self._strategy.stats(read_ps=False)
        c = stats.get("checkpoints") or {}
        writes, deltas = c.get("background_writes") or 0, c.get("deltas_written") or 0
        if writes > self._writes:
            self.missed += writes - self._writes - 1
            if deltas > self._deltas:
                entry = {"kind": "delta", "stall_s": c["last_delta_stall_seconds"],
                         "write_s": c["last_delta_seconds"], "bytes": c["last_delta_bytes"],
                         "rows": c["last_delta_rows"]}
            else:
                entry = {"kind": "full", "stall_s": c["last_stall_seconds"], "write_s": c["last_write_seconds"],
                         "bytes": stats["checkpoint"]["last_bytes"]}
            entry.update(phase=self.phase, completed_when_seen=stats["completed"],
                         stall_s=_round(entry["stall_s"]), write_s=_round(entry["write_s"]))
            self.entries.append(entry)
            self._writes, self._deltas = writes, deltas
        return c

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self._poll()

    def wait_written(self, timeout: float) -> None:
        """Until no checkpoint write is in flight (the kill must not fall inside a delta's write)."""
        deadline = time.monotonic() + timeout
        while self._poll().get("writing"):
            if time.monotonic() > deadline:
                raise TimeoutError(f"a checkpoint write was still in flight after {timeout} s")
            self._stop.wait(0.02)

    def wait_quiet(self, timeout: float) -> None:
        """Until QUIET_S passed with no checkpoint written or in flight: every checkpoint due was taken.

        psclient's recovery thread checks what is due once a round (every second by
        default), so a delta due after the last closures is cut within a round of them.
        The kill must fall after it was written, not inside its cut or write.
        """
        started = time.monotonic()
        quiet_since, writes = started, self._writes
        while True:
            now = time.monotonic()
            if self._poll().get("writing") or self._writes != writes:
                quiet_since, writes = now, self._writes
            elif now - quiet_since >= QUIET_S:
                return
            if now - started > timeout:
                raise TimeoutError(f"checkpoints were still being written after {timeout} s")
            self._stop.wait(0.02)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self._poll()  # a write that ended since the last poll


def _round(x, digits: int = 3):
    return None if x is None else round(x, digits)


# ----------------------------------------------------------- the model
def make_data(rows: int):
    import numpy as np

    rng = np.random.default_rng(SEED)
    ids = rng.integers(0, rows, size=(POOL, IDS_PER_EXAMPLE)).astype("int32")
    labels = rng.integers(0, 2, size=(POOL, 1)).astype("float32")
    return ids, labels


def build(strategy, rows: int):
    """(train step, evaluation, optimizer) in `strategy`'s scope."""
    import keras
    import tensorflow as tf

    keras.utils.set_random_seed(SEED)
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((IDS_PER_EXAMPLE,), dtype="int32"),
            keras.layers.Embedding(rows, DIM, name="table"),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(1, trainable=False, name="frozen_readout"),
        ])
        optimizer = keras.optimizers.SGD(LEARNING_RATE)
        optimizer.build(model.trainable_variables)
    loss_fn = keras.losses.BinaryCrossentropy(from_logits=True)

    @tf.function
    def step(ids, labels):
        with tf.GradientTape() as tape:
            loss = loss_fn(labels, model(ids, training=True))
        optimizer.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
        return loss

    @tf.function
    def evaluate(ids, labels):
        return loss_fn(labels, model(ids, training=False))

    return step, evaluate, optimizer


# ------------------------------------------------------------ one mode
def child_main(args: argparse.Namespace) -> None:
    _common.exit_with_parent()
    import logging

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    logging.getLogger("psclient").setLevel(logging.INFO)
    import psclient

    mode = args._child
    directory = tempfile.mkdtemp(prefix=f"ps-recovery-{mode}-", dir=args.scratch)
    try:
        with psclient.LocalCluster(num_workers=NUM_WORKERS, num_ps=NUM_PS, start_timeout=RESTART_TIMEOUT_S, start_method="spawn") as local:
            strategy = psclient.ParameterServerStrategy(local.cluster, checkpoint_dir=directory,
                                                        **MODE_OPTIONS[mode])
            memory = PsMemory(lambda: {f"ps:{k}": local.pid("ps", k) for k in range(NUM_PS)})
            checkpoints = CheckpointLog(strategy)
            try:
                result = run_mode(local, strategy, memory, checkpoints, args)
            finally:
                checkpoints.stop()
                memory.stop()
                strategy.shutdown()
    finally:
        shutil.rmtree(directory, ignore_errors=True)  # before child_exit: it ends the process at once
    _common.child_exit(result)


def run_mode(local, strategy, memory: PsMemory, checkpoints: CheckpointLog, args: argparse.Namespace) -> dict:
    import numpy as np

    mode = args._child
    started = time.monotonic()
    ids, labels = make_data(args.rows)
    step, evaluate, optimizer = build(strategy, args.rows)
    batches = POOL // BATCH

    def batch(i):
        j = i % batches
        return ids[j * BATCH:(j + 1) * BATCH], labels[j * BATCH:(j + 1) * BATCH]

    def train(first: int, count: int) -> list:
        return [strategy.schedule(step, args=batch(i)) for i in range(first, first + count)]

    def train_and_evaluate(first: int, count: int, before_last=None) -> tuple[list, list]:
        """`count` steps; after every EVAL_EVERY of them a join, then the loss of the pool.
        `before_last()` is called before the last EVAL_EVERY steps."""
        steps, evaluations = [], []
        for done in range(0, count, EVAL_EVERY):
            if before_last is not None and done + EVAL_EVERY >= count:
                before_last()
            steps += train(first + done, min(EVAL_EVERY, count - done))
            strategy.join(timeout=args.closure_timeout)
            evaluations.append((len(steps), full_loss()))
        return steps, evaluations

    def full_loss() -> float:
        return float(strategy.schedule(evaluate, args=(ids, labels)).result(timeout=args.closure_timeout))

    placement = strategy.placement()
    per_ps = {f"ps:{k}": {"mb": 0.0, "variables": 0} for k in range(NUM_PS)}
    for v in placement["variables"]:
        per_ps[f"ps:{v['ps_index']}"]["mb"] += v["nbytes"] / 2**20
        per_ps[f"ps:{v['ps_index']}"]["variables"] += 1
    initial_loss = full_loss()  # the first closure: psclient checkpoints the new variables before it
    first_checkpoint_s = strategy.stats()["checkpoint"]["last_seconds"]
    setup_s = time.monotonic() - started
    _common.log(f"{mode}: set up in {setup_s:.1f} s (first checkpoint {first_checkpoint_s:.2f} s), "
                f"loss {initial_loss:.4f}")

    # 1-2. Train, then the checkpoint the recovery will read.
    checkpoints.phase = "before the checkpoint"
    memory.open()
    before = train(0, args.steps_before)
    strategy.join(timeout=args.closure_timeout)
    loss_at_checkpoint = full_loss()
    checkpoints.wait_quiet(args.closure_timeout)
    before_memory = memory.close()
    checkpoints.phase = "save_checkpoint()"
    memory.open()
    t0 = time.monotonic()
    checkpoint = strategy.save_checkpoint()
    save_s = time.monotonic() - t0
    completed_at_checkpoint = strategy.stats()["completed"]
    save_memory = memory.close()
    save_stats = strategy.stats(read_ps=False)
    checkpoint_bytes = save_stats["checkpoint"]["last_bytes"]
    save_stall_s = save_stats["checkpoints"]["last_stall_seconds"]
    _common.log(f"{mode}: save_checkpoint() {save_s:.2f} s, {checkpoint_bytes / 2**20:.0f} MB")

    # 3. Past the checkpoint.
    checkpoints.phase = "between the checkpoint and the kill"
    memory.open()
    # Every delta due is written before the last 8 steps and their evaluation, which the kill
    # follows at once (after any write in flight): under "part_delta" ps 1 loses those 9 closures,
    # or fewer if a round of psclient's recovery thread cut a delta among them.
    between, evaluations_between = train_and_evaluate(
        args.steps_before, args.steps_between, before_last=lambda: checkpoints.wait_quiet(args.closure_timeout))
    loss_before_kill = evaluations_between[-1][1]
    checkpoints.wait_written(args.closure_timeout)
    between_memory = memory.close()
    closures_since_checkpoint = strategy.stats()["completed"] - completed_at_checkpoint
    deltas_before_kill = strategy.stats(read_ps=False)["checkpoints"].get("deltas_since_full")
    iterations_before_kill = int(optimizer.iterations.numpy())

    # 4. Lose ps 1 between closures; an evaluation waits for it.
    checkpoints.phase = "recovery"
    killed = time.monotonic()
    local.kill("ps", LOST_PS)
    memory.open()  # after the kill: ps 1's figures are its new process's alone
    first_done: list[float] = []
    probe = strategy.schedule(evaluate, args=(ids, labels))
    probe.add_done_callback(lambda _: first_done.append(time.monotonic()))
    local.restart("ps", LOST_PS, timeout=RESTART_TIMEOUT_S)
    serving = time.monotonic()
    loss_after_recovery = float(probe.result(timeout=args.closure_timeout))
    returned = time.monotonic()
    restore_memory = memory.close()
    checkpoints.phase = "after the recovery"
    after, evaluations_after = train_and_evaluate(args.steps_before + args.steps_between, args.steps_after)
    loss_end = evaluations_after[-1][1]
    stats = strategy.stats()
    ps_stats = stats["ps"]
    # The callback, when it ran before result() returned (a done future wakes its waiters first).
    first = min(first_done[0], returned) if first_done else returned
    first_closure_s = first - killed
    _common.log(f"{mode}: kill -> serving {serving - killed:.2f} s, -> first closure {first_closure_s:.2f} s; "
                f"loss at checkpoint {loss_at_checkpoint:.4f}, before kill {loss_before_kill:.4f}, "
                f"after recovery {loss_after_recovery:.4f}")

    def curve(futures: list, first: int) -> list:
        losses = [float(f.result()) for f in futures]
        return [{"steps": f"{first + i}-{first + min(i + WINDOW, len(losses)) - 1}",
                 "mean_loss": round(float(np.mean(losses[i:i + WINDOW])), 4)}
                for i in range(0, len(losses), WINDOW)]

    def evaluation_curve(evaluations: list, first: int) -> list:
        return [{"after_step": first + n - 1, "loss": round(loss, 4)} for n, loss in evaluations]

    progress = loss_at_checkpoint - loss_before_kill
    regained = next((n for n, loss in evaluations_after if loss <= 1.01 * loss_before_kill), None)
    rolled_back = []
    for k, ps in enumerate(ps_stats):
        report = None if ps["rolled_back"] is None else dict(
            ps["rolled_back"], checkpoint=os.path.basename(ps["rolled_back"]["checkpoint"] or ""))
        rolled_back.append({"ps": k, "rolled_back": report, "rolled_back_closures": ps["rolled_back_closures"],
                            "failures": ps["failures"], "recoveries": ps["recoveries"]})
    return {
        "mode": mode,
        "placement_mb": {name: {"mb": round(v["mb"], 1), "variables": v["variables"]} for name, v in per_ps.items()},
        "setup_s": round(setup_s, 2),
        "checkpoint": {
            "full": {
                "first_checkpoint_s": round(first_checkpoint_s, 3),
                "save_checkpoint_s": round(save_s, 3),
                "pause": "save_checkpoint() with no closure running: its duration is the time dispatch is held",
                "stall_s": _round(save_stall_s),
                "bytes_mb": round(checkpoint_bytes / 2**20, 1),
                "path": os.path.basename(checkpoint),
                "ps_memory_during_save": save_memory,
            },
            "delta_checkpoint_every": MODE_OPTIONS[mode].get("delta_checkpoint_every"),
            "deltas": delta_summary(checkpoints),
            "written": checkpoints.entries,
            "polls_missed_writes": checkpoints.missed,
            "ps_memory_training_before_checkpoint": before_memory,
            "ps_memory_between_checkpoint_and_kill": between_memory,
        },
        "recovery": {
            "lost_ps": LOST_PS,
            "kill_to_serving_s": round(serving - killed, 3),
            "serving_to_first_closure_s": round(first - serving, 3),
            "kill_to_first_closure_s": round(first_closure_s, 3),
            "psclient_last_recovery_s": ps_stats[LOST_PS]["last_recovery_s"],
            "closures_rolled_back": ps_stats[LOST_PS]["rolled_back_closures"],
            "closures_completed_between_checkpoint_and_kill": closures_since_checkpoint,
            "deltas_on_the_checkpoint_at_kill": deltas_before_kill,
            "of_which_training_steps": args.steps_between,
            "variables_restored": sum((r["rolled_back"] or {}).get("variables", 0) for r in rolled_back),
            "per_ps": rolled_back,
            "ps_memory_kill_to_first_closure": restore_memory,
            "retried_closures": sum(w["retried"] for w in stats["workers"]),
        },
        "loss": {
            "initial": round(initial_loss, 4),
            "at_checkpoint": round(loss_at_checkpoint, 4),
            "before_kill": round(loss_before_kill, 4),
            "after_recovery": round(loss_after_recovery, 4),
            "end": round(loss_end, 4),
            "progress_since_checkpoint_lost": round((loss_after_recovery - loss_before_kill) / progress, 3)
            if progress > 0 else None,
            "steps_after_recovery_to_within_1pct_of_loss_before_kill": regained,
            "evaluations_between_checkpoint_and_kill": evaluation_curve(evaluations_between, args.steps_before),
            "evaluations_after_recovery": evaluation_curve(evaluations_after, args.steps_before + args.steps_between),
            "training_loss_per_pass": {
                "before_checkpoint": curve(before, 0),
                "between_checkpoint_and_kill": curve(between, args.steps_before),
                "after_recovery": curve(after, args.steps_before + args.steps_between),
            },
        },
        "optimizer_iterations": {"before_kill": iterations_before_kill, "end": int(optimizer.iterations.numpy()),
                                 "on_ps": next((v["ps_index"] for v in placement["variables"]
                                                if "iteration" in v.get("name", "")), None)},
        "wall_s": round(time.monotonic() - started, 1),
    }


def delta_summary(checkpoints: CheckpointLog) -> dict | None:
    """The deltas written before the kill: count, and min/median/max of stall, write seconds, bytes."""
    deltas = [e for e in checkpoints.entries if e["kind"] == "delta" and e["phase"] != "after the recovery"]
    if not deltas:
        return None
    out = {"count": len(deltas)}
    for key in ("stall_s", "write_s", "bytes"):
        values = sorted(e[key] for e in deltas if e[key] is not None)
        out[key] = {"min": values[0], "median": _common.median(values), "max": values[-1]} if values else None
    return out


# --------------------------------------------------------------- parent
def _surviving_growth(per_ps: dict) -> float:
    """RSS growth (MB) from a window's start to its peak, summed over the ps that were not lost."""
    return round(sum(v["rss_mb_peak"] - v["rss_mb_before"] for name, v in per_ps.items()
                     if name != f"ps:{LOST_PS}" and v["rss_mb_before"] is not None
                     and v["rss_mb_peak"] is not None), 1)


def _largest(per_ps: dict, key: str) -> float | None:
    values = [v[key] for v in per_ps.values() if v[key] is not None]
    return max(values) if values else None


def _delta(r: dict, key: str) -> float | None:
    deltas = r["checkpoint"]["deltas"]
    if deltas is None or deltas.get(key) is None:
        return None
    return deltas[key] if key == "count" else deltas[key]["median"]


#: What the summary gives for each mode (median over the repeats): name -> figure of one run.
FIGURES = {
    "kill_to_serving_s": lambda r: r["recovery"]["kill_to_serving_s"],
    "serving_to_first_closure_s": lambda r: r["recovery"]["serving_to_first_closure_s"],
    "kill_to_first_closure_s": lambda r: r["recovery"]["kill_to_first_closure_s"],
    "psclient_last_recovery_s": lambda r: r["recovery"]["psclient_last_recovery_s"],
    "closures_rolled_back": lambda r: r["recovery"]["closures_rolled_back"],
    "variables_restored": lambda r: r["recovery"]["variables_restored"],
    "progress_since_checkpoint_lost": lambda r: r["loss"]["progress_since_checkpoint_lost"],
    "loss_before_kill": lambda r: r["loss"]["before_kill"],
    "loss_after_recovery": lambda r: r["loss"]["after_recovery"],
    "steps_after_recovery_to_within_1pct_of_loss_before_kill":
        lambda r: r["loss"]["steps_after_recovery_to_within_1pct_of_loss_before_kill"],
    "save_checkpoint_s": lambda r: r["checkpoint"]["full"]["save_checkpoint_s"],
    "save_checkpoint_stall_s": lambda r: r["checkpoint"]["full"]["stall_s"],
    "deltas_written_before_kill": lambda r: _delta(r, "count"),
    "deltas_on_the_checkpoint_at_kill": lambda r: r["recovery"]["deltas_on_the_checkpoint_at_kill"],
    "delta_stall_s (median of the run's)": lambda r: _delta(r, "stall_s"),
    "delta_write_s (median of the run's)": lambda r: _delta(r, "write_s"),
    "delta_mb (median of the run's)": lambda r: None if _delta(r, "bytes") is None else _delta(r, "bytes") / 2**20,
    "first_checkpoint_s": lambda r: r["checkpoint"]["full"]["first_checkpoint_s"],
    "checkpoint_mb": lambda r: r["checkpoint"]["full"]["bytes_mb"],
    "ps_rss_mb_before_save (largest ps)":
        lambda r: _largest(r["checkpoint"]["full"]["ps_memory_during_save"], "rss_mb_before"),
    "ps_peak_rss_mb_during_save (largest ps)":
        lambda r: _largest(r["checkpoint"]["full"]["ps_memory_during_save"], "rss_mb_peak"),
    "ps_peak_rss_mb_training_before_checkpoint (largest ps)":
        lambda r: _largest(r["checkpoint"]["ps_memory_training_before_checkpoint"], "rss_mb_peak"),
    "ps_peak_rss_mb_between_checkpoint_and_kill (largest ps)":
        lambda r: _largest(r["checkpoint"]["ps_memory_between_checkpoint_and_kill"], "rss_mb_peak"),
    "surviving_ps_rss_growth_mb_during_save (summed)":
        lambda r: _surviving_growth(r["checkpoint"]["full"]["ps_memory_during_save"]),
    "surviving_ps_rss_growth_mb_during_recovery (summed)":
        lambda r: _surviving_growth(r["recovery"]["ps_memory_kill_to_first_closure"]),
    f"restarted_ps{LOST_PS}_peak_rss_mb":
        lambda r: r["recovery"]["ps_memory_kill_to_first_closure"][f"ps:{LOST_PS}"]["rss_mb_peak"],
}
#: The figures whose ratios between modes are reported, and the pairs of modes compared.
RATIOS = ("kill_to_first_closure_s", "serving_to_first_closure_s", "psclient_last_recovery_s",
          "closures_rolled_back", "variables_restored", "progress_since_checkpoint_lost",
          "steps_after_recovery_to_within_1pct_of_loss_before_kill")
PAIRS = (("part", "all"), ("part_delta", "all"), ("part_delta", "part"))


def summarize(runs: dict) -> tuple[dict, dict]:
    """(mode -> figure -> median over its runs that ended, "a/b" -> ratios of those medians)."""
    summary = {}
    for mode, results in runs.items():
        ok = [r for r in results if "error" not in r]
        summary[mode] = {"runs": len(ok), "failed_runs": len(results) - len(ok)}
        for name, figure in FIGURES.items():
            values = [v for v in (figure(r) for r in ok) if v is not None]
            summary[mode][name] = None if not values else round(_common.median(values), 3)
    ratios = {}
    for top, bottom in PAIRS:
        if top in summary and bottom in summary:
            ratios[f"{top}/{bottom}"] = {
                name: None if summary[top].get(name) is None or not summary[bottom].get(name)
                else round(summary[top][name] / summary[bottom][name], 3) for name in RATIOS}
    return summary, ratios


def parent_main(args: argparse.Namespace, argv: list[str]) -> int:
    modes = args.modes.split(",")
    config = {
        **_common.environment(argv),
        "model": f"Embedding({args.rows}, {DIM}) -> GlobalAveragePooling1D -> Dense(1, frozen); "
                 f"SGD({LEARNING_RATE:g}), logistic loss",
        "table_mb": round(args.rows * DIM * 4 / 2**20, 1),
        "num_workers": NUM_WORKERS, "num_ps": NUM_PS, "lost_ps": LOST_PS,
        "partitioner": "psclient default (\"auto\": one shard per ps)",
        "data": f"{POOL} fixed examples of {IDS_PER_EXAMPLE} ids (uniform over the rows), random labels; "
                f"batch {BATCH}, step i trains batch i mod {POOL // BATCH}; seed {SEED}",
        "steps_before_checkpoint": args.steps_before, "steps_between_checkpoint_and_kill": args.steps_between,
        "steps_after_recovery": args.steps_after, "evaluation_every_steps": EVAL_EVERY,
        "quick": args.quick, "repeats": args.repeats, "order": [m for _ in range(args.repeats) for m in modes],
        "scratch": args.scratch,
        "strategy": {mode: f"ParameterServerStrategy(checkpoint_dir=..., "
                           f"{', '.join(f'{k}={v!r}' for k, v in MODE_OPTIONS[mode].items())}), other options default"
                     for mode in modes},
        "kill": f"SIGKILL ps {LOST_PS} after a join (no closure running), an evaluation scheduled at once, "
                "then LocalCluster.restart (same address)",
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
    }
    runs: dict = {mode: [] for mode in modes}
    env = _common.quiet_tf_env()
    started = time.perf_counter()
    with _common.stop_on_sigterm():
        for repeat in range(args.repeats):
            for mode in modes:  # interleaved: a change in the machine's load falls on each
                child = [os.path.abspath(__file__), "--_child", mode, "--rows", str(args.rows),
                         "--steps-before", str(args.steps_before), "--steps-between", str(args.steps_between),
                         "--steps-after", str(args.steps_after), "--scratch", args.scratch,
                         "--closure-timeout", str(args.closure_timeout)]
                tag = f"{mode} (run {repeat + 1}/{args.repeats})"
                _common.log(f"{tag}: starting (a LocalCluster of {NUM_WORKERS} workers, {NUM_PS} ps)")
                try:
                    result = _common.run_child(child, timeout=args.child_timeout, env=env)
                except _common.ChildError as error:
                    _common.log(f"{tag} FAILED: {error}")
                    result = {"error": str(error)}
                else:
                    recovery = result["recovery"]
                    _common.log(f"{tag}: kill -> serving {recovery['kill_to_serving_s']:.2f} s -> first closure "
                                f"{recovery['serving_to_first_closure_s']:.2f} s later; progress lost "
                                f"{result['loss']['progress_since_checkpoint_lost']}")
                runs[mode].append(result)
    config["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    config["wall_s"] = round(time.perf_counter() - started, 1)
    summary, ratios = summarize(runs)
    output = {"benchmark": "ps_recovery", "config": config, "summary": summary, "ratios": ratios, "runs": runs}
    _common.print_json(output, also_to=args.output)
    return 1 if any("error" in r for results in runs.values() for r in results) else 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help=f"small size: {QUICK['rows']} rows and fewer steps (flags given still apply)")
    parser.add_argument("--rows", type=int, help=f"table rows (default {DEFAULTS['rows']}: 538 MB)")
    parser.add_argument("--steps-before", type=int, help="steps before the checkpoint")
    parser.add_argument("--steps-between", type=int, help="steps between the checkpoint and the kill")
    parser.add_argument("--steps-after", type=int, help="steps scheduled after the kill")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of: {', '.join(MODES)}")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each mode, interleaved (medians reported)")
    parser.add_argument("--scratch", default=tempfile.gettempdir(), help="where the checkpoints are written")
    parser.add_argument("--closure-timeout", type=float, default=600.0, help="seconds a join or result may take")
    parser.add_argument("--child-timeout", type=float, default=1500.0, help="seconds per mode before it is killed")
    parser.add_argument("--output", help="also write the JSON to this file")
    parser.add_argument("--_child", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    sizes = QUICK if args.quick else DEFAULTS
    for name, default in sizes.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be an integer >= 1. Received: {getattr(args, name)}.")
    if args._child:
        try:
            child_main(args)  # Exits the process.
        except BaseException:
            traceback.print_exc()
            _common.child_exit(None, status=1)
    if args.repeats < 1:
        parser.error(f"--repeats must be an integer >= 1. Received: {args.repeats}.")
    modes = args.modes.split(",")
    if not modes or any(m not in MODES for m in modes) or len(set(modes)) != len(modes):
        parser.error(f"--modes must be a comma-separated subset of {','.join(MODES)}. Received: {args.modes!r}.")
    return _common.run_parent(parent_main, args, __file__, argv)


if __name__ == "__main__":
    sys.exit(main())
