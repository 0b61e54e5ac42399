"""A heartbeat thread in the coordinator: its longest gap is the coordinator's longest stall.

TF calls that block inside C++ with the GIL held stop every Python thread of
the process, the heartbeat's too.
"""

import threading
import time

#: The longest the coordinator's threads may stall (issue: never more than 1 s).
MAX_STALL_S = 1.0


class Heartbeat:
    """Ticks every 20 ms on its own thread; `longest` is the longest gap seen."""

    def __init__(self):
        self.longest = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="test-heartbeat", daemon=True)

    def _run(self):
        last = time.monotonic()
        # Event.wait releases the GIL; a gap longer than the period means the
        # process did not let this thread run.
        while not self._stop.wait(0.02):
            now = time.monotonic()
            self.longest = max(self.longest, now - last)
            last = now

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(5)
