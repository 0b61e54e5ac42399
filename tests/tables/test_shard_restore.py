"""Dense shards of one form are restored through one trace (`psclient._coordinator.tables.shard_restore`):
alike tables on every ps, restored whole or in row ranges, get back every row, slot, counter and
clock exactly, and a table of another form traces its own section once.

Trace counts are differences of `shard_restore.trace_count()` (the sections' `tf.function`'s own
count), over forms no other test of the process uses (their slots' initial values are this
module's own)."""

from __future__ import annotations

import json

import numpy as np
import pytest

keras = pytest.importorskip("keras")
tf = pytest.importorskip("tensorflow")

import psclient  # noqa: E402
from _conversions import RemoteConversions  # noqa: E402
from psclient._coordinator.checkpoints import table_checkpoint  # noqa: E402
from psclient._coordinator.checkpoints.checkpoint import Checkpoints  # noqa: E402
from psclient._coordinator.tables import shard_restore  # noqa: E402
from psclient._coordinator.tables.dynamic_tables import DynamicTable  # noqa: E402
from psclient._core.dynamic_tables import Policy  # noqa: E402

pytestmark = pytest.mark.timeout(600)

SLOT = "accumulator"


def state(seed, dim, rows):
    """One exported shard: `rows` keys with a row and slot, 3 keys still counting, its clocks."""
    rng = np.random.default_rng(seed)
    keys = rng.choice(10**12, rows + 3, replace=False).astype(np.int64)
    counters = np.stack([np.ones(rows + 3, np.int64), rng.integers(0, 90, rows + 3)], 1)
    return {"keys": keys, "counters": counters, "row_keys": keys[:rows],
            "rows": rng.standard_normal((rows, dim)).astype(np.float32),
            "slots": {SLOT: rng.random((rows, dim)).astype(np.float32)},
            "clock": np.int64(100 + seed), "admissions": np.int64(rows), "evictions": np.int64(seed)}


def contents(shards: list[dict]) -> tuple:
    """What a table holds whatever the order of its rows: {key: (row, slot, counters)}, and each
    shard's (clock, admissions, evictions)."""
    held, clocks = {}, []
    for shard in shards:
        counters = dict(zip(np.asarray(shard["keys"]).tolist(),
                            np.asarray(shard["counters"]).reshape(-1, 2).tolist()))
        for i, key in enumerate(np.asarray(shard["row_keys"]).tolist()):
            held[key] = (np.asarray(shard["rows"])[i].tolist(), np.asarray(shard["slots"][SLOT])[i].tolist(),
                         counters.pop(key))
        held.update({key: ("counting", value) for key, value in counters.items()})
        clocks.append(tuple(int(shard[k]) for k in ("clock", "admissions", "evictions")))
    return held, clocks


def test_alike_local_tables_restore_through_one_trace_exactly(tmp_path):
    """Without a cluster: four tables of one form, two of them with a share bigger than one range
    (written by `replace_row_keys` and `replace_counters`, in ranges) and two small ones (written
    whole by `replace`), restored through one trace of each section."""
    def made(name, capacity):
        table = DynamicTable(name, 6, [None], ("zeros",), Policy(capacity=capacity))
        table.ensure_slots({SLOT: 0.0625})
        return table

    tables = {f"table/{i:04d}": made(f"alike{i}", capacity) for i, capacity in enumerate((4096, 4096, 64, 64))}
    before = shard_restore.trace_count()
    for i, table in enumerate(tables.values()):
        table.import_shards([state(i, 6, rows=table.share - 10)])
    assert shard_restore.trace_count() - before == 1  # `_replace`: the shares are inputs, not the form's
    saved = {key: contents([table.export_shard(0)]) for key, table in tables.items()}
    path = Checkpoints(str(tmp_path), keep=2).save({}, completed=1, tables=tables)
    for i, table in enumerate(tables.values()):
        table.import_shards([state(10 + i, 6, rows=20)])
    assert all(contents([t.export_shard(0)]) != saved[k] for k, t in tables.items())

    traced = shard_restore.trace_count()
    layout = json.loads(tf.train.load_checkpoint(path).get_tensor("psclient_layout"))
    work = table_checkpoint.read(path, tables, layout["tables"], layout, range_bytes=4096)
    checked = {ps: run() for ps, run in work.items()}
    assert [entry["ranges"] is None for _t, _s, entry in checked[table_checkpoint.LOCAL]] == [
        False, False, True, True]  # the big ones in ranges, the small ones whole
    table_checkpoint.assign(checked, lambda runs: {ps: run() for ps, run in runs.items()})
    # `_replace_row_keys` and `_replace_counters` once each (the big tables'); `_replace` (the small
    # ones') traced by the imports already.
    assert shard_restore.trace_count() - traced == 2
    assert {key: contents([table.export_shard(0)]) for key, table in tables.items()} == saved


@pytest.fixture()
def local(one_worker_two_ps, restore_shared_clusters):
    return one_worker_two_ps


def test_alike_tables_on_two_ps_restore_through_one_trace_exactly(local, tmp_path):
    """Five alike tables (two capacities) and one of another dim, on 2 ps: the alike shards (ten)
    restore through the trace their form's first import made, the other table's through one of its
    own, converting nothing under a ps's device, and every row, slot, counter and clock comes back."""
    from psclient.layers import DynamicEmbedding

    strategy = psclient.ParameterServerStrategy(local.cluster, checkpoint_dir=str(tmp_path))
    try:
        with strategy.scope():
            ids = keras.Input((6,), dtype="int64")
            layers = [DynamicEmbedding(7 if i == 5 else 5, name=f"alike{i}", capacity=400 if i % 2 else 300)
                      for i in range(6)]
            keras.Model(ids, [layer(ids[:, i:i + 1]) for i, layer in enumerate(layers)])
        for layer in layers:
            layer.table.ensure_slots({SLOT: 0.1875})
        before = shard_restore.trace_count()
        for i, layer in enumerate(layers):
            layer.import_state([state(i, layer.table.dim, rows=150)])  # about 75 rows a ps
        assert shard_restore.trace_count() - before == 2  # one per form: dim 5 and dim 7
        saved = [contents(layer.export_state()) for layer in layers]
        strategy.save_checkpoint()
        for i, layer in enumerate(layers):
            layer.import_state([state(20 + i, layer.table.dim, rows=40)])
        assert [contents(layer.export_state()) for layer in layers] != saved

        traced = shard_restore.trace_count()
        with RemoteConversions() as seen:
            strategy.restore()
        # Nothing converted under a ps's device by the restore's writes (a ps hung then would stop
        # every thread of the coordinator: tests/_conversions.py).
        mine = [found for found in seen.found if "shard_restore.py" in found[2] or "dense_shard.py" in found[2]]
        assert not mine, mine
        assert shard_restore.trace_count() == traced  # each form's trace reused: on both ps, for every shard
        assert [contents(layer.export_state()) for layer in layers] == saved
    finally:
        strategy.shutdown()
