"""A watchdog process for a coordinator's stalls: dumps every thread's stack (`py-spy dump --native`)
while one lasts.

The chaos plans' sampler thread (benchmarks/chaos_plans.py) writes a byte to this process's stdin each
time it wakes (every 50 ms); a stall of the coordinator (a thread holding the GIL while it waits on a
hung task) stops those bytes. After `threshold` seconds without one, this process dumps the
coordinator's threads into `<directory>/stall-<seconds since start>.txt`, once per stall (a next
stall needs a byte first). It ends when its stdin closes (the sampler's end, or the coordinator's
death: the pipe closes with it).

Usage (by chaos_plans): python benchmarks/stall_watch.py PID THRESHOLD DIRECTORY
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time


def main(argv: list[str]) -> int:
    pid, threshold, directory = int(argv[0]), float(argv[1]), argv[2]
    os.makedirs(directory, exist_ok=True)
    started = time.monotonic()
    dumped = False
    stdin = sys.stdin.buffer.raw
    while True:
        ready, _, _ = select.select([stdin], [], [], threshold)
        if ready:
            if not stdin.read(4096):
                return 0  # the coordinator closed the pipe (or died)
            dumped = False
            continue
        if dumped:
            continue
        dumped = True
        path = os.path.join(directory, f"stall-{time.monotonic() - started:.1f}.txt")
        dump_started = time.monotonic()
        with open(path, "w") as out:
            try:
                subprocess.run(["py-spy", "dump", "--native", "--pid", str(pid)], stdout=out,
                               stderr=subprocess.STDOUT, timeout=60, check=False)
            except (OSError, subprocess.TimeoutExpired) as error:
                out.write(f"py-spy failed: {error}\n")
        # A native dump stops the process while py-spy reads it: the sampler's stall grows by as much.
        # Its span (the machine's monotonic clock, which both processes read) lets the plans take it out.
        with open(os.path.join(directory, "pauses.txt"), "a") as pauses:
            pauses.write(f"{dump_started} {time.monotonic()}\n")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
