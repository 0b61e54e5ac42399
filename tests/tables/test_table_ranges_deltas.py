"""A dense table shard restored in row ranges with deltas (`table_ranges.Plan.assign` with
`table_deltas.Changes`): the saved rows the deltas left alone written a range at a time, then each
delta's changed rows, in place. Every row, slot, counter and clock comes back as the whole path
(the saved state read whole, each delta merged into it) gives them, row for row. Local tables (no
cluster): this process writes the full checkpoint and the deltas (`table_deltas.diff` of two exports,
as a ps writes them)."""

from __future__ import annotations

import json

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from psclient._coordinator.checkpoints import table_checkpoint, table_deltas, table_ranges  # noqa: E402
from psclient._coordinator.checkpoints.checkpoint import Checkpoints  # noqa: E402
from psclient._tf import checkpoints as _checkpoints  # noqa: E402

from _table_ranges_setup import DIM, KEY, ROWS, SLOT, contents, state, table  # noqa: E402

pytestmark = pytest.mark.timeout(300)

PREFIX = f"{KEY}/ps0"


def changed(before, seed, drop, touch, new):
    """`before` with `drop` of its rows (and their keys) gone, `touch` rows and counters changed,
    `new` keys with a row added, the clocks moved on."""
    rng = np.random.default_rng(seed)
    rows_n = len(before["row_keys"])
    gone = set(rng.choice(before["row_keys"], drop, replace=False).tolist())
    keep = np.array([k not in gone for k in before["row_keys"].tolist()])
    tracked = np.array([k not in gone for k in before["keys"].tolist()])
    out = {"row_keys": before["row_keys"][keep], "rows": before["rows"][keep].copy(),
           "slots": {SLOT: before["slots"][SLOT][keep].copy()},
           "keys": before["keys"][tracked], "counters": before["counters"][tracked].copy()}
    at = rng.choice(len(out["row_keys"]), touch, replace=False)
    out["rows"][at] += 1.0
    out["slots"][SLOT][at] += 0.5
    out["counters"][rng.choice(len(out["keys"]), touch, replace=False), 1] += 7
    fresh = rng.choice(10**12, new, replace=False).astype(np.int64) + 10**12  # apart from `state`'s keys
    out["row_keys"] = np.concatenate([out["row_keys"], fresh])
    out["rows"] = np.concatenate([out["rows"], rng.standard_normal((new, DIM)).astype(np.float32)])
    out["slots"][SLOT] = np.concatenate([out["slots"][SLOT], rng.random((new, DIM)).astype(np.float32)])
    out["keys"] = np.concatenate([out["keys"], fresh])
    out["counters"] = np.concatenate([out["counters"], np.stack([np.ones(new), np.full(new, 99)], 1).astype(np.int64)])
    assert len(out["row_keys"]) == rows_n - drop + new
    out.update({"clock": before["clock"] + 10, "admissions": before["admissions"] + new,
                "evictions": before["evictions"] + drop})
    return out


def export(source):
    """The table's export as a cut takes it: (names, tensors)."""
    return table_checkpoint.save_work({KEY: source})[table_checkpoint.LOCAL]()


def write_delta(path, old, source):
    """A delta of `source` against `old` (a kept export) at `path`, as a ps writes it; the new export."""
    names, values = export(source)
    delta_names, tensors, _rows = table_deltas.diff(PREFIX, table_deltas.split(names)[PREFIX], old, values)
    _checkpoints.save(path, delta_names, [""] * len(delta_names), tensors)
    return table_deltas.kept(names, values)[PREFIX]


def restore(path, layout, deltas, target, range_bytes):
    """`table_checkpoint.read` then `assign` with each delta's patcher: the plan and the rows."""
    work = table_checkpoint.read(path, {KEY: target}, layout["tables"], layout, range_bytes=range_bytes)
    checked = {ps: run() for ps, run in work.items()}
    (_, _, entry), = checked[table_checkpoint.LOCAL]
    patches = [table_deltas.patcher(d, {KEY: target}, layout["tables"]) for d in deltas]
    rows = table_checkpoint.assign(checked, lambda runs: {ps: run() for ps, run in runs.items()}, patches)
    return entry["ranges"], rows


@pytest.fixture
def saved_with_deltas(tmp_path):
    """A full checkpoint of `state(1)` and two deltas after it (rows dropped, changed, added): (path,
    layout, delta paths, the source table's export after the second delta)."""
    source = table()
    first = state(1)
    source.import_shards([first])
    path = Checkpoints(str(tmp_path / "ckpt"), keep=3).save({}, completed=1, tables={KEY: source})
    layout = json.loads(tf.train.load_checkpoint(path).get_tensor("psclient_layout"))
    names, values = export(source)
    old = table_deltas.kept(names, values)[PREFIX]
    second = changed(first, 11, drop=40, touch=60, new=90)
    source.import_shards([second])
    old = write_delta(str(tmp_path / "delta-1"), old, source)
    third = changed(second, 12, drop=70, touch=30, new=25)
    source.import_shards([third])
    write_delta(str(tmp_path / "delta-2"), old, source)
    return path, layout, [str(tmp_path / "delta-1"), str(tmp_path / "delta-2")], source.export_shard(0)


def test_ranges_with_two_deltas_give_back_every_row_where_the_whole_path_puts_it(saved_with_deltas, monkeypatch):
    path, layout, deltas, want = saved_with_deltas
    written = []
    assign = table_ranges.Plan.assign
    monkeypatch.setattr(table_ranges.Plan, "assign",
                        lambda plan, shard, changes=(): written.append(assign(plan, shard, changes)) or written[-1])
    ranged = table()
    ranged.import_shards([state(5)])  # something else before
    plan, rows = restore(path, layout, deltas, ranged, range_bytes=1024)  # 32 rows of 8 floats a range
    n = ROWS - 40 + 90 - 70 + 25
    assert plan is not None and len(plan.ranges("rows", ROWS)) == -(-ROWS // 32)
    assert written == [n] and rows == {table_checkpoint.LOCAL: n}  # in place, not the whole path
    got = ranged.export_shard(0)
    assert contents(got) == contents(want)

    whole = table()
    whole.import_shards([state(6)])
    plan, rows = restore(path, layout, deltas, whole, range_bytes=None)  # fits one range: whole
    assert plan is None and rows == {table_checkpoint.LOCAL: n}
    same = whole.export_shard(0)
    for field in ("keys", "counters", "row_keys", "rows", "clock", "admissions", "evictions"):
        np.testing.assert_array_equal(np.asarray(got[field]), np.asarray(same[field]), err_msg=field)
    np.testing.assert_array_equal(got["slots"][SLOT], same["slots"][SLOT])
    # The free rows are free: as many rows and tracked keys as after the whole path.
    assert ranged.stats()[0]["rows"] == whole.stats()[0]["rows"] == n
    assert ranged.stats()[0]["tracked_keys"] == whole.stats()[0]["tracked_keys"]


def test_a_delta_with_other_slots_than_the_checkpoint_goes_to_the_whole_path(saved_with_deltas):
    path, layout, deltas, want = saved_with_deltas
    target = table()
    target.import_shards([state(5)])
    work = table_checkpoint.read(path, {KEY: target}, layout["tables"], layout, range_bytes=1024)
    checked = {ps: run() for ps, run in work.items()}
    (_, shard, entry), = checked[table_checkpoint.LOCAL]
    other = table_deltas.Changes(deltas[0], PREFIX, [SLOT, "momentum"])
    with shard.placed():
        assert entry["ranges"].assign(shard, [other]) is None  # nothing written: the caller goes whole
    rows = table_checkpoint.assign(checked, lambda runs: {ps: run() for ps, run in runs.items()},
                                   [table_deltas.patcher(d, {KEY: target}, layout["tables"]) for d in deltas])
    assert contents(target.export_shard(0)) == contents(want) and rows == {table_checkpoint.LOCAL: len(want["row_keys"])}
