"""How long `psclient demo` takes to exit after Ctrl-C, on a loaded machine, and what it waits for.

Each run starts `--load` busy processes (plain Python loops at normal priority: a machine busy
with other jobs), then `nice -n 19 python -m psclient demo --epochs 400` in a new directory, waits
for its `--at-epoch`-th epoch line (a random one of 2 to 6 with `--at-epoch 0`: SIGINT at another
point of training each run), sends SIGINT and measures the seconds to its exit, its exit status,
the lines it printed after the interrupt, and which processes it started were still there when
it exited (with how long after its exit each was gone; one still there 30 s later is killed). A
run still alive `--dump-after` s after the interrupt is dumped with `py-spy dump` (when installed)
once: the JSON keeps the main thread's frames, i.e. what it waits for then.

    python benchmarks/demo_interrupt.py --runs 5 --load 2     # about 3 minutes on 2 cores

Prints one JSON object: every run, and the exit times' median and maximum against the demo's own
deadline (60 s after the interrupt, then it SIGKILLs what it started and exits 130).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import psutil

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import environment  # noqa: E402

_BUSY = "import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end:\n    pass\n"


def _lines(stream, into: queue.Queue) -> None:
    for line in iter(stream.readline, ""):
        into.put((time.monotonic(), line.rstrip("\n")))
    into.put((time.monotonic(), None))


def _main_thread_frames(pid: int) -> list[str] | str:
    """The main thread's Python frames (innermost first) from `py-spy dump`, or why there are none."""
    spy = shutil.which("py-spy")
    if spy is None:
        return "py-spy not installed"
    try:
        dump = subprocess.run([spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        return "py-spy dump did not finish within 60 s"
    frames, inside = [], False
    for line in dump.stdout.splitlines():
        if line.startswith("Thread "):
            inside = '"MainThread"' in line
        elif inside and line.strip():
            frames.append(line.strip())
    return frames or (dump.stderr.strip() or "no main thread in the dump")


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _left_behind(pids: dict, limit: float) -> list[dict]:
    """The demo's processes still there when it exited: each with its command and how long after
    the demo's exit it was gone (None: still there `limit` s later; the benchmark then kills it)."""
    exited = time.monotonic()
    alive = {pid: command for pid, command in pids.items() if _alive(pid)}
    gone_after: dict = {}
    while len(gone_after) < len(alive) and time.monotonic() - exited < limit:
        for pid in alive:
            if pid not in gone_after and not _alive(pid):
                gone_after[pid] = round(time.monotonic() - exited, 2)
        time.sleep(0.05)
    return [{"pid": pid, "command": command, "gone_after_s": gone_after.get(pid)} for pid, command in alive.items()]


def one_run(at_epoch: int, epochs: int, dump_after: float, limit: float, log=None) -> dict:
    workdir = tempfile.mkdtemp(prefix="psclient-demo-interrupt-")
    command = ["nice", "-n", "19", sys.executable, "-m", "psclient", "demo", "--epochs", str(epochs),
               "--workdir", workdir]
    demo = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, bufsize=1, start_new_session=True)
    lines: queue.Queue = queue.Queue()
    reader = threading.Thread(target=_lines, args=(demo.stdout, lines), daemon=True)
    reader.start()
    run = {"at_epoch": at_epoch}
    started: dict = {}  # pid -> command of what the demo started, once it trains
    try:
        target = f"Epoch {at_epoch}/{epochs}"
        deadline = time.monotonic() + limit
        while True:
            try:
                _, line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise RuntimeError(f"the demo printed no {target!r} line within {limit:g} s") from None
            if line is None:
                raise RuntimeError(f"the demo exited ({demo.wait()}) before its {target!r} line")
            if target in line:  # after the previous epoch's progress bar, on the same line
                break
        started = {p.pid: " ".join(p.cmdline())[-160:] for p in psutil.Process(demo.pid).children(recursive=True)}
        run["processes_started"] = len(started)
        sent = time.monotonic()
        demo.send_signal(signal.SIGINT)
        dumped = None
        while demo.poll() is None and time.monotonic() - sent < limit:
            if dumped is None and time.monotonic() - sent > dump_after:
                dumped = _main_thread_frames(demo.pid)
            time.sleep(0.05)
        run["exit_s"] = round(time.monotonic() - sent, 2) if demo.poll() is not None else None
        run["exit_status"] = demo.poll()
        if dumped is not None:
            run[f"main_thread_after_{dump_after:g}_s"] = dumped
        reader.join(timeout=10)
        after = []
        while not lines.empty():
            at, line = lines.get()
            if line is not None and at >= sent:
                after.append(line)
                if log is not None:  # what it printed after the interrupt, in full
                    log.write(f"{at - sent:8.2f} s  {line}\n")
        run["printed_after_interrupt"] = [line for line in after if "Epoch" not in line and "step" not in line][-8:]
        run["left_behind"] = _left_behind(started, limit=30.0)
    finally:
        for pid in [*started, demo.pid]:  # whatever is still there: none, unless measured so
            try:
                psutil.Process(pid).kill()
            except psutil.NoSuchProcess:
                pass
        demo.wait()
        shutil.rmtree(workdir, ignore_errors=True)
    return run


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--load", type=int, default=2, help="busy processes beside the demo (default 2)")
    parser.add_argument("--at-epoch", type=int, default=0,
                        help="SIGINT after this epoch's line (0: a random one of 2 to 6 each run)")
    parser.add_argument("--epochs", type=int, default=400)
    parser.add_argument("--dump-after", type=float, default=5.0,
                        help="py-spy dump of a demo still running this many s after SIGINT")
    parser.add_argument("--limit", type=float, default=300.0, help="seconds to wait for each step of a run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-dir", help="write each run's output after the interrupt, in full, to DIR/run-N.log")
    args = parser.parse_args(argv)
    for name in ("runs", "epochs"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1; received {getattr(args, name)}")
    if args.load < 0 or args.at_epoch < 0 or args.at_epoch > args.epochs:
        parser.error(f"--load must be >= 0 and --at-epoch between 0 and --epochs; received --load "
                     f"{args.load}, --at-epoch {args.at_epoch}")
    rng = random.Random(args.seed)
    loads = [subprocess.Popen([sys.executable, "-c", _BUSY.format(seconds=args.runs * 2 * args.limit)])
             for _ in range(args.load)]
    runs = []
    try:
        for number in range(args.runs):
            at = args.at_epoch or rng.randint(2, 6)
            if args.log_dir is None:
                runs.append(one_run(at, args.epochs, args.dump_after, args.limit))
            else:
                os.makedirs(args.log_dir, exist_ok=True)
                with open(os.path.join(args.log_dir, f"run-{number}.log"), "w") as log:
                    runs.append(one_run(at, args.epochs, args.dump_after, args.limit, log))
            print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
    finally:
        for process in loads:
            process.kill()
            process.wait()
    times = [run["exit_s"] for run in runs if run["exit_s"] is not None]
    return {
        "benchmark": "demo_interrupt", "args": vars(args), "environment": environment(sys.argv),
        "load_processes": args.load, "cores": os.cpu_count(),
        "demo_niceness": 19, "runs": runs,
        "exit_s_median": statistics.median(times) if times else None,
        "exit_s_max": max(times) if times else None,
        "exited_130": sum(run["exit_status"] == 130 for run in runs),
        "left_behind_at_exit": sum(len(run["left_behind"]) for run in runs),
        "left_behind_30_s_later": sum(entry["gone_after_s"] is None for run in runs for entry in run["left_behind"]),
        "deadline_s": 60,
    }


if __name__ == "__main__":
    print(json.dumps(main(), indent=2))
