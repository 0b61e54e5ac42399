"""A dense table shard restored in row ranges, written in place (`table_ranges`): every row, slot,
counter and clock comes back exactly, in ranges smaller than the table, and a damaged rows entry
leaves the table as it was. Local tables (no cluster): each test's checkpoint is written by this
process, as a table without a cluster's is (`table_checkpoint.LOCAL`)."""

from __future__ import annotations

import json

import pytest

tf = pytest.importorskip("tensorflow")

from psclient._coordinator.checkpoints import table_checkpoint  # noqa: E402
from psclient._coordinator.checkpoints.checkpoint import Checkpoints, CheckpointUnreadable  # noqa: E402

from _table_ranges_setup import damage_saved_row, DIM, KEY, ROWS, SLOT, contents, state, table  # noqa: E402

pytestmark = pytest.mark.timeout(300)

def saved_and_changed(tmp_path, source=None):
    """A checkpoint of a table holding `state(1)` (made by `source`, dense by default), and a dense
    table holding `state(2)` since: (path, its layout, the table, what it saved)."""
    source = source or table()
    source.import_shards([state(1)])
    saved = contents(source.export_shard(0))
    path = Checkpoints(str(tmp_path), keep=3).save({}, completed=1, tables={KEY: source})
    target = source if source.shards[0].dense else table()
    target.import_shards([state(2)])
    assert contents(target.export_shard(0)) != saved
    return path, json.loads(tf.train.load_checkpoint(path).get_tensor("psclient_layout")), target, saved


def restore_in_ranges(path, layout, target, range_bytes):
    """`table_checkpoint.read` (the check) then `assign`, with ranges of at most `range_bytes`."""
    work = table_checkpoint.read(path, {KEY: target}, layout["tables"], layout, range_bytes=range_bytes)
    checked = {ps: run() for ps, run in work.items()}
    (_, _, entry), = checked[table_checkpoint.LOCAL]
    rows = table_checkpoint.assign(checked, lambda runs: {ps: run() for ps, run in runs.items()})
    return entry["ranges"], rows


def test_a_table_bigger_than_one_range_gets_back_every_row_and_slot_exactly(tmp_path):
    path, layout, target, saved = saved_and_changed(tmp_path)
    plan, rows = restore_in_ranges(path, layout, target, range_bytes=1024)  # 32 rows of 8 floats a range
    assert len(plan.ranges("rows", ROWS)) == -(-ROWS // 32) and len(plan.ranges(SLOT, ROWS)) == -(-ROWS // 32)
    assert rows == {table_checkpoint.LOCAL: ROWS}
    assert contents(target.export_shard(0)) == saved
    # The free rows are free: the table admits into them up to its capacity as before.
    stats = target.stats()[0]
    assert (stats["rows"], stats["tracked_keys"]) == (ROWS, ROWS + 5)


def test_a_small_table_restored_whole_beside_a_big_one_in_ranges_gets_back_everything_exactly(tmp_path):
    """A shard whose rows and slots fit in one range is restored whole (few calls on its ps), a
    bigger one in ranges, in the same restore: both get back every row, slot, counter and clock."""
    small_key, small_rows = "table/0001", 20
    big, small = table(), table(capacity=32, name="small")  # storage: 64,000 and 2,048 bytes
    big.import_shards([state(1)])
    small.import_shards([state(3, rows=small_rows)])
    saved = {KEY: contents(big.export_shard(0)), small_key: contents(small.export_shard(0))}
    path = Checkpoints(str(tmp_path), keep=3).save({}, completed=1, tables={KEY: big, small_key: small})
    big.import_shards([state(2)])
    small.import_shards([state(4, rows=small_rows)])
    assert contents(big.export_shard(0)) != saved[KEY] and contents(small.export_shard(0)) != saved[small_key]
    layout = json.loads(tf.train.load_checkpoint(path).get_tensor("psclient_layout"))

    tables = {KEY: big, small_key: small}
    work = table_checkpoint.read(path, tables, layout["tables"], layout, range_bytes=4096)
    checked = {ps: run() for ps, run in work.items()}
    plans = {table_.name: entry["ranges"] for table_, _shard, entry in checked[table_checkpoint.LOCAL]}
    assert plans["small"] is None  # whole
    assert len(plans["ranged"].ranges("rows", ROWS)) == -(-ROWS // (4096 // (4 * DIM)))
    rows = table_checkpoint.assign(checked, lambda runs: {ps: run() for ps, run in runs.items()})
    assert rows == {table_checkpoint.LOCAL: ROWS + small_rows}
    assert contents(big.export_shard(0)) == saved[KEY]
    assert contents(small.export_shard(0)) == saved[small_key]
    for made, held in ((big, ROWS), (small, small_rows)):  # free rows free, as after a whole restore
        stats = made.stats()[0]
        assert (stats["rows"], stats["tracked_keys"]) == (held, held + 5)


def test_a_restore_by_the_checkpoints_gets_back_every_row(tmp_path):
    """Through `Checkpoints.restore` (no `range_bytes`: ranges of `READ_BATCH_BYTES`, which this
    table fits in, so it is restored whole)."""
    path, layout, target, saved = saved_and_changed(tmp_path)
    restored = Checkpoints(str(tmp_path), keep=3).restore({}, adopt=True, tables={KEY: target})
    assert restored["path"] == path and restored["restored"]["rows"] == {table_checkpoint.LOCAL: ROWS}
    assert contents(target.export_shard(0)) == saved


def test_keys_saved_in_another_order_than_the_rows_are_looked_up(tmp_path):
    """A table kept in hash tables saves its keys in the tables' order: restored into dense storage
    in ranges, each key still gets its own counters."""
    source = table(storage="hash")
    source.import_shards([state(1, shuffled=True)])
    path, layout, target, saved = saved_and_changed(tmp_path, source)
    restore_in_ranges(path, layout, target, range_bytes=4096)
    rows, counters, clocks = saved
    # Dense storage keeps a key's sightings only while it counts towards admission: a key with a row
    # reads `min_frequency` (1) of them, and its own step last seen.
    counters = {key: [1, step] if key in rows else [seen, step] for key, (seen, step) in counters.items()}
    assert contents(target.export_shard(0)) == (rows, counters, clocks)


def test_a_damaged_rows_entry_leaves_the_table_untouched(tmp_path):
    path, layout, target, _ = saved_and_changed(tmp_path)
    before = contents(target.export_shard(0))
    # Bytes inside the saved rows, found by the first saved row's bytes (state(1)'s rows are random).
    damage_saved_row(path, state(1)["rows"][0])

    with pytest.raises(tf.errors.OpError):  # the check, in ranges, finds it before anything is assigned
        restore_in_ranges(path, layout, target, range_bytes=1024)
    assert contents(target.export_shard(0)) == before
    with pytest.raises(CheckpointUnreadable, match=f"{KEY} \\('ranged'\\)"):
        Checkpoints(str(tmp_path), keep=3).restore({}, adopt=True, tables={KEY: target})
    assert contents(target.export_shard(0)) == before


def test_range_bytes_must_be_positive(tmp_path):
    path, layout, target, _ = saved_and_changed(tmp_path)
    with pytest.raises(ValueError, match=r"range_bytes=0\. Expected a positive number of bytes"):
        table_checkpoint.read(path, {KEY: target}, layout["tables"], layout, range_bytes=0)[table_checkpoint.LOCAL]()
