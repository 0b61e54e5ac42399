"""Seeded chaos plans: worker kills, hangs and a ps kill, overlapping, while batches run.

Each seed draws one plan over --duration seconds on a fresh LocalCluster (3
workers, --ps ps tasks, 1 by default; the strategy with hang_timeout=3, checkpoint_every=200
(--plan-checkpoint-every) and a checkpoint_dir, deltas between them with
--plan-delta-checkpoint-every; --big-rows N adds an [N, 32] float table on each ps,
64 rows scattered a step, which every checkpoint then copies before its cut; --table-capacity C a
DynamicEmbedding(32, capacity=C) trained with Adagrad by each step, 64 keys drawn from 10 C): --kills worker SIGKILLs, each restarted after 0.5-3 s;
--hangs worker SIGSTOPs of 4-6 s, ended with SIGCONT from this process;
--ps-kills ps SIGKILLs, each restarted at once; --ps-hangs ps SIGSTOPs of 4-6 s,
ended with SIGCONT as a worker's (the workers' steps wait on the ps meanwhile). Times are uniform, so faults
overlap (a hang during a kill, the ps killed while a worker is out). Meanwhile
the main thread schedules batches of --batch closures (a small update of a ps
variable and a count of the steps) and joins each, until the plan has run; with
--fit it runs Keras `fit` of --batch steps each instead (benchmarks/chaos_fit.py,
the optimizer's step count as the counter).

Per seed, one JSON row: the plan; futures scheduled, resolved, failed,
cancelled and unresolved; each distinct error (type and first line) that
reached a future or join, with its count; for each fault, how long after it
ended (the task restarted and serving again, or resumed) the task was back
in use (a worker up again, the ps recovered), null if it never was within
--recovery-timeout; the rejoin and ps recovery times psclient logged; the
longest stall of a coordinator thread that sleeps 50 ms; the count of steps
against the range the futures allow. Progress on stderr.

Usage:
  nice -n 10 python benchmarks/chaos.py --seeds 20 --output benchmarks/results/chaos_seeds.json
  nice -n 10 python benchmarks/chaos.py --seeds 3-5 --duration 60
"""

from __future__ import annotations

import faulthandler
import gc
import json
import logging
import os
import random
import re
import subprocess
import sys
import tempfile
import traceback
import threading
import time

from _common import log

PLAN_WORKERS, PLAN_PS = 3, 1
BIG_DIM = 32  # --big-rows: the width of each ps's big table
#: --stall-traces: a sampler asleep this long has every thread's Python stack written.
TRACE_AFTER_S = 0.5
#: --stall-traces: a change of TF's view running this long gets every TCP socket written (`ss`)...
VIEW_CHANGE_SOCKETS_S = 8.0
#: ... and this long, every task's native stack (gdb, which stops each task it reads: _ViewChangeWatch).
VIEW_CHANGE_DUMP_S = 60.0
#: --stall-traces: a task not back this long after its fault ended gets every thread's stack written.
SLOW_BACK_S = 20.0
_NATIVE_DUMPS = threading.Lock()  # py-spy dumps of this process, one at a time
#: The longest a coordinator thread may stall (the limit of tests/faults/test_no_freeze.py).
MAX_STALL_S = 1.0


def draw_plan(seed: int, duration: float, kills: int, hangs: int, ps_kills: int,
              ps_hangs: int = 0, num_ps: int = PLAN_PS) -> list[dict]:
    """The seed's faults: [{"at", "fault", "task", "for"}], by time. With `num_ps` above 1 each
    ps fault falls on a ps drawn at random (with 1, the plans of earlier runs, draw for draw)."""
    rng = random.Random(seed)

    def a_ps() -> str:
        return f"ps:{rng.randrange(num_ps) if num_ps > 1 else 0}"

    end = max(5.0, duration - 10.0)  # the last fault leaves time to recover within the plan
    plan = [{"at": rng.uniform(3.0, end), "fault": "kill", "task": f"worker:{rng.randrange(PLAN_WORKERS)}",
             "for": rng.uniform(0.5, 3.0)} for _ in range(kills)]
    plan += [{"at": rng.uniform(3.0, end), "fault": "hang", "task": f"worker:{rng.randrange(PLAN_WORKERS)}",
              "for": rng.uniform(4.0, 6.0)} for _ in range(hangs)]
    plan += [{"at": rng.uniform(duration / 5, end), "fault": "kill", "task": a_ps(), "for": 0.0}
             for _ in range(ps_kills)]
    # Drawn after the others, so that a seed's plan without ps hangs is the one it always was.
    plan += [{"at": rng.uniform(3.0, end), "fault": "hang", "task": a_ps(), "for": rng.uniform(4.0, 6.0)}
             for _ in range(ps_hangs)]
    return [{k: round(v, 2) if isinstance(v, float) else v for k, v in f.items()}
            for f in sorted(plan, key=lambda f: f["at"])]


class _Logged(logging.Handler):
    """psclient's rejoin and ps recovery times, and how often a recovery step failed."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.rejoin_s: list[float] = []
        self.ps_recovery_s: list[float] = []
        self.step_failures: dict[str, int] = {}
        # A closure that reached a worker with a trace older than the newest ps recovery (parts.Prepare).
        self.traced_again = 0

    def emit(self, record):
        text = record.getMessage()
        if (m := re.search(r"rejoined \(([\d.]+) s after", text)):
            self.rejoin_s.append(float(m.group(1)))
        elif (m := re.search(r"recovered from .*\(([\d.]+) s after the task came back\)", text)):
            self.ps_recovery_s.append(float(m.group(1)))
        elif (m := re.match(r"recovery step (\w+) failed", text)):
            self.step_failures[m.group(1)] = self.step_failures.get(m.group(1), 0) + 1
        elif "with a trace made before a ps recovery" in text:
            self.traced_again += 1


class _Faults:
    """One thread per fault; a lock per task so two faults on one task take turns."""

    def __init__(self, local, strategy, plan, started, recovery_timeout, num_ps, slow_dir=None):
        self.local, self.strategy, self.plan = local, strategy, plan
        self.started, self.recovery_timeout = started, recovery_timeout
        self.slow_dir = slow_dir  # --stall-traces: every thread's stack when a task is slow to come back
        self.locks = {t: threading.Lock() for t in [f"worker:{w}" for w in range(PLAN_WORKERS)]
                      + [f"ps:{p}" for p in range(num_ps)]}
        self.results: list[dict] = []
        #: (start, end), monotonic, of each py-spy native dump of a slow task: it stops the process.
        self.native_pauses: list[tuple[float, float]] = []
        self.threads = [threading.Thread(target=self._run, args=(f,), daemon=True) for f in plan]

    def start(self):
        for thread in self.threads:
            thread.start()

    def alive(self):
        return any(t.is_alive() for t in self.threads)

    def _up(self, job, index, recoveries_before, completed_before=None):
        stats = self.strategy.stats()
        if completed_before is not None:  # a ps that hung: back when closures complete again
            return stats["completed"] > completed_before
        if job == "ps":
            return stats["ps"][index]["recoveries"] > recoveries_before
        return stats["workers"][index]["up"]

    def _run(self, fault):
        time.sleep(max(0.0, self.started + fault["at"] - time.monotonic()))  # the plan's own clock
        job, index = fault["task"].split(":")
        index = int(index)
        row = dict(fault)
        with self.locks[fault["task"]]:
            if not self.local.is_running(job, index):
                row["skipped"] = "not running"
                self.results.append(row)
                return
            recoveries = self.strategy.stats()["ps"][index]["recoveries"] if job == "ps" else None
            if fault["fault"] == "hang":
                # SIGCONT from another process: one from this process would wait
                # on the coordinator, whose threads a hung task may freeze.
                resumer = subprocess.Popen(["sh", "-c", f"sleep {fault['for']}; kill -CONT {self.local.pid(job, index)}"])
                self.local.stop(job, index)
                resumer.wait()
                self.local.resume(job, index)
            else:
                self.local.kill(job, index)
                time.sleep(fault["for"])
                try:
                    self.local.restart(job, index, timeout=300)
                except Exception as error:  # noqa: BLE001 - counted: the task stays down
                    row["restart_failed"] = f"{type(error).__name__}: {str(error)[:200]}"
                    self.results.append(row)
                    return
            ended = time.monotonic()
            completed = self.strategy.stats()["completed"] if fault["fault"] == "hang" and job == "ps" else None
            row["ended_at"] = round(ended - self.started, 2)
            deadline = ended + self.recovery_timeout
            slow = None
            if self.slow_dir is not None:  # the stats read below waits for a recovery: a timer dumps
                slow = threading.Timer(SLOW_BACK_S, self._dump_slow, args=(fault, ended))
                slow.daemon = True
                slow.start()
            # One look decides: a second one could find the task out again (a worker taken out
            # for a ps recovery just after it rejoined), counting a finished recovery as unfinished.
            while not (back := self._up(job, index, recoveries, completed)) and time.monotonic() < deadline:
                time.sleep(0.05)  # polling stats
            if slow is not None:
                slow.cancel()
            row["back_after_s"] = round(time.monotonic() - ended, 2) if back else None
        self.results.append(row)


    def _dump_slow(self, fault, ended):
        """Every thread's Python stack, once `fault`'s task has not been back for SLOW_BACK_S (seed
        431: a ps recovery and a rejoin waited 75 s, untold by the logs)."""
        os.makedirs(self.slow_dir, exist_ok=True)
        name = f"slow-{fault['fault']}-{fault['task'].replace(':', '')}-at-{fault['at']:.2f}.txt"
        with open(os.path.join(self.slow_dir, name), "w") as out:
            out.write(f"{fault} ended {ended - self.started:.2f} s into the plan; not back "
                      f"{time.monotonic() - ended:.1f} s later. Every thread:\n")
            out.flush()
            faulthandler.dump_traceback(out, all_threads=True)
        # TF's own stacks too (seed 500: the recovery's update_server_def waited 77 s inside TF, which
        # Python's stacks cannot show): py-spy where installed, bounded.
        try:
            with _NATIVE_DUMPS:  # one at a time: a second py-spy cannot suspend a process the first holds
                began = time.monotonic()
                try:
                    native = subprocess.run(["py-spy", "dump", "--native", "--pid", str(os.getpid())],
                                            capture_output=True, text=True, timeout=120)
                finally:
                    self.native_pauses.append((began, time.monotonic()))
            text = native.stdout + native.stderr
        except (OSError, subprocess.TimeoutExpired) as error:
            text = f"py-spy dump not taken: {error}"
        with open(os.path.join(self.slow_dir, name.replace(".txt", "-native.txt")), "w") as out:
            out.write(text)
        # And every task's (seed 527 of 2026-12-06: the coordinator's reconnect waited 54 s in TF's
        # CloseRemoteContexts, for a task's answer to a CloseContext: which task, and why, only the
        # tasks' own stacks can tell). Each dump stops only that task, for a moment.
        with open(os.path.join(self.slow_dir, name.replace(".txt", "-tasks.txt")), "w") as out:
            for job, count in (("worker", PLAN_WORKERS), ("ps", len(self.locks) - PLAN_WORKERS)):
                for index in range(count):
                    pid = self.local.pid(job, index) if self.local.is_running(job, index) else None
                    out.write(f"===== {job}:{index} pid {pid}\n")
                    if pid is None:
                        continue
                    try:
                        with _NATIVE_DUMPS:
                            began = time.monotonic()
                            try:  # counted as a pause too: seed 537's sampler stalled 1.1 s during such dumps
                                task = subprocess.run(["py-spy", "dump", "--native", "--pid", str(pid)],
                                                      capture_output=True, text=True, timeout=60)
                            finally:
                                self.native_pauses.append((began, time.monotonic()))
                        out.write(task.stdout + task.stderr)
                    except (OSError, subprocess.TimeoutExpired) as error:
                        out.write(f"py-spy dump not taken: {error}\n")


def _step(strategy, num_ps, big_rows=0, table_capacity=0, table_dim=BIG_DIM):
    import tensorflow as tf

    with strategy.scope():  # placed in turn: each ps holds weights
        weights = [tf.Variable(tf.random.stateless_normal([64, 64], seed=[1, 2 + p]) / 8) for p in range(num_ps)]
        # --big-rows: a table on each ps above one checkpoint row chunk, a few rows scattered a step,
        # so that every checkpoint copies it before its cut while the faults go on.
        tables = [tf.Variable(tf.zeros([big_rows, BIG_DIM])) for _ in range(num_ps if big_rows else 0)]
        counted = tf.Variable(0, dtype=tf.int64)
    x = tf.random.stateless_normal([32, 64], seed=[3, 4])
    dynamic = _dynamic_model(strategy, table_capacity, table_dim) if table_capacity else None

    @tf.function
    def step():
        for w in weights:
            w.assign_sub(0.001 * tf.matmul(tf.transpose(x), tf.tanh(x @ w)) / 32)
        for table in tables:
            rows = tf.random.uniform([64], 0, big_rows, dtype=tf.int64)
            table.scatter_add(tf.IndexedSlices(tf.fill([64, BIG_DIM], 0.001), rows))
        if dynamic is not None:
            model, optimizer = dynamic
            keys = tf.random.uniform([64, 1], 0, 10 * table_capacity, dtype=tf.int64)  # admissions, evictions
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(model(keys, training=True) ** 2)  # training: keys admitted, rows trained
            optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        counted.assign_add(1)
        return counted.read_value()

    return step, counted


def _dynamic_model(strategy, capacity: int, dim: int = BIG_DIM):
    """--table-capacity: a DynamicEmbedding(--table-dim, capacity) + Adagrad trained by every step; above
    one row chunk a ps, each checkpoint copies its shards before the cut and packs them in the write
    (rows of 8 floats: gathered and each stage emptied; 32: in place)."""
    import keras

    import psclient

    with strategy.scope():
        ids = keras.Input([1], dtype="int64")
        layer = psclient.layers.DynamicEmbedding(dim, capacity=capacity, name="chaos_table")
        model = keras.Model(ids, keras.layers.Dense(1)(keras.layers.Flatten()(layer(ids))))
        optimizer = keras.optimizers.Adagrad(0.05)
        optimizer.build(model.trainable_variables)
    return model, optimizer


def _ps_index(variable) -> int:
    return int(re.search(r"/job:ps/replica:0/task:(\d+)", variable.device).group(1))


def _read_once_ps_up(strategy, variable, limit: float):
    """(value, None), or (None, the error) after `limit` s: `variable` read on the coordinator once
    every ps answers and holds its variables again. The plan's last fault may be a ps kill whose
    recovery is still under way when the steps end (seed 660 of 2026-12-07: the read failed with
    "connection refused" and ended the whole run); a read on the coordinator during an outage gets
    TF's error (docs/fault_tolerance.md), so it is tried again until `limit`."""
    import tensorflow as tf

    deadline = time.monotonic() + limit
    while True:
        error = "a ps still lost"
        if all(ps["up"] for ps in strategy.stats(read_ps=False)["ps"]):
            try:
                return variable.numpy(), None
            except tf.errors.OpError as failed:  # the ps lost again meanwhile: its recovery comes
                error = f"{type(failed).__name__}: {str(failed).splitlines()[0][:200]}"
        if time.monotonic() >= deadline:
            return None, error
        time.sleep(0.2)  # polling the recovery (no event to wait on from here)


def run_seed(seed: int, args) -> dict:
    import psclient

    num_ps = args.ps
    plan = getattr(args, "plan_faults", None)  # --plan; an empty one is a run without faults
    if plan is None:
        plan = draw_plan(seed, args.duration, args.kills, args.hangs, args.ps_kills, args.ps_hangs, num_ps)
    log(f"seed {seed}: {len(plan)} faults: " + ", ".join(f"{f['fault']} {f['task']}@{f['at']}" for f in plan))
    logged = _Logged()
    logging.getLogger("psclient").addHandler(logged)
    errors: dict[str, int] = {}
    join_errors: list[str] = []
    join_error_texts: list[str] = []  # the whole message (TF's root error sits below its first line)
    join_error_tracebacks: list[str] = []
    futures = []
    join_s: list[float] = []
    stall = [0.0, None]  # the longest stall, and when it ended (seconds into the plan)
    stalls: list[tuple[float, float]] = []  # every wait of the sampler above 0.2 s: (start, end), monotonic
    with psclient.LocalCluster(num_workers=PLAN_WORKERS, num_ps=num_ps,
                               start_method=args.start_method) as local, \
            tempfile.TemporaryDirectory() as ckpt:
        strategy = psclient.ParameterServerStrategy(
            local.cluster, hang_timeout=3.0, checkpoint_dir=ckpt, checkpoint_every=args.checkpoint_every,
            dynamic_table_storage=args.table_storage,
            delta_checkpoint_every=getattr(args, "delta_checkpoint_every", None),
            **({"ps_recovery": args.ps_recovery} if getattr(args, "ps_recovery", None) else {}),
            replicas_to_aggregate=getattr(args, "replicas_to_aggregate", None))
        sampling = threading.Event()

        watch = None
        if getattr(args, "stall_dumps", None):  # --stall-dumps: a watchdog dumps the threads during a stall
            watch = subprocess.Popen(
                [sys.executable, os.path.join(os.path.dirname(__file__), "stall_watch.py"), str(os.getpid()),
                 str(MAX_STALL_S), os.path.join(args.stall_dumps, f"seed-{seed}")], stdin=subprocess.PIPE)

        traces = None
        if getattr(args, "stall_traces", None):  # --stall-traces: Python stacks during a stall, no pause
            traces = StallTraces(os.path.join(args.stall_traces, f"seed-{seed}", "traces.txt"))

        def sample():  # a coordinator thread that wants to wake every 50 ms
            last = time.monotonic()
            watched = watch is not None
            while not sampling.wait(0.05):
                if traces is not None:
                    traces.arm()
                if watched:
                    try:
                        watch.stdin.write(b".")
                        watch.stdin.flush()
                    except OSError:  # the watchdog ended (killed): sample on without it
                        watched = False
                now = time.monotonic()
                if now - last - 0.05 > 0.2:
                    stalls.append((last + 0.05, now))
                    if traces is not None:
                        traces.stalled(last + 0.05, now, started, gc_spans)
                if now - last - 0.05 > stall[0]:
                    stall[0], stall[1] = now - last - 0.05, now - started
                last = now

        gc_pause = [0.0, None]  # Python's longest garbage collection: a stall of every thread too
        gc_spans: list[tuple[float, float]] = []  # collections of 50 ms or more: (start, end), monotonic

        def timed_gc(phase, info):
            if phase == "start":
                gc_pause[1] = time.monotonic()
            elif gc_pause[1] is not None:
                gc_pause[0] = max(gc_pause[0], time.monotonic() - gc_pause[1])
                if time.monotonic() - gc_pause[1] >= 0.05:
                    gc_spans.append((gc_pause[1], time.monotonic()))

        gc.callbacks.append(timed_gc)
        sampler = threading.Thread(target=sample, daemon=True)
        faults = views = None
        try:
            fit = served = None
            if getattr(args, "fit", False):  # --fit: Keras fit trains through the plan (chaos_fit)
                import chaos_fit

                serve_every = getattr(args, "serve_every", None)
                fit, counted, served, fit_model = chaos_fit.build(
                    strategy, args.table_capacity, args.table_dim, seed,
                    serve_dir=os.path.join(ckpt, "serving") if serve_every else None, serve_every=serve_every)
            else:
                step, counted = _step(strategy, num_ps, args.big_rows, args.table_capacity, args.table_dim)
            fit_steps = [0, 0]  # --fit: steps asked for, steps of the fits that returned
            started = time.monotonic()
            faults = _Faults(local, strategy, plan, started, args.recovery_timeout, num_ps,
                             slow_dir=os.path.join(args.stall_traces, f"seed-{seed}") if traces else None)
            faults.start()
            sampler.start()
            views = _ViewChangeWatch(local, os.path.join(args.stall_traces, f"seed-{seed}")) if traces else None
            # New batches while the plan runs (and its last faults recover, for
            # recovery_timeout at most); each join may take join_timeout.
            stop_at = started + args.duration + args.recovery_timeout
            while (time.monotonic() < started + args.duration or faults.alive()) and time.monotonic() < stop_at:
                joined = time.monotonic()
                try:
                    if fit is not None:
                        fit_steps[0] += args.batch
                        fit(args.batch, args.join_timeout)
                        fit_steps[1] += args.batch
                    else:
                        futures += [strategy.schedule(step) for _ in range(args.batch)]
                        strategy.join(timeout=args.join_timeout)
                except TimeoutError:
                    join_errors.append(f"TimeoutError: join did not return within {args.join_timeout:g} s")
                    break
                except Exception as error:  # noqa: BLE001 - recorded per seed
                    join_errors.append(f"{type(error).__name__}: {str(error).splitlines()[0][:200]}")
                    join_error_texts.append(f"{type(error).__name__}: {str(error)[:4000]}")
                    # Where it was raised: a closure's error, or a call made on the coordinator (seed 442).
                    join_error_tracebacks.append(traceback.format_exc()[-6000:])
                join_s.append(time.monotonic() - joined)
            wall = time.monotonic() - started
            serving = None
            if served is not None and not join_errors:
                # One more step, so the chain ends with what training holds (its last delta or full
                # version), then the loader read against the cluster model.
                try:
                    fit_steps[0] += 1
                    fit(1, args.join_timeout)
                    fit_steps[1] += 1
                    serving = served.check(fit_model)
                except Exception as error:  # noqa: BLE001 - recorded per seed
                    join_errors.append(f"{type(error).__name__} (serving check): {str(error).splitlines()[0][:200]}")
            elif served is not None:
                serving = {"skipped": "a fit failed: the served chain need not end with what training holds"}
            for future in futures:
                if future.done() and not future.cancelled() and future.exception() is not None:
                    error = future.exception()
                    key = f"{type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}"
                    errors[key] = errors.get(key, 0) + 1
            stats = strategy.stats()
            ok = sum(f.done() and not f.cancelled() and f.exception() is None for f in futures) + fit_steps[1]
            scheduled = len(futures) + fit_steps[0]
            retried = sum(w["retried"] for w in stats["workers"])
            value, read_error = (None, None) if stats.get("broken") else _read_once_ps_up(
                strategy, counted, args.recovery_timeout)
            # Not a scalar: its ps's variables were left uninitialized (a recovery that restored nothing,
            # docs/fault_tolerance.md); or not read at all (the read's error): recorded under
            # counter_read_not_a_scalar, the seed not clean, the other seeds still run.
            steps = int(value) if value is not None and value.ndim == 0 else None
            counter_read = read_error if value is None else None if value.ndim == 0 else repr(value)[:200]
            # A ps recovered alone ("part") rolls back only its own variables: the count loses what
            # the ps that holds it rolled back.
            low = ok - stats["ps"][_ps_index(counted)]["rolled_back_closures"]
            high = low + retried + (scheduled - ok)
            k = getattr(args, "replicas_to_aggregate", None)
            if k:  # the optimizer counts updates, one per k gradients, and late gradients are dropped
                low, high = 0, -(-(scheduled + retried) // k)
        finally:
            sampling.set()
            gc.callbacks.remove(timed_gc)
            if traces is not None:
                if sampler.is_alive():
                    sampler.join(5)
                traces.close()
            if watch is not None:
                if sampler.is_alive():
                    sampler.join(5)
                try:
                    watch.stdin.close()
                except OSError:  # it ended already
                    pass
                watch.wait(120)
            if faults is not None:
                for thread in faults.threads:
                    thread.join(args.recovery_timeout + 330)
            if served is not None:
                served.close()
            strategy.shutdown()
            if views is not None:
                views.close()  # after the shutdown: its disconnect changes TF's view too
            logging.getLogger("psclient").removeHandler(logged)
    row = {
        "seed": seed,
        "plan": plan,
        "futures_scheduled": scheduled,  # with --fit: the fits' steps
        "futures_resolved": ok,
        "futures_failed": sum(errors.values()) + fit_steps[0] - fit_steps[1],
        "futures_cancelled": sum(f.cancelled() for f in futures),
        "futures_unresolved": sum(not f.done() for f in futures),
        "errors": errors,
        "join_errors": join_errors,
        "join_error_texts": join_error_texts,
        "join_error_tracebacks": join_error_tracebacks,
        "faults": sorted(faults.results, key=lambda r: r["at"]),
        "recoveries_unfinished": sum(1 for r in faults.results
                                     if "back_after_s" in r and r["back_after_s"] is None),
        "rejoin_s": logged.rejoin_s,
        "ps_recovery_s": logged.ps_recovery_s,
        "ps_recoveries": [p["recoveries"] for p in stats["ps"]],
        "ps_rolled_back_closures": [p["rolled_back_closures"] for p in stats["ps"]],
        "recovery_step_failures": logged.step_failures,
        "traced_again_warnings": logged.traced_again,
        "max_stall_s": round(stall[0], 2),
        # py-spy's native dumps (--stall-dumps) stop the process while they read it (about 1.7 s a
        # dump here under load): the longest stall without the dumps' spans, a lower bound (a span
        # also holds py-spy's start, while the process still runs); max_stall_s is the upper one.
        # So do the slow-task dumps of --stall-traces (seeds 516 and 518 of 2026-12-06: 7.9 and 8.1 s, each
        # the span of such a dump on a machine loaded by a test run).
        **({"max_stall_without_dumps_s": round(_without_pauses(
            stalls, (_dump_pauses(args, seed) if getattr(args, "stall_dumps", None) else []) + faults.native_pauses,
            stall[0]), 2)} if getattr(args, "stall_dumps", None) or faults.native_pauses else {}),
        "max_stall_ended_at_s": None if stall[1] is None else round(stall[1], 1),
        "max_gc_pause_s": round(gc_pause[0], 2),
        # Python objects the coordinator's collector walks, once this seed's cluster is gone: what
        # earlier seeds (strategies, ps recoveries) left behind makes every collection longer.
        "coordinator_objects": _tracked_objects(),
        "batches": len(join_s),
        "max_join_s": round(max(join_s), 2) if join_s else None,
        "steps_counted": steps,
        "counter_read_not_a_scalar": counter_read,
        "steps_counted_range": [low, high],
        "retried_closures": retried,
        "steps_counted_in_range": steps is not None and low <= steps <= high,
        "sync": ({key: stats["staleness"].get(key) for key in ("count", "updates", "dropped")}
                 | {"repeats": stats["staleness"].get("sync", {}).get("repeats")} if k else None),
        "wall_s": round(wall, 1),
        "checkpoints_written": stats.get("checkpoints_written"),
        "checkpoint_cost": stats.get("checkpoints"),
        # TF's view changes (connects, reconnects) of this process so far, every seed before this one
        # included (`stats()["cluster_view"]` is the process's: TF's view is): counts, longest.
        "view_changes_in_process": stats.get("cluster_view"),
        # --stall-traces: each change of TF's view that ran VIEW_CHANGE_SOCKETS_S or more, with when its
        # dumps began and ended and when it ended (seconds into the change).
        "view_change_timelines": None if views is None else views.timelines,
    }
    if served is not None:
        row["serving"] = serving
    log(f"seed {seed}: {ok}/{scheduled} resolved, {row['futures_failed']} failed, "
        f"{row['futures_cancelled']} cancelled, {row['futures_unresolved']} unresolved, errors {errors}, "
        f"join {join_errors}, unfinished recoveries {row['recoveries_unfinished']}, stall {row['max_stall_s']} s "
        f"(gc {row['max_gc_pause_s']} s), "
        f"wall {row['wall_s']} s")
    return row


def read_plan(path: str, num_ps: int) -> list[dict]:
    """A fixed plan from the JSON file `path` (--plan), run for every seed instead of the drawn one:
    a list of faults {"at": seconds into the plan, "fault": "kill" or "hang", "task": "worker:N" or
    "ps:N", "for": a worker kill's restart delay or a hang's length, in seconds}, by time.
    ValueError names the fault and what was wrong."""
    with open(path) as file:
        try:
            faults = json.load(file)
        except json.JSONDecodeError as error:
            raise ValueError(f"--plan {path} is not JSON: {error}") from None
    if not isinstance(faults, list):
        raise ValueError(f"--plan {path} holds {type(faults).__name__}; expected a list of faults")
    limits = {"worker": PLAN_WORKERS, "ps": num_ps}
    for i, fault in enumerate(faults):
        where = f"--plan {path}, fault {i}"
        if not isinstance(fault, dict) or set(fault) != {"at", "fault", "task", "for"}:
            raise ValueError(f"{where}: received {fault!r}; expected an object with exactly the keys "
                             "'at', 'fault', 'task' and 'for'")
        job, _, index = str(fault["task"]).partition(":")
        if job not in limits or not index.isdigit() or int(index) >= limits[job]:
            raise ValueError(f"{where}: received task {fault['task']!r}; expected 'worker:N' with N below "
                             f"{PLAN_WORKERS} or 'ps:N' with N below {num_ps} (--ps)")
        if fault["fault"] not in ("kill", "hang"):
            raise ValueError(f"{where}: received fault {fault['fault']!r}; expected 'kill' or 'hang'")
        for key in ("at", "for"):
            if isinstance(fault[key], bool) or not isinstance(fault[key], (int, float)) or fault[key] < 0:
                raise ValueError(f"{where}: received {key} {fault[key]!r}; expected a number of seconds >= 0")
    return sorted(faults, key=lambda f: f["at"])


class _ViewChangeWatch:
    """--stall-traces: what a long change of TF's view of the cluster waits on. At VIEW_CHANGE_SOCKETS_S
    every TCP socket with its queues (`ss`: stops nothing); at VIEW_CHANGE_DUMP_S every task's whole
    native stack (gdb: TF's own threads too, which py-spy does not show). And when the change ends,
    a timeline (`view-change-N-timeline.txt`, and `timelines` for the seed's JSON row).

    gdb stops the task it reads, and seven gdbs at once on the 2-core machine took 137-175 s to read
    seven TF processes: the three view changes of 144.5, 155.1 and about 182 s (seeds 579, 604 and
    660) each ended within a second or two of the last gdb detaching, their dumps having begun 8 s
    into the change. Those waits were mostly these dumps' own (docs/chaos.md); so the dumps now
    wait for a change that is long before any dump stops a task."""

    def __init__(self, local, directory: str):
        from psclient._coordinator import connection

        self._local, self._directory, self._changes = local, directory, connection.connection_changes
        self.timelines: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos-view-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        seen, since, timeline = None, time.monotonic(), None
        while not self._stop.wait(0.25):
            changes = self._changes()
            if changes != seen:
                if timeline is not None:  # a change that ran long ended
                    self._ended(timeline, time.monotonic() - since)
                seen, since, timeline = changes, time.monotonic(), None
                continue
            waited = time.monotonic() - since
            if not changes % 2 or waited < VIEW_CHANGE_SOCKETS_S:
                continue
            if timeline is None:
                timeline = {"change": changes, "sockets_at_s": round(waited, 1)}
                os.makedirs(self._directory, exist_ok=True)
                self._sockets(changes, "before-gdb")
            if waited >= VIEW_CHANGE_DUMP_S and "dumps_began_at_s" not in timeline:
                timeline["dumps_began_at_s"] = round(waited, 1)
                self._dump(changes)
                timeline["dumps_ended_at_s"] = round(time.monotonic() - since, 1)
                self._sockets(changes, "after-gdb")

    def _ended(self, timeline: dict, took: float) -> None:
        timeline["ended_at_s"] = round(took, 1)
        self.timelines.append(timeline)
        with open(os.path.join(self._directory, f"view-change-{timeline['change']}-timeline.txt"), "w") as file:
            file.write(f"{timeline}\n")

    def _dump(self, changes: int) -> None:
        tasks = [(job, index, self._local.pid(job, index)) for job, index, _ in self._local.cluster.tasks()
                 if self._local.is_running(job, index)]

        def dump(job, index, pid):
            path = os.path.join(self._directory, f"view-change-{changes}-{job}{index}-gdb.txt")
            try:
                out = subprocess.run(["gdb", "-p", str(pid), "-batch", "-nx", "-iex", "set auto-load safe-path /",
                                      "-ex", "set pagination off", "-ex", "thread apply all bt 40"],
                                     capture_output=True, text=True, timeout=180)
                text = out.stdout + out.stderr
            except (OSError, subprocess.TimeoutExpired) as error:
                text = f"gdb not run: {error}"
            with open(path, "w") as file:
                file.write(f"{job}:{index} pid {pid}, TF's view change {changes} running {VIEW_CHANGE_DUMP_S} s\n{text}")

        threads = [threading.Thread(target=dump, args=task, daemon=True) for task in tasks]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(200)

    def _sockets(self, changes: int, when: str) -> None:
        """Every TCP socket on the machine with its queues and owner (`ss -tnpi`): whether the view
        change's RPC sits unsent in the coordinator's send queue, unread in a task's receive queue,
        or is gone (seed 604 of 2026-12-07 waited 155 s with every task idle, as seed 579 had)."""
        try:
            out = subprocess.run(["ss", "-tnpi"], capture_output=True, text=True, timeout=20)
            text = out.stdout + out.stderr
        except (OSError, subprocess.TimeoutExpired) as error:
            text = f"ss not run: {error}"
        pids = {f"{job}:{index}": self._local.pid(job, index) for job, index, _ in self._local.cluster.tasks()
                if self._local.is_running(job, index)}
        with open(os.path.join(self._directory, f"view-change-{changes}-sockets-{when}.txt"), "w") as file:
            file.write(f"coordinator pid {os.getpid()}, tasks {pids}\n{text}")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(400)


def _stall_without_dumps(row: dict) -> float:
    return row.get("max_stall_without_dumps_s", row["max_stall_s"])


def _dump_pauses(args, seed: int) -> list[tuple[float, float]]:
    """The watchdog's dumps of this seed, (start, end) on the machine's monotonic clock."""
    path = os.path.join(args.stall_dumps, f"seed-{seed}", "pauses.txt")
    if not os.path.exists(path):
        return []
    with open(path) as lines:
        return [(float(a), float(b)) for a, b in (line.split() for line in lines if line.strip())]


def _tracked_objects() -> int:
    gc.collect()
    return len(gc.get_objects())


class StallTraces:
    """--stall-traces: every thread's Python stack, written while a sampler thread stalls.

    faulthandler's own C thread writes the stacks once the sampler has not re-armed it (`arm`, at
    each wake) for `after_s`, and again every `after_s` while it stays asleep: it needs no GIL and
    stops nothing, where py-spy's native dumps (--stall-dumps) stop the process while they read it.
    Each stall of `after_s` or more is then labelled below its dumps (`stalled`)."""

    def __init__(self, path: str, after_s: float = TRACE_AFTER_S):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        self.after_s = after_s
        self._file = open(path, "w")

    def arm(self) -> None:
        faulthandler.dump_traceback_later(self.after_s, repeat=True, file=self._file)

    def stalled(self, start: float, end: float, origin: float, gc_spans: list[tuple[float, float]]) -> None:
        """A stall from `start` to `end` (monotonic) ended: label the dumps above, with the time of it
        spent in garbage collections (`gc_spans`: (start, end) of each) and seconds from `origin`."""
        if end - start < self.after_s:
            return
        in_gc = sum(max(0.0, min(stop, end) - max(begin, start)) for begin, stop in gc_spans)
        self._file.write(f"== stall of {end - start:.2f} s, {start - origin:.2f}-{end - origin:.2f} s into "
                         f"the plan, {in_gc:.2f} s of it in garbage collections (the dumps above)\n")
        self._file.flush()

    def close(self) -> None:
        faulthandler.cancel_dump_traceback_later()
        self._file.close()


def _without_pauses(stalls: list[tuple[float, float]], pauses: list[tuple[float, float]],
                    longest: float = 0.0) -> float:
    """The longest of `stalls` once the time that overlaps `pauses` is taken out; `longest` (the
    longest stall, kept apart from `stalls` when below their 0.2 s floor) when there was no pause."""
    if not pauses:
        return max([longest] + [end - start for start, end in stalls])
    return max((end - start - sum(max(0.0, min(end, b) - max(start, a)) for a, b in pauses)
                for start, end in stalls), default=0.0)


def parse_seeds(text: str) -> list[int]:
    """`20` (seeds 0-19), `3-7` (inclusive) or `1,4,9`; ValueError naming --seeds when that holds no seed
    (`--seeds 0` ran nothing and said nothing: seed 0 alone is `0-0` or `0,`)."""
    try:
        if "," in text:
            seeds = [int(s) for s in text.split(",") if s.strip()]
        elif "-" in text:
            first, last = text.split("-")
            seeds = list(range(int(first), int(last) + 1))
        else:
            seeds = list(range(int(text)))
    except ValueError:
        seeds = []
    if not seeds:
        raise ValueError(f"--seeds holds no seed: received {text!r}; expected a count N >= 1 (seeds 0 to N-1), "
                         "a range A-B with A <= B, or a list A,B,C (seed 0 alone: 0-0)")
    return seeds


def summarise(rows: list[dict]) -> dict:
    clean = [r for r in rows if not (r["futures_failed"] or r["futures_cancelled"] or r["futures_unresolved"]
                                     or r["join_errors"] or r["recoveries_unfinished"]
                                     or r.get("counter_read_not_a_scalar")
                                     or ("serving" in r and not (r["serving"] or {}).get("matches_model")))]
    back = [f["back_after_s"] for r in rows for f in r["faults"] if f.get("back_after_s") is not None]
    errors: dict[str, int] = {}
    for r in rows:
        for key, count in r["errors"].items():
            errors[key] = errors.get(key, 0) + count
        for key in r["join_errors"]:
            errors["join: " + key] = errors.get("join: " + key, 0) + 1
    return {
        "seeds": len(rows),
        "seeds_clean": len(clean),
        "futures_scheduled": sum(r["futures_scheduled"] for r in rows),
        "futures_resolved": sum(r["futures_resolved"] for r in rows),
        "futures_failed": sum(r["futures_failed"] for r in rows),
        "futures_cancelled": sum(r["futures_cancelled"] for r in rows),
        "futures_unresolved": sum(r["futures_unresolved"] for r in rows),
        "recoveries_unfinished": sum(r["recoveries_unfinished"] for r in rows),
        "errors": errors,
        "back_after_s_median": sorted(back)[len(back) // 2] if back else None,
        "back_after_s_max": max(back) if back else None,
        "traced_again_warnings": sum(r.get("traced_again_warnings", 0) for r in rows),
        "coordinator_objects_first_last": [rows[0]["coordinator_objects"], rows[-1]["coordinator_objects"]]
        if rows and "coordinator_objects" in rows[0] else None,
        "max_stall_s": max((r["max_stall_s"] for r in rows), default=None),
        # A seed without a dump stalled as long with or without them.
        **({"max_stall_without_dumps_s": max(_stall_without_dumps(r) for r in rows),
            "seeds_stalled_without_dumps": [r["seed"] for r in rows if _stall_without_dumps(r) >= MAX_STALL_S]}
           if any("max_stall_without_dumps_s" in r for r in rows) else {}),
        # A coordinator thread that sleeps 50 ms must never wait 1 s more (tests/faults/test_no_freeze.py's limit).
        "max_stall_limit_s": MAX_STALL_S,
        "seeds_stalled": [r["seed"] for r in rows if r["max_stall_s"] >= MAX_STALL_S],
        "max_join_s": max((r["max_join_s"] or 0 for r in rows), default=None),
        "steps_counted_in_range": all(r["steps_counted_in_range"] for r in rows),
        **({"serving_seeds_matching": sum(bool((r["serving"] or {}).get("matches_model")) for r in rows),
            "serving_failed_deltas": sum(len((r["serving"] or {}).get("failed_deltas", [])) for r in rows)}
           if any("serving" in r for r in rows) else {}),
    }
