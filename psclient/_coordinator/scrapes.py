"""What a Prometheus scrape of the coordinator reads: `stats()`, without waiting on a hung ps.

Everything `stats()` reports is counted in the coordinator except the DynamicEmbedding tables'
counts, read from the ps tasks. A ps that hangs (SIGSTOPped, a cut network) answers that read only
when it resumes: the scrape then waited as long, past Prometheus's scrape timeout (10 s by default),
so the coordinator's target went down, with every family it serves, for as long as the ps hung,
and each scrape left one more thread waiting on the ps. The tables are read by a reader of the
scrapes' own (`table_stats.TableStatsReader`: one read at a time); a scrape waits up to
`TABLE_READ_WAIT_S` for it and is otherwise served without the tables' families, with
`embedding_stats_waiting` set, while that read goes on waiting.
"""

from __future__ import annotations

from typing import Callable

from psclient._coordinator.tables.table_stats import TableStatsReader
from psclient._core.metrics import families

__all__ = ["TABLE_READ_WAIT_S", "ScrapeSource"]

#: Seconds a scrape waits for the tables' counts (milliseconds when the ps tasks answer): well under
#: the shortest scrape timeouts in use (1 s in tests/ops/test_metrics.py, 10 s Prometheus's default).
TABLE_READ_WAIT_S = 0.5


class ScrapeSource:
    """The metric families of one scrape of the strategy behind `strategy_ref` (a weak reference:
    the metrics server must not keep the strategy alive); none once it is gone or shut down.
    Owns the reader of the tables: `close()` joins its thread (bounded)."""

    def __init__(self, strategy_ref: Callable, wait_s: float = TABLE_READ_WAIT_S):
        self._strategy_ref = strategy_ref
        self._wait_s = wait_s
        self._tables = TableStatsReader(strategy_ref)

    def __call__(self) -> list:
        strategy = self._strategy_ref()
        if strategy is None or strategy.closed:
            return []
        stats = strategy.stats(read_ps=False)
        if all(ps["up"] for ps in stats["ps"]):  # a lost ps: its recovery replaces the tables' shards there
            tables, waiting = self._tables.read(self._wait_s)
            stats["embedding_stats_waiting"] = waiting
            stats["dynamic_embeddings"] = {} if waiting else tables
        return families(stats)

    def close(self) -> None:
        self._tables.close()
