"""One coordinator, many workers: psclient's coordinator logic against a simulated cluster.

The real `Scheduler`, `Dispatcher` (one thread per worker), `Prober` and
`Recovery` (its state machine and thread) run in one process against
`benchmarks/_sim.py`'s fake of the TensorFlow edge: a call sleeps the
worker's step time (10 ms by default, +-20% jitter, 5% of workers 3x slower);
deaths and hangs are injected on workers and at times drawn from the seed.
No TensorFlow is imported. Each size runs in its own subprocess, in phases:

  own_path    psclient's own code per closure on one thread (Closure, Future,
              submit, take, prepare, a no-op call, succeeded): no contention
  scheduler_alone  one thread per worker taking closures from the Scheduler and
              reporting them done at once (the first measurement)
  fake_only   the same threads calling the fake step in a loop, no psclient:
              the simulation's own CPU per call (subtracted to estimate
              psclient's own share)
  steady      closures submitted as fast as the workers take them (a bounded
              number in flight), no failures: closures/s, process CPU per
              closure, threads, memory, the cost of one Scheduler.stats()
  idle        no work for a few seconds: threads created, CPU per second
  failures    the same load while `--deaths` workers die (and restart after
              1.5 s) and `--hangs` workers hang (and resume after 4 s):
              seconds until each is taken out, until its closures ran again,
              and whether every future resolved exactly once with its value

Closures enter at `Scheduler.submit` (a `Closure` and a `Future` per call):
`strategy.schedule`'s tracing and argument handling are TensorFlow's and not
part of this. CPU figures are the whole process's (`time.process_time`),
simulation included.

Usage:
  python benchmarks/scale.py [--sizes 10,100,1000] [--duration 8] [--seed 0]
                             [--deaths 2] [--hangs 2] [--hang-timeout 2]

Prints one JSON object (progress on stderr) and saves it as
benchmarks/results/scale-<date>.json. Exits 0 when every size ran, whether
or not the targets are met; 1 if any failed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.dirname(_HERE)]  # _common, _sim, and the psclient of this checkout
import _common  # noqa: E402

#: The targets (simulated, 1,000 workers, 10 ms fake step).
TARGETS = {
    "closures_per_s_at_1000": 50_000,
    "cpu_us_per_closure_psclient": 20.0,
    "threads_over_workers": "small constant, none created per tick",
    "detected_within_s": "hang_timeout + 1",
}


def _median(values):
    values = sorted(values)
    return values[len(values) // 2] if values else None


def fake_only(config, seconds: float) -> dict:
    """CPU per call of the fake step alone: one thread per worker calling it in a loop."""
    import _sim

    sim = _sim.SimCluster(config)
    stop = threading.Event()
    counts = [0] * config.workers

    def loop(worker):
        while not stop.is_set():
            sim.call(worker, None)
            counts[worker] += 1

    threads = [threading.Thread(target=loop, args=(w,), daemon=True) for w in range(config.workers)]
    for t in threads:
        t.start()
    time.sleep(0.5)  # every thread running
    calls0, cpu0, t0 = sum(counts), time.process_time(), time.monotonic()
    time.sleep(seconds)  # the measured window: a duration, not synchronisation
    calls, cpu, wall = sum(counts) - calls0, time.process_time() - cpu0, time.monotonic() - t0
    stop.set()
    for t in threads:
        t.join(30)
    return {"calls_per_s": round(calls / wall), "cpu_us_per_call": round(cpu / max(calls, 1) * 1e6, 2),
            "threads_left": sum(t.is_alive() for t in threads)}


def scheduler_alone(workers: int, seconds: float) -> dict:
    """The first measurement: one thread per worker taking closures from
    the real Scheduler and reporting them done at once (no calls, no dispatch)."""
    from psclient._core.future import Future
    from psclient._core.closure import Closure
    from psclient._core.scheduler import Scheduler

    scheduler = Scheduler(workers)

    def dispatcher(worker):
        while (closure := scheduler.take(worker)) is not None:
            scheduler.succeeded(worker, closure, None)

    threads = [threading.Thread(target=dispatcher, args=(w,), daemon=True) for w in range(workers)]
    for t in threads:
        t.start()
    n, cpu0, t0 = 0, time.process_time(), time.monotonic()
    while time.monotonic() - t0 < seconds:
        for _ in range(100):
            scheduler.submit(Closure(None, (), {}, Future("f")))
        n += 100
        if n - scheduler.completed() > 2000:
            scheduler.join(60)
    scheduler.join(60)
    wall, cpu = time.monotonic() - t0, time.process_time() - cpu0
    scheduler.close()
    for t in threads:
        t.join(30)
    return {"closures_per_s": round(n / wall), "cpu_us_per_closure": round(cpu / n * 1e6, 2),
            "wakeups_per_closure": round(scheduler.wakeups / n, 3),
            "threads_left": sum(t.is_alive() for t in threads)}


def own_path(workers: int, closures: int = 20000) -> dict:
    """psclient's own code per closure, on one thread (no contention, no sleep):
    Closure and Future, submit, take, the dispatcher's prepare and call of a
    no-op function, succeeded (the future resolved). With `workers` workers."""
    import _sim
    from psclient._core.future import Future
    from psclient._core.closure import Closure
    from psclient._core.scheduler import Scheduler

    scheduler = Scheduler(workers)
    sim = _sim.SimCluster(_sim.SimConfig(workers=workers))
    noop = lambda value: value  # noqa: E731 - the call, without its step
    cpu0 = time.process_time()
    for n in range(closures):
        scheduler.submit(Closure(None, (n,), {}, Future("f")))
        worker = n % workers
        closure = scheduler.take(worker, timeout=0)
        _, args, kwargs = sim.prepare(closure, worker)
        scheduler.succeeded(worker, closure, sim.to_numpy(noop(*args, **kwargs)), attempt=closure.attempts)
    cpu = time.process_time() - cpu0
    return {"cpu_us_per_closure": round(cpu / closures * 1e6, 2), "closures": closures}


def drive(harness, seconds: float, workers: int, sample) -> tuple[int, float, float]:
    """Submit closures for `seconds`, 2-3 per worker in flight. Returns
    (completed, wall s, process CPU s) over the window."""
    done0, cpu0, t0 = harness.scheduler.completed(), time.process_time(), time.monotonic()
    harness.submit_for(seconds, high=3 * workers, low=2 * workers, sample=sample)
    return harness.scheduler.completed() - done0, time.monotonic() - t0, time.process_time() - cpu0


def child(args) -> dict:
    import _sim

    config = _sim.SimConfig(workers=args.workers, seed=args.seed, step_s=args.step_ms / 1000,
                            hang_timeout=args.hang_timeout, resume_after=args.hang_timeout + 1.0,
                            pipeline_depth=1)
    result: dict = {"workers": args.workers, "own_path": own_path(args.workers),
                    "scheduler_alone": scheduler_alone(args.workers, 3.0),
                    "fake_only": fake_only(config, min(3.0, args.duration))}
    rss0 = _sim.rss_mib()
    harness = _sim.Harness(config)
    errors: list[str] = []
    default_hook = threading.excepthook

    def hook(info):
        errors.append(f"{info.thread.name if info.thread else '?'}: {info.exc_type.__name__}: {info.exc_value}")
        default_hook(info)

    threading.excepthook = hook
    peak = {"threads": 0, "rss_mib": 0.0}

    def sample():
        peak["threads"] = max(peak["threads"], threading.active_count())
        peak["rss_mib"] = max(peak["rss_mib"], _sim.rss_mib())

    try:
        harness.start()
        drive(harness, 1.0, args.workers, sample)  # warm-up
        completed, wall, cpu = drive(harness, args.duration, args.workers, sample)
        stats_s = []
        for _ in range(5):
            t = time.perf_counter()
            harness.scheduler.stats()
            stats_s.append(time.perf_counter() - t)
        coordinator_threads = harness.dispatcher.alive_threads + 1 + harness.prober.threads
        result["steady"] = {
            "closures": completed, "seconds": round(wall, 2),
            "closures_per_s": round(completed / wall),
            "cpu_us_per_closure": round(cpu / max(completed, 1) * 1e6, 2),
            "cpu_us_per_closure_minus_fake": round(
                cpu / max(completed, 1) * 1e6 - result["fake_only"]["cpu_us_per_call"], 2),
            "cpu_cores_used": round(cpu / wall, 2),
            "threads_coordinator": coordinator_threads,
            "threads_process_peak": peak["threads"],
            "rss_mib_peak": round(peak["rss_mib"], 1),
            "rss_mib_added": round(peak["rss_mib"] - rss0, 1),
            "stats_call_ms": round(_median(stats_s) * 1000, 3),
        }
        # Idle: nothing scheduled; what the coordinator still does.
        harness.scheduler.join(60)
        started0 = harness.prober.threads_started
        names0 = {t.ident for t in threading.enumerate()}
        cpu0, t0 = time.process_time(), time.monotonic()
        time.sleep(args.idle)  # the measured window: a duration, not synchronisation
        idle_cpu, idle_wall = time.process_time() - cpu0, time.monotonic() - t0
        result["idle"] = {
            "seconds": round(idle_wall, 2),
            "cpu_ms_per_s": round(idle_cpu / idle_wall * 1000, 1),
            "probe_threads_started": harness.prober.threads_started - started0,
            "new_threads_alive": len({t.ident for t in threading.enumerate()} - names0),
            "threads_coordinator": harness.dispatcher.alive_threads + 1 + harness.prober.threads,
        }
        # Failures under the same load.
        # One at a time, in an order and on workers drawn from the seed, each
        # over (a hung one resumes after hang_timeout + 1 s) before the next.
        rng = random.Random(args.seed + 1)
        victims = rng.sample(range(args.workers), min(args.workers // 2, args.deaths + args.hangs))
        kinds = ["death"] * args.deaths + ["hang"] * args.hangs
        rng.shuffle(kinds)
        spacing = config.resume_after + 1.0
        start = time.monotonic() + 1.0
        for i, (kind, worker) in enumerate(zip(kinds, victims)):
            harness.inject(kind, worker, start + i * spacing + rng.uniform(0, 0.5))
        completed, wall, cpu = drive(harness, max(args.duration, 2.0 + len(kinds) * spacing),
                                     args.workers, sample)
        ok = harness.scheduler.join(120)
        report = harness.failure_report()
        stats = harness.scheduler.stats()
        detected = [r["detected_s"] for r in report]
        rerun = [r["rerun_elsewhere_s"] for r in report if r["rerun_elsewhere_s"] is not None]
        result["failures"] = {
            "closures_per_s": round(completed / wall),
            "cpu_us_per_closure": round(cpu / max(completed, 1) * 1e6, 2),
            "injected": report,
            "detected_s_max": max((d for d in detected if d is not None), default=None),
            "undetected": sum(d is None for d in detected),
            "rerun_s_max": max(rerun, default=None),
            "hang_timeout": args.hang_timeout,
            "stale_reports": stats["stale_reports"],
            "all_joined": ok,
            "futures": harness.submitted,
            "every_future_once_with_its_value": bool(ok and harness.every_future_once()),
            "threads_process_peak": peak["threads"],
            "rss_mib_peak": round(peak["rss_mib"], 1),
        }
        result["wakeups_per_closure"] = round(harness.scheduler.wakeups / max(harness.submitted, 1), 3)
    finally:
        left = harness.stop(60)
        threading.excepthook = default_hook
    result["threads_left_after_stop"] = left
    result["thread_errors"] = errors
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="10,100,1000")
    parser.add_argument("--duration", type=float, default=8.0, help="seconds per measured phase")
    parser.add_argument("--idle", type=float, default=3.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--deaths", type=int, default=2)
    parser.add_argument("--hangs", type=int, default=2)
    parser.add_argument("--hang-timeout", type=float, default=2.0)
    parser.add_argument("--step-ms", type=float, default=10.0)
    parser.add_argument("--output", default=None, help="where to save the JSON (default benchmarks/results/)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--workers", type=int, default=10, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _common.exit_with_parent()
        _common.child_exit(child(args))
    sizes = [int(s) for s in args.sizes.split(",")]
    output = {"config": {**_common.environment(sys.argv), "sizes": sizes, "duration_s": args.duration,
                         "seed": args.seed, "deaths": args.deaths, "hangs": args.hangs,
                         "hang_timeout_s": args.hang_timeout, "step_ms": args.step_ms},
              "targets": TARGETS, "runs": {}}
    failed = False
    for size in sizes:
        _common.log(f"{size} workers")
        argv = [os.path.abspath(__file__), "--child", "--workers", str(size), "--duration", str(args.duration),
                "--idle", str(args.idle), "--seed", str(args.seed), "--deaths", str(args.deaths),
                "--hangs", str(args.hangs), "--hang-timeout", str(args.hang_timeout),
                "--step-ms", str(args.step_ms)]
        try:
            run = _common.run_child(argv, timeout=60 + 10 * args.duration + size / 20)
        except _common.ChildError as error:
            failed = True
            run = {"error": str(error)}
        output["runs"][str(size)] = run
        _common.log(json.dumps({k: run.get(k) for k in ("steady", "error")})[:600])
    _common.print_json(output)
    saved = args.output or os.path.join(_HERE, "results", f"scale-{time.strftime('%Y-%m-%d')}.json")
    os.makedirs(os.path.dirname(saved), exist_ok=True)
    with open(saved, "w") as f:
        json.dump(output, f, indent=2)
        f.write("\n")
    _common.log(f"saved {saved}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
