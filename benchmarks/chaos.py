"""Training through failures: workers and a ps killed and restarted while steps run.

Three runs of the same job (1 ps, 3 workers: `--ps`, `--workers`; --steps scheduled training steps of
a small MLP on fixed random data, each on a fresh `psclient.LocalCluster`, one
strategy with `checkpoint_dir` and the default hang/worker timeouts):

  clean         no faults: the reference for wall time and final loss
  worker_chaos  every --interval seconds (seeded jitter) a random up worker is
                SIGKILLed and restarted at the same address
  ps_chaos      the ps is SIGKILLed once, a third of the way in, and restarted
  elastic       2 -> 4 -> 3 workers while training: the strategy starts on 2
                workers; a third of the way in `strategy.add_worker` adds two
                more (their task processes were started before training, so
                the phase does not time TensorFlow's import), two thirds in
                `remove_worker(0, drain=True)` retires one; the throughput of
                each phase, the time of each add and of the drain, and the
                optimizer's step count (exactly --steps: no step lost or doubled)

Prints one JSON object (progress on stderr): for each run, futures scheduled
vs resolved, errors surfaced, retried closures, kills, rejoin times (from a
restart, i.e. the task serving again, to that worker's first completed closure),
ps recovery time and steps rolled back, wall time and final loss, plus ratios
to the clean run and the targets (0 futures lost, 0 errors, 0 hangs,
median rejoin <= 2 s, ps recovery <= 15 s). Also the coordinator's CPU per
step and its Python threads at peak, and a count of the steps that ran: each
step also adds one to a counter on a ps, which must end between the steps
that count (scheduled minus those a ps recovery rolled back) and that plus
the retried closures (a closure cut off by a kill may have counted before).
The clean, worker and ps runs use --workers workers; the elastic run its own counts.

With --seeds, seeded chaos plans instead (kills, hangs and ps kills that
overlap, while batches of closures are scheduled and joined): one row per
seed and a summary (benchmarks/chaos_plans.py).

Usage:
  python benchmarks/chaos.py [--steps 3000] [--seed 0] > chaos.json
  nice -n 10 python benchmarks/chaos.py --seeds 20 --output benchmarks/results/chaos_seeds.json
  python benchmarks/chaos.py --workers 16 --ps 4 > chaos-16x4.json
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import environment, log, median, print_json  # noqa: E402

DEFAULT_WORKERS, DEFAULT_PS = 3, 1
#: How long a restarted task may take to serve (TensorFlow's import on a loaded machine).
RESTART_TIMEOUT_S = 300.0
ELASTIC_START, ELASTIC_SPARES = 2, 2  # the elastic run: 2 -> 4 -> 3 workers
TARGETS = {"futures_lost": 0, "errors_surfaced": 0, "hangs": 0, "median_rejoin_s": 2.0, "ps_recovery_s": 15.0}


#: psclient's log lines with the time and the thread: what a recovery waited on is read from their order.
LOG_FORMAT = "%(asctime)s.%(msecs)03d %(threadName)s %(levelname)s %(name)s: %(message)s"

def build(strategy):
    import keras
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(0)
    x = rng.normal(size=(1024, 64)).astype("float32")
    y = (x @ rng.normal(size=(64, 1)) / 8).astype("float32")
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((64,)), keras.layers.Dense(512, "relu"), keras.layers.Dense(512, "relu"),
            keras.layers.Dense(1),
        ])
        optimizer = keras.optimizers.SGD(0.01)
        optimizer.build(model.trainable_variables)
        counted = tf.Variable(0, dtype=tf.int64, name="steps_counted")
    # Every worker reads all the data (its own shuffle order), so a worker out
    # of rotation does not hide part of it and final losses compare training.
    iterator = iter(strategy.distribute_datasets_from_function(
        lambda ctx: tf.data.Dataset.from_tensor_slices((x, y))
        .shuffle(1024, seed=ctx.input_pipeline_id).repeat().batch(256)
    ))

    @tf.function
    def step(it):
        features, labels = next(it)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(features) - labels) ** 2)
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        counted.assign_add(1)
        return loss

    def final_loss():
        return float(np.mean((model(x).numpy() - y) ** 2))

    final_loss.steps = lambda: int(optimizer.iterations.numpy())  # steps applied on the ps
    return step, iterator, final_loss, counted


class Chaos:
    """The thread that kills and restarts tasks; owned and joined by `run`."""

    def __init__(self, local, strategy, mode: str, seed: int, interval: float, total_steps: int):
        self.local, self.strategy, self.mode = local, strategy, mode
        self.rng = random.Random(seed)
        self.interval, self.total_steps = interval, total_steps
        self.stop = threading.Event()
        self.kills: list[str] = []
        self.rejoin_s: list[float] = []
        self.unrejoined = 0
        #: Restarts that did not serve within RESTART_TIMEOUT_S (the task stays down).
        self.restarts_failed: list[str] = []
        self.watchers: list[threading.Thread] = []
        #: elastic: the spare workers' addresses, and what happened when.
        self.spares: list[str] = []
        self.marks: list[tuple[str, float, int]] = []  # (event, monotonic time, completed steps)
        self.add_s: list[float] = []
        self.remove_s: float | None = None
        self.thread = threading.Thread(target=self._run, name="chaos", daemon=True)

    def _completed(self):
        return self.strategy.stats()["completed"]

    def _wait(self, predicate, timeout):
        deadline = time.monotonic() + timeout
        while not predicate():
            if self.stop.is_set() or time.monotonic() > deadline:
                return False
            time.sleep(0.01)  # polling stats, the benchmark's own clock
        return True

    def _mark(self, event: str) -> None:
        self.marks.append((event, time.monotonic(), self._completed()))

    def _elastic(self):
        """2 -> 4 -> 3 workers (module docstring)."""
        self._mark("start")
        if not self._wait(lambda: self._completed() >= self.total_steps // 3, 600):
            return
        self._mark("adding")
        for address in self.spares:
            started = time.monotonic()
            index = self.strategy.add_worker(address)
            self.add_s.append(time.monotonic() - started)
            log(f"elastic: worker {index} ({address}) added in {self.add_s[-1]:.2f} s")
        self._mark("added")
        if not self._wait(lambda: self._completed() >= 2 * self.total_steps // 3, 600):
            return
        self._mark("removing")
        started = time.monotonic()
        self.strategy.remove_worker(0, drain=True)
        self.remove_s = time.monotonic() - started
        self._mark("removed")
        log(f"elastic: worker 0 drained and removed in {self.remove_s:.2f} s")
        self.local.kill("worker", 0)  # out of TF's view: its process may go

    def _run(self):
        if self.mode == "elastic":
            self._elastic()
            return
        if self.mode == "ps_chaos":
            self._wait(lambda: self._completed() >= self.total_steps // 3, 600)
            if not self.stop.is_set():
                self.local.kill("ps", 0)
                self.kills.append("ps:0")
                self._restart("ps", 0)
            return
        while not self.stop.wait(self.interval * self.rng.uniform(0.7, 1.3)):
            stats = self.strategy.stats()["workers"]
            up = [w for w in range(len(stats)) if stats[w]["up"]]
            if len(up) < 2:
                continue  # keep one worker at least; the test suite covers all-gone
            worker = self.rng.choice(up)
            killed = time.monotonic()
            self.local.kill("worker", worker)
            self.kills.append(f"worker:{worker}")
            # Wait until psclient noticed, so "rejoin" measures a real return.
            self._wait(lambda: not self.strategy.stats()["workers"][worker]["up"], 30)
            noticed = time.monotonic()
            if not self._restart("worker", worker):  # returns once the task serves again
                continue
            log(f"{self.mode}: killed worker {worker}; taken out after {noticed - killed:.2f} s, "
                f"restarted (serving) after {time.monotonic() - killed:.2f} s")
            watcher = threading.Thread(target=self._time_rejoin, args=(worker, time.monotonic()),
                                       name=f"chaos-rejoin{worker}", daemon=True)
            watcher.start()
            self.watchers.append(watcher)

    def _restart(self, job: str, index: int) -> bool:
        from psclient import TaskUnreachableError

        try:
            self.local.restart(job, index, timeout=RESTART_TIMEOUT_S)
        except TaskUnreachableError as error:
            # A loaded machine (16 workers on 2 cores) can take minutes to
            # import TensorFlow; count it rather than end the chaos.
            log(f"{self.mode}: restarting {job} {index} failed: {str(error).splitlines()[0]}")
            self.restarts_failed.append(f"{job}:{index}")
            return False
        return True

    def _time_rejoin(self, worker: int, restarted: float) -> None:
        """Seconds from the restart to that worker's first completed closure."""
        done = self.strategy.stats()["workers"][worker]["done"]
        if self._wait(lambda: self.strategy.stats()["workers"][worker]["done"] > done, 60):
            self.rejoin_s.append(time.monotonic() - restarted)
        elif not self.stop.is_set():
            self.unrejoined += 1

    def join(self) -> None:
        self.stop.set()
        for thread in [self.thread, *self.watchers]:
            if thread.is_alive():
                thread.join(120)


def run(mode: str, args) -> dict:
    import psclient

    workers = ELASTIC_START if mode == "elastic" else args.workers
    log(f"{mode}: starting a cluster ({workers} workers, {args.ps} ps)")
    with psclient.LocalCluster(num_workers=workers, num_ps=args.ps, start_method="spawn") as local, \
            tempfile.TemporaryDirectory() as ckpt:
        cluster = local.cluster  # the strategy starts on these workers
        spares = []
        for _ in range(ELASTIC_SPARES if mode == "elastic" else 0):
            index = local.add_worker()  # started now, added to the strategy a third of the way in
            spares.append(local.cluster.address("worker", index))
        strategy = psclient.ParameterServerStrategy(
            cluster, checkpoint_dir=ckpt, checkpoint_interval=args.checkpoint_interval,
        )
        chaos = None
        try:
            step, iterator, final_loss, counted = build(strategy)
            chaos = Chaos(local, strategy, mode, args.seed, args.interval, args.steps)
            chaos.spares = spares
            peak_threads = [threading.active_count()]
            sampling = threading.Event()

            def sample():  # the coordinator's Python threads, every 50 ms (this one not counted)
                while not sampling.wait(0.05):
                    peak_threads[0] = max(peak_threads[0], threading.active_count() - 1)

            sampler = threading.Thread(target=sample, name="thread-sampler", daemon=True)
            sampler.start()
            started, cpu0 = time.monotonic(), time.process_time()
            if mode != "clean":
                chaos.thread.start()
            futures = [strategy.schedule(step, args=(iterator,)) for _ in range(args.steps)]
            hung = False
            try:
                strategy.join(timeout=args.timeout)
            except TimeoutError:
                hung = True
            except Exception as error:  # noqa: BLE001 - counted below, per future
                log(f"{mode}: join raised {type(error).__name__}: {error}")
            wall, cpu = time.monotonic() - started, time.process_time() - cpu0
            sampling.set()
            sampler.join()
            chaos.join()
            resolved = sum(f.done() for f in futures)
            errors = sum(1 for f in futures if f.done() and (f.cancelled() or f.exception() is not None))
            stats = strategy.stats()
            ps = stats["ps"][0]  # the one ps_chaos kills
            retried = sum(w["retried"] for w in stats["workers"])
            counts = len(futures) - ps["rolled_back_closures"]
            steps_counted = int(counted.numpy())
            result = {
                "steps_scheduled": len(futures),
                "futures_resolved": resolved,
                "futures_lost": len(futures) - resolved,
                "errors_surfaced": errors,
                "hangs": int(hung),
                "kills": len(chaos.kills),
                "killed": chaos.kills,
                "retried_closures": retried,
                "steps_counted": steps_counted,
                "steps_counted_in_range": counts <= steps_counted <= counts + retried,
                "rejoins": sum(w["rejoins"] for w in stats["workers"]),
                "rejoin_s": [round(s, 3) for s in chaos.rejoin_s],
                "median_rejoin_s": median(chaos.rejoin_s),
                "max_rejoin_s": max(chaos.rejoin_s) if chaos.rejoin_s else None,
                "workers_never_rejoined": chaos.unrejoined,
                "restarts_failed": chaos.restarts_failed,
                "ps_recoveries": ps["recoveries"],
                "ps_recovery_s": ps["last_recovery_s"],
                "steps_rolled_back": ps["rolled_back_closures"],
                "checkpoints_written": stats["checkpoints_written"],
                "wall_s": round(wall, 2),
                "steps_per_s": round(args.steps / wall, 1),
                "coordinator_cpu_us_per_step": round(cpu / args.steps * 1e6, 1),
                "coordinator_python_threads_peak": peak_threads[0],
                "final_loss": final_loss(),
            }
            if mode == "elastic":
                result.update(_elastic_result(chaos, started + wall, stats, final_loss.steps()))
            log(f"{mode}: {result['futures_resolved']}/{len(futures)} resolved, {errors} errors, "
                f"{len(chaos.kills)} kills, wall {wall:.1f} s, coordinator "
                f"{result['coordinator_cpu_us_per_step']:.0f} us/step, {peak_threads[0]} Python threads at peak, "
                f"{steps_counted} steps counted ({retried} retried, {ps['rolled_back_closures']} rolled back)")
            return result
        finally:
            if chaos is not None:
                chaos.join()
            strategy.shutdown()


def _elastic_result(chaos: Chaos, ended: float, stats: dict, steps_applied: int) -> dict:
    """Each phase's steps and throughput, the adds and the drain, the step count on the ps."""
    marks = {event: (at, done) for event, at, done in chaos.marks}
    completed = stats["completed"]
    bounds = [("start", "adding", ELASTIC_START), ("added", "removing", ELASTIC_START + ELASTIC_SPARES),
              ("removed", None, ELASTIC_START + ELASTIC_SPARES - 1)]
    phases = []
    for begin, end, workers in bounds:
        if begin not in marks or (end is not None and end not in marks):
            continue  # the run ended before this phase
        (t0, c0), (t1, c1) = marks[begin], marks[end] if end else (ended, completed)
        phases.append({"workers": workers, "steps": c1 - c0, "seconds": round(t1 - t0, 2),
                       "steps_per_s": round((c1 - c0) / (t1 - t0), 1) if t1 > t0 else None})
    return {
        "phases": phases,
        # Steps completed while the adds and the drain ran (between the phases).
        "steps_while_adding": marks["added"][1] - marks["adding"][1] if "added" in marks else None,
        "steps_while_draining": marks["removed"][1] - marks["removing"][1] if "removed" in marks else None,
        "add_worker_s": [round(s, 3) for s in chaos.add_s],
        "remove_worker_drain_s": None if chaos.remove_s is None else round(chaos.remove_s, 3),
        "steps_applied_on_ps": steps_applied,
        "workers_at_end": {str(i): w["done"] for i, w in enumerate(stats["workers"]) if not w["retired"]},
        "done_per_worker": [w["done"] for w in stats["workers"]],
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--interval", type=float, default=3.0, help="seconds between worker kills (jittered)")
    parser.add_argument("--checkpoint-interval", type=float, default=5.0)
    parser.add_argument("--timeout", type=float, default=900.0, help="a run that takes longer counts as a hang")
    parser.add_argument("--runs", default="clean,worker_chaos,ps_chaos,elastic")
    parser.add_argument("--output", help="also write the JSON here")
    parser.add_argument("--workers", type=int, default=DEFAULT_WORKERS, help="workers of each run's LocalCluster")
    parser.add_argument("--ps", type=int, default=DEFAULT_PS, help="ps tasks of each run's LocalCluster")
    plans = parser.add_argument_group("seeded plans (--seeds)")
    plans.add_argument("--seeds", help="run seeded chaos plans: N (seeds 0..N-1), A-B or A,B,C")
    plans.add_argument("--start-method", choices=("spawn", "forkserver"), default="spawn",
                       help="how the plans' LocalCluster starts its tasks (forkserver: restarted within "
                            "a fraction of a second, as a real cluster's never are; spawn: as before)")
    plans.add_argument("--duration", type=float, default=60.0, help="seconds of faults per plan")
    plans.add_argument("--kills", type=int, default=4, help="worker SIGKILLs per plan (restarted)")
    plans.add_argument("--hangs", type=int, default=2, help="worker SIGSTOPs of 4-6 s per plan")
    plans.add_argument("--ps-kills", type=int, default=1, help="ps SIGKILLs per plan (restarted)")
    plans.add_argument("--ps-hangs", type=int, default=0, help="ps SIGSTOPs of 4-6 s per plan")
    plans.add_argument("--plan-checkpoint-every", dest="checkpoint_every", type=int, default=200,
                       help="closures between the strategy's checkpoints")
    plans.add_argument("--plan-delta-checkpoint-every", dest="delta_checkpoint_every", type=int, default=None,
                       help="closures between delta checkpoints (StrategyConfig.delta_checkpoint_every; "
                            "default: none, full checkpoints only)")
    plans.add_argument("--plan", metavar="FILE",
                       help="a fixed plan (JSON: a list of {at, fault: kill|hang, task: worker:N|ps:N, for}) "
                            "run for every seed instead of the drawn one: to run a seed's order again "
                            "(its row's 'plan'), or a chosen one")
    plans.add_argument("--ps-recovery", choices=("part", "all"), default=None,
                       help="StrategyConfig.ps_recovery (default: psclient's, 'part' in asynchronous training)")
    plans.add_argument("--replicas-to-aggregate", type=int, default=None,
                       help="with --fit: synchronous training, each update the mean of K workers' gradients "
                            "(StrategyConfig.replicas_to_aggregate; it recovers a ps with 'all')")
    plans.add_argument("--big-rows", type=int, default=0,
                       help="rows of a 32-wide table on each ps (0: none); above 65,536 a checkpoint copies "
                            "it before its cut")
    plans.add_argument("--table-capacity", type=int, default=0,
                       help="capacity of a DynamicEmbedding(32) trained by each step (0: none); above 65,536 "
                            "rows a ps a checkpoint copies its shards before its cut")
    plans.add_argument("--table-dim", type=int, default=32,
                       help="width of that table's rows (8: rows of 32 bytes, which a checkpoint packs by gathers)")
    plans.add_argument("--table-storage", choices=("dense", "hash"), default="dense",
                       help="StrategyConfig.dynamic_table_storage of that table (hash: every checkpoint exports it "
                            "before its cut, its writes noting their keys meanwhile)")
    plans.add_argument("--batch", type=int, default=300, help="closures scheduled, then joined, per batch")
    plans.add_argument("--fit", action="store_true",
                       help="Keras fit trains through the plan (benchmarks/chaos_fit.py): each batch one "
                            "fit(steps_per_epoch=--batch) of a model with the --table-capacity table")
    plans.add_argument("--serve-every", type=float, default=None,
                       help="with --fit: a psclient.ServingExport through the plan, a delta every S seconds "
                            "and a full version every 10 S, served by a loader in this process and checked "
                            "against the cluster model at the end (benchmarks/chaos_fit.py)")
    plans.add_argument("--stall-dumps", metavar="DIR",
                       help="a watchdog process dumps the coordinator's threads (py-spy dump --native) into "
                            "DIR/seed-N/ whenever the sampler thread stalls 1 s (benchmarks/stall_watch.py)")
    plans.add_argument("--stall-traces", metavar="DIR",
                       help="faulthandler writes every coordinator thread's Python stack into "
                            "DIR/seed-N/traces.txt whenever the sampler thread sleeps 0.5 s past its wake, "
                            "again every 0.5 s while it does; unlike --stall-dumps it stops nothing; and "
                            "DIR/seed-N/slow-*.txt once a faulted task is not back 20 s after its fault ended")
    plans.add_argument("--join-timeout", type=float, default=180.0,
                       help="a join of one batch that takes longer counts as a hang")
    plans.add_argument("--recovery-timeout", type=float, default=120.0,
                       help="a task not back in use this long after its fault ended counts as unfinished")
    args = parser.parse_args(argv)
    if args.seeds is not None:
        import chaos_plans

        try:
            args.seed_list = chaos_plans.parse_seeds(args.seeds)
        except ValueError as error:
            parser.error(str(error))
        if args.serve_every is not None and (not args.fit or args.serve_every <= 0):
            parser.error(f"--serve-every needs --fit and a number of seconds > 0. Received: "
                         f"--serve-every {args.serve_every:g}{'' if args.fit else ' without --fit'}.")
        args.plan_faults = None
        if args.plan is not None:
            try:
                args.plan_faults = chaos_plans.read_plan(args.plan, args.ps)
            except (OSError, ValueError) as error:
                parser.error(str(error))
        if args.replicas_to_aggregate is not None and not args.fit:
            parser.error(f"--replicas-to-aggregate needs --fit (the plans' own step updates its variables "
                         f"directly, which synchronous training refuses). Received: --replicas-to-aggregate "
                         f"{args.replicas_to_aggregate} without --fit.")
        return _seeded(args)
    if args.workers < 2:
        parser.error(f"--workers must be >= 2 (worker_chaos keeps one up). Received: {args.workers}.")
    if args.ps < 1:
        parser.error(f"--ps must be >= 1. Received: {args.ps}.")

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import logging

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format=LOG_FORMAT, datefmt="%H:%M:%S")
    logging.getLogger("psclient").setLevel(logging.INFO)
    results = {mode: run(mode, args) for mode in args.runs.split(",")}
    clean = results.get("clean")
    summary = {}
    for mode, result in results.items():
        if mode == "clean":
            continue
        row = {
            "futures_lost": result["futures_lost"],
            "errors_surfaced": result["errors_surfaced"],
            "hangs": result["hangs"],
            "steps_counted_in_range": result["steps_counted_in_range"],
        }
        if clean:
            row["wall_time_vs_clean"] = round(result["wall_s"] / clean["wall_s"], 2)
            row["final_loss_vs_clean"] = round(result["final_loss"] / clean["final_loss"], 3)
        if mode == "worker_chaos":
            row["median_rejoin_s"] = result["median_rejoin_s"]
            row["max_rejoin_s"] = result["max_rejoin_s"]
            row["meets_rejoin_target"] = (
                result["median_rejoin_s"] is not None and result["median_rejoin_s"] <= TARGETS["median_rejoin_s"])
        if mode == "elastic":
            row["phases_steps_per_s"] = {f"{p['workers']} workers": p["steps_per_s"] for p in result["phases"]}
            row["steps_applied_on_ps"] = result["steps_applied_on_ps"]
            row["no_step_lost_or_doubled"] = result["steps_applied_on_ps"] == result["steps_scheduled"]
        if mode == "ps_chaos":
            row["ps_recovery_s"] = result["ps_recovery_s"]
            row["steps_rolled_back"] = result["steps_rolled_back"]
            row["meets_recovery_target"] = (
                result["ps_recovery_s"] is not None and result["ps_recovery_s"] <= TARGETS["ps_recovery_s"])
        row["meets_no_loss_targets"] = (row["futures_lost"] == 0 and row["errors_surfaced"] == 0
                                        and row["hangs"] == 0 and row["steps_counted_in_range"])
        summary[mode] = row
    output = {"benchmark": "chaos", "config": {**environment(sys.argv), **vars(args)},
              "targets": TARGETS, "runs": results, "summary": summary}
    print_json(output, also_to=args.output)
    return 0


def _seeded(args) -> int:
    import logging

    import chaos_plans

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format=LOG_FORMAT, datefmt="%H:%M:%S")
    logging.getLogger("psclient").setLevel(logging.INFO)
    rows = []
    for seed in args.seed_list:
        rows.append(chaos_plans.run_seed(seed, args))
        if args.output:  # each seed as it ends: a long run that is stopped keeps its rows
            print_json({"benchmark": "chaos_plans", "config": {**environment(sys.argv), **vars(args)},
                        "summary": chaos_plans.summarise(rows), "seeds": rows}, also_to=args.output)
    if not args.output:
        print_json({"benchmark": "chaos_plans", "config": {**environment(sys.argv), **vars(args)},
                    "summary": chaos_plans.summarise(rows), "seeds": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
