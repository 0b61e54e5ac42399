"""A process's resident memory, and its peak while a block runs (sampled on a thread of the test)."""

import threading

import psutil


def rss(pid: int | None = None) -> int:
    return psutil.Process(pid).memory_info().rss


class PeakRss:
    """The peak resident memory of process `pid` (this one by default) while the block runs, sampled
    every `period` s; `before`: at the start, so `growth` is what the block added at its peak."""

    def __init__(self, pid: int | None = None, period: float = 0.01):
        self._process = psutil.Process(pid)
        self.before = self.peak = self._process.memory_info().rss
        self._period = period
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @property
    def growth(self) -> int:
        return self.peak - self.before

    def _run(self):
        while not self._stop.wait(self._period):
            self.peak = max(self.peak, self._process.memory_info().rss)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(5)
