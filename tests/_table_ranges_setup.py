"""Local dense tables and shard states for the ranged-restore tests (tests/tables/test_table_ranges*.py):
no cluster, each test's checkpoint written by its own process (`table_checkpoint.LOCAL`)."""

from __future__ import annotations

import glob

import numpy as np

from psclient._coordinator.tables.dynamic_tables import DynamicTable
from psclient._core.dynamic_tables import Policy

KEY, DIM, CAPACITY, ROWS = "table/0000", 8, 1000, 700
SLOT = "accumulator"


def table(storage="dense", capacity=CAPACITY, name="ranged", shards=1):
    """A local table of `shards` shards (each on this process) with an Adagrad-like slot."""
    made = DynamicTable(name, DIM, [None] * shards, ("uniform", -0.05, 0.05, 1), Policy(capacity=capacity),
                        storage=storage)
    made.ensure_slots({SLOT: 0.1})
    return made


def state(seed, shuffled=False, rows=ROWS):
    """A shard's state: `rows` keys with a row (and their counters), 5 keys still counting."""
    rng = np.random.default_rng(seed)
    keys = rng.choice(10**12, rows + 5, replace=False).astype(np.int64)
    counters = np.stack([rng.integers(1, 5, rows + 5), rng.integers(0, 90, rows + 5)], 1).astype(np.int64)
    order = rng.permutation(rows + 5) if shuffled else np.arange(rows + 5)
    return {"keys": keys[order], "counters": counters[order], "row_keys": keys[:rows],
            "rows": rng.standard_normal((rows, DIM)).astype(np.float32),
            "slots": {SLOT: rng.random((rows, DIM)).astype(np.float32)},
            "clock": np.int64(100 + seed), "admissions": np.int64(7 + seed), "evictions": np.int64(3 + seed)}


def contents(shard_state):
    """What a shard holds, independent of the order of its rows: {key: (row, slot)},
    {key: counters}, (clock, admissions, evictions)."""
    rows = {key: (shard_state["rows"][i].tolist(), shard_state["slots"][SLOT][i].tolist())
            for i, key in enumerate(shard_state["row_keys"].tolist())}
    counters = dict(zip(shard_state["keys"].tolist(), shard_state["counters"].reshape(-1, 2).tolist()))
    return rows, counters, tuple(int(shard_state[k]) for k in ("clock", "admissions", "evictions"))


def damage_saved_row(path: str, row: np.ndarray) -> None:
    """Overwrite 8 bytes inside `row`'s bytes in the checkpoint at `path` (found exactly once)."""
    needle = row.tobytes()
    hits = []
    for data in glob.glob(path + ".data-*"):
        with open(data, "rb") as f:
            at = f.read().find(needle)
        if at >= 0:
            hits.append((data, at))
    assert len(hits) == 1, hits
    data, at = hits[0]
    with open(data, "r+b") as f:
        f.seek(at + 8)
        f.write(b"\xff" * 8)
