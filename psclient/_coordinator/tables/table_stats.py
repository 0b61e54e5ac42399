"""The DynamicEmbedding tables' counts for `stats()` and scrapes, read without waiting on a ps.

Everything else `stats()` reports is counted in the coordinator; the tables' counts (rows, keys
tracked, admissions, evictions) are read on the ps tasks. Read plainly, a caller waited for as
long as a ps hung (SIGSTOPped, a cut network: until it resumed) or was being recovered (until
its recovery settled: 77 s in a seeded chaos plan, docs/chaos.md, seed 500), so a monitoring
thread calling `stats()` hung with it, and a scrape past Prometheus's timeout took the
coordinator's whole target down.

Here one thread at a time reads them (`TableStatsReader`, "psclient-table-stats"), shard by
shard into a dict its callers can see: a caller waits up to its own limit and gets what was
read by then, each shard not read marked unavailable, while the read goes on (the next caller
waits on the same read until it ends). The read skips the ps tasks the recovery holds lost, and
a loss it meets is reported to the recovery, not waited for (`recovering: True` on the shard).
"""

from __future__ import annotations

import threading
from typing import Callable

from psclient._coordinator.tables import dynamic_tables

__all__ = ["THREAD_NAME", "TableStatsReader"]

#: The reader's thread: one alive between calls waits on a ps that has not answered yet.
THREAD_NAME = "psclient-table-stats"
#: Seconds `close()` waits for a read still in flight (it ends when its ps answers).
_CLOSE_WAIT_S = 5.0


class TableStatsReader:
    """Reads the tables of the strategy behind `strategy_ref` (a weak reference: the reader must not
    keep the strategy alive). Owns its thread: `close()` joins it (bounded)."""

    def __init__(self, strategy_ref: Callable):
        self._strategy_ref = strategy_ref
        self._lock = threading.Lock()
        self._reader: threading.Thread | None = None
        self._read: dict = {}  # the reader's: "tables" filled as it goes, "error" if it failed

    def read(self, wait_s: float) -> tuple[dict, bool]:
        """(the tables' stats by name, whether a read is still waiting on a ps), within `wait_s`.

        A shard not read by then is `{"ps": k, "available": False, "waiting": True, "error": ...}`.
        """
        strategy = self._strategy_ref()
        if strategy is None:
            return {}, False
        tables = dynamic_tables.live_tables(strategy)
        if not tables:
            return {}, False  # nothing to read on the ps: no thread
        with self._lock:
            reader, read = self._reader, self._read
            if reader is None or not reader.is_alive():
                read = self._read = {"tables": {}}
                reader = self._reader = threading.Thread(
                    target=_read_tables, args=(self._strategy_ref, read), name=THREAD_NAME, daemon=True)
                reader.start()
        reader.join(wait_s)
        if "error" in read:
            raise read["error"]  # a bug of the read itself (a ps's errors are the shards' entries)
        waiting = reader.is_alive()
        by_name = dict(read["tables"])
        if not waiting:
            return by_name, False
        waited = f"not read within {wait_s:g} s: the read waits on a ps that does not answer (it may hang)"
        return {table.name: _completed(by_name.get(table.name, []), len(table.shards), waited)
                for table in tables}, True

    def close(self) -> None:
        with self._lock:
            reader = self._reader
        if reader is not None:
            reader.join(_CLOSE_WAIT_S)


def _completed(entries: list, shards: int, why: str) -> list:
    """`entries` (read so far) and, for each shard after them, the entry of one not read."""
    entries = list(entries)
    return entries + [{"ps": index, "available": False, "waiting": True, "error": why}
                      for index in range(len(entries), shards)]


def _read_tables(strategy_ref, into: dict) -> None:
    strategy = strategy_ref()
    if strategy is None:
        return
    try:
        dynamic_tables.stats_on_ps(strategy, into=into["tables"])
    except Exception as error:  # noqa: BLE001 - handed to the callers (`read`)
        into["error"] = error
