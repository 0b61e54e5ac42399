"""A checkpoint's cut saves each ps's bounded-table shards with one prepared call
(`psclient._coordinator.tables.ps_saves`), on a real cluster (2 workers, 2 of 3 ps): what it writes
is every shard's state, before and after a ps is lost and its shards are made again."""

from __future__ import annotations

import json

import numpy as np
import pytest

keras = pytest.importorskip("keras")
tf = pytest.importorskip("tensorflow")

import psclient  # noqa: E402
from psclient._coordinator.checkpoints.table_checkpoint import read_local  # noqa: E402
from psclient._coordinator.tables import ps_saves  # noqa: E402
from _dynamic_coordinator import data, make_model  # noqa: E402
from _polling import wait_for  # noqa: E402

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]


@pytest.fixture()
def local(two_workers_three_ps, restore_shared_clusters):
    return two_workers_three_ps


def connect(local, **kwargs):
    spec = local.cluster.training_spec()
    return psclient.ParameterServerStrategy(
        psclient.Cluster({"worker": list(spec["worker"]), "ps": list(spec["ps"][:2])}), **kwargs)


def by_key(states):
    """{key: (counters, row, {slot: row})} over shards (`export_state()` or a checkpoint's parts),
    with the shards' clocks, admissions and evictions."""
    rows, clocks = {}, []
    for state in states:
        counters = dict(zip(np.asarray(state["keys"]).tolist(), np.asarray(state["counters"]).reshape(-1, 2).tolist()))
        for i, key in enumerate(np.asarray(state["row_keys"]).tolist()):
            rows[key] = (counters.get(key), np.asarray(state["rows"])[i].tolist(),
                         {name: np.asarray(value)[i].tolist() for name, value in state["slots"].items()})
        clocks.append((int(state["clock"]), int(state["admissions"]), int(state["evictions"])))
    return rows, clocks


def saved_state(path, key="table/0000"):
    reader = tf.train.load_checkpoint(path)
    layout = json.loads(reader.get_tensor("psclient_layout"))
    return by_key(read_local(reader, key, layout["tables"][key]))


def prepared(layer):
    """Per ps: whether a valid prepared save covers every shard of the table there."""
    out = []
    for shard in layer.table.shards:
        found = ps_saves.current([shard])
        out.append(found is not None and any(s is shard for s in found.shards))
    return out


@pytest.mark.long
def test_saves_hold_every_shard_before_and_after_a_ps_is_lost(local, tmp_path):
    x, y = data(2)
    strategy = connect(local, checkpoint_dir=tmp_path)
    try:
        with strategy.scope():
            model, layer = make_model("saved_ids")
        model.fit(x, y, epochs=1, batch_size=64, verbose=0)
        assert prepared(layer) == [True, True]  # made while the step was traced, with the slots
        path = strategy.save_checkpoint()
        rows, clocks = saved_state(path)
        assert (rows, clocks) == by_key(layer.export_state())
        assert rows and all(slots.keys() == {"accumulator"} for _c, _r, slots in rows.values())

        try:
            local.kill("ps", 1)
        finally:
            local.restart("ps", 1)
        # stats() meets the restarted ps and reports it (not waiting): the recovery makes its shards again
        # and restores them.
        strategy.stats()
        wait_for(lambda: strategy.stats(read_ps=False)["ps"][1]["recoveries"] == 1, 300, "ps 1 to be recovered")
        assert strategy.stats()["ps"][1]["recoveries"] == 1
        assert prepared(layer) == [True, False]  # ps 1's save was traced over the old shards
        # ps 1's shards saved one by one in this cut, ps 0's by its prepared call: both whole.
        path = strategy.save_checkpoint()
        assert saved_state(path) == by_key(layer.export_state())
        assert saved_state(path)[0] == rows  # nothing trained since: the rows restored on ps 1 are saved

        model.fit(x, y, epochs=1, batch_size=64, verbose=0)  # traced again over the new shards
        assert prepared(layer) == [True, True]
        path = strategy.save_checkpoint()
        after = saved_state(path)
        assert after == by_key(layer.export_state())
        assert after[0] != rows  # trained on since
    finally:
        strategy.shutdown()
