"""When a delta store's base can no longer be diffed against (pure: no cluster)."""

from types import SimpleNamespace

from psclient._coordinator.checkpoints.checkpoint_deltas import Deltas, renewals
from psclient._coordinator.checkpoints.checkpoint_writer import PendingSave


def pending(table_renewals):
    """A save asked as a delta, with no variables (nothing row-diffed) and tables renewed so often."""
    return PendingSave(SimpleNamespace(parts={}), completed=None, scalars={}, meta=None, delta=True, rows={},
                       renewals=table_renewals)


def test_a_table_renewed_since_the_base_makes_the_next_save_full():
    """A ps that came back gets its table shards made again (`DynamicTable.renew`): the export kept
    there as the base died with the old task. A store no restore told (a Keras callback's) must
    then write a full checkpoint, not diff against the dead export."""
    deltas = Deltas("/nonexistent", describe_ps=str, hang_timeout=None)
    assert not deltas.can_diff(pending({"model_table/0000": 0}))  # no base yet
    deltas.rebase(1, pending({"model_table/0000": 0}))
    assert deltas.can_diff(pending({"model_table/0000": 0}))
    assert not deltas.can_diff(pending({"model_table/0000": 1}))
    assert not deltas.can_diff(pending({}))  # the tables changed: full


def test_renewals_reads_each_tables_counter():
    tables = {"model_table/0000": SimpleNamespace(renewals=2), "model_table/0001": SimpleNamespace(renewals=0)}
    assert renewals(tables) == {"model_table/0000": 2, "model_table/0001": 0}
    assert renewals(None) == {}
