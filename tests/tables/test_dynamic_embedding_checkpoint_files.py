"""Dynamic tables in checkpoint files, without a cluster (a local table, written and read by this process
through the same code as each ps's part): what is saved, and that a checkpoint that cannot be read, or
does not match, leaves the table as it was. The cluster path: test_dynamic_embedding_checkpoints.py."""

from __future__ import annotations

import json

import numpy as np
import pytest

keras = pytest.importorskip("keras")
tf = pytest.importorskip("tensorflow")

from psclient import CheckpointUnreadable  # noqa: E402
from psclient._coordinator.checkpoints.checkpoint import Checkpoints  # noqa: E402
from psclient.layers import DynamicEmbedding  # noqa: E402


def trained(name, steps=3, dim=3, capacity=None):
    """A local layer after `steps` Adagrad steps on keys 0..9 (then 5..14, ...)."""
    layer = DynamicEmbedding(dim, name=name, capacity=capacity)
    layer.build()
    optimizer = keras.optimizers.Adagrad(0.3)
    for step in range(steps):
        keys = tf.constant(np.arange(10) + 5 * step, tf.int64)
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(layer(keys, training=True) ** 2)
        optimizer.apply(tape.gradient(loss, layer.trainable_variables), layer.trainable_variables)
    return layer


def snapshot(layer):
    [state] = layer.export_state()
    order, row_order = np.argsort(state["keys"]), np.argsort(state["row_keys"])
    return {"keys": state["keys"][order].tolist(), "counters": state["counters"][order].tolist(),
            "row_keys": state["row_keys"][row_order].tolist(), "rows": state["rows"][row_order].tolist(),
            "slots": {k: v[row_order].tolist() for k, v in state["slots"].items()},
            "clock": int(state["clock"]), "admissions": int(state["admissions"])}


def test_saved_and_restored_with_counters_slots_and_clock(tmp_path):
    layer = trained("files_ids")
    checkpoints = Checkpoints(tmp_path, keep=2)
    path = checkpoints.save({}, completed=None, tables={"table/0000": layer.table})
    saved = snapshot(layer)
    reader = tf.train.load_checkpoint(path)
    shapes = reader.get_variable_to_shape_map()
    assert shapes["table/0000/ps0/rows"] == [20, 3] and shapes["table/0000/ps0/slot/accumulator"] == [20, 3]
    assert json.loads(reader.get_tensor("psclient_layout"))["tables"]["table/0000"] == {
        "name": "files_ids", "dim": 3, "shards": 1, "slots": {"accumulator": 0.1}}

    fresh = DynamicEmbedding(3, name="files_ids_2")
    fresh.build()  # a new process: no slot tables yet, nothing trained
    checkpoints.restore({}, tables={"table/0000": fresh.table})
    assert snapshot(fresh) == saved


def test_an_unreadable_checkpoint_leaves_the_table_as_it_was(tmp_path):
    layer = trained("broken_ids")
    checkpoints = Checkpoints(tmp_path, keep=1)
    path = checkpoints.save({}, completed=None, tables={"table/0000": layer.table})
    trained_more = trained("broken_ids_2", steps=4)
    before = snapshot(trained_more)
    layout = json.loads(tf.train.load_checkpoint(path).get_tensor("psclient_layout"))
    [part] = [p["file"] for p in layout["parts"] if "table/0000/ps0/rows" in p["keys"]]
    with open(tmp_path / part, "r+b") as f:  # the table's part only: the rest of it reads
        f.truncate(16)
    with pytest.raises(CheckpointUnreadable, match="table/0000"):
        checkpoints.restore({}, tables={"table/0000": trained_more.table})
    assert snapshot(trained_more) == before


def test_a_table_not_in_the_checkpoint_or_of_another_width_is_refused(tmp_path):
    checkpoints = Checkpoints(tmp_path, keep=1)
    checkpoints.save({}, completed=None, tables={"table/0000": trained("width_ids").table})
    other = trained("width_ids_2", dim=5)
    before = snapshot(other)
    with pytest.raises(ValueError, match=r"table/0000 \('width_ids_2'\) has rows of 3 there but 5 here"):
        checkpoints.restore({}, tables={"table/0000": other.table})
    with pytest.raises(ValueError, match=r"table/0001 \('width_ids_2'\) is not in it"):
        checkpoints.restore({}, tables={"table/0001": other.table})
    assert snapshot(other) == before
