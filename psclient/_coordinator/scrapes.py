"""What a Prometheus scrape of the coordinator reads: `stats()`, without waiting on a hung ps.

Everything `stats()` reports is counted in the coordinator except the DynamicEmbedding tables'
counts, read from the ps tasks. A ps that hangs (SIGSTOPped, a cut network) answers that read only
when it resumes: the scrape then waited as long, past Prometheus's scrape timeout (10 s by default),
so the coordinator's target went down, with every family it serves, for as long as the ps hung,
and each scrape left one more thread waiting on the ps. Here the tables are read by one thread at a
time; a scrape waits up to `TABLE_READ_WAIT_S` for it and is otherwise served without the
tables' families, with `embedding_stats_waiting` set, while that read goes on waiting.
"""

from __future__ import annotations

import threading
from typing import Callable

from psclient._coordinator.tables import dynamic_tables
from psclient._core.metrics import families

__all__ = ["TABLE_READ_WAIT_S", "ScrapeSource"]

#: Seconds a scrape waits for the tables' counts (milliseconds when the ps tasks answer): well under
#: the shortest scrape timeouts in use (1 s in tests/ops/test_metrics.py, 10 s Prometheus's default).
TABLE_READ_WAIT_S = 0.5
#: Seconds `close()` waits for a read still in flight (it ends when its ps answers).
_CLOSE_WAIT_S = 5.0


class ScrapeSource:
    """The metric families of one scrape of the strategy behind `strategy_ref` (a weak reference:
    the metrics server must not keep the strategy alive); none once it is gone or shut down.
    Owns the thread that reads the tables: `close()` joins it (bounded)."""

    def __init__(self, strategy_ref: Callable, wait_s: float = TABLE_READ_WAIT_S):
        self._strategy_ref = strategy_ref
        self._wait_s = wait_s
        self._lock = threading.Lock()
        self._reader: threading.Thread | None = None
        self._read: dict = {}  # the reader's result: {"tables": ...} once it ended

    def __call__(self) -> list:
        strategy = self._strategy_ref()
        if strategy is None or strategy.closed:
            return []
        stats = strategy.stats(read_ps=False)
        if all(ps["up"] for ps in stats["ps"]):  # a lost ps: the read would wait for its recovery
            tables = self._tables()
            stats["embedding_stats_waiting"] = tables is None
            stats["dynamic_embeddings"] = tables or {}
        return families(stats)

    def _tables(self) -> dict | None:
        """The tables' counts, read now, or None while a read (this one or an earlier one) waits."""
        with self._lock:
            reader, read = self._reader, self._read
            if reader is None or not reader.is_alive():
                read = self._read = {}
                reader = self._reader = threading.Thread(
                    target=_read_tables, args=(self._strategy_ref, read), name="psclient-metrics-tables", daemon=True)
                reader.start()
        reader.join(self._wait_s)
        return read.get("tables")

    def close(self) -> None:
        with self._lock:
            reader = self._reader
        if reader is not None:
            reader.join(_CLOSE_WAIT_S)


def _read_tables(strategy_ref, into: dict) -> None:
    strategy = strategy_ref()
    if strategy is not None:
        into["tables"] = dynamic_tables.stats_on_ps(strategy)
