"""`ps_recovery`: which ps's state a recovery restores, what it reports, what the data
ledger keeps. Pure logic (`psclient._core.part_recovery`) and the config's checks; the
cluster test is tests/checkpoints/test_part_recovery_cluster.py."""

from __future__ import annotations

import pytest

import psclient
from psclient._core.part_recovery import (
    RestoreScope, closures_undone, ledger_positions, resolve_ps_recovery, restore_scope, rolled_back)
from psclient._engine.config import StrategyConfig, with_overrides


def test_part_is_the_default_in_asynchronous_training_and_all_in_synchronous():
    assert resolve_ps_recovery(None, None) == "part"
    assert resolve_ps_recovery(None, 2) == "all"
    assert resolve_ps_recovery("all", None) == "all"
    assert resolve_ps_recovery("all", 2) == "all"
    assert resolve_ps_recovery("part", None) == "part"
    assert StrategyConfig().recovery_mode == "part"
    assert StrategyConfig(replicas_to_aggregate=2).recovery_mode == "all"
    assert StrategyConfig(ps_recovery="all").recovery_mode == "all"


@pytest.mark.parametrize("value", ["some", "PART", 1, True, ["part"]])
def test_a_bad_ps_recovery_names_the_argument_the_value_and_the_choices(value):
    with pytest.raises(ValueError) as raised:
        StrategyConfig(ps_recovery=value)
    message = str(raised.value)
    assert "`ps_recovery`" in message and f"ps_recovery={value!r}" in message
    assert '"part"' in message and '"all"' in message


def test_part_with_replicas_to_aggregate_is_refused_naming_both():
    with pytest.raises(ValueError, match=r"ps_recovery='part' with replicas_to_aggregate=2\. Expected \"all\""):
        StrategyConfig(ps_recovery="part", replicas_to_aggregate=2)


def test_ps_recovery_is_a_keyword_override_of_the_strategy():
    assert with_overrides(None, {"ps_recovery": "all"}).ps_recovery == "all"
    with pytest.raises(ValueError, match="ps_recovery='both'"):
        with_overrides(StrategyConfig(), {"ps_recovery": "both"})
    # The strategy checks its keywords before it connects to anything.
    with pytest.raises(ValueError, match="ps_recovery='both'"):
        psclient.ParameterServerStrategy({"worker": ["127.0.0.1:1"], "ps": ["127.0.0.1:2"]}, ps_recovery="both")


def test_part_restores_the_lost_ps_only_and_keeps_the_ledgers():
    scope = RestoreScope("part", (1,), num_ps=3)
    assert scope.restored_ps == frozenset({1}) and scope.only_ps == frozenset({1})
    assert not scope.rolls_back_ledgers


def test_all_restores_every_ps_and_rolls_the_ledgers_back():
    scope = RestoreScope("all", (1,), num_ps=3)
    assert scope.restored_ps == frozenset({0, 1, 2}) and scope.only_ps is None
    assert scope.rolls_back_ledgers


@pytest.mark.parametrize("lost, num_ps", [((0,), 1), ((0, 1), 2)])
def test_a_part_that_is_every_ps_is_all(lost, num_ps):
    # Nothing survives anywhere: the ledgers roll back, the work since is done again.
    scope = RestoreScope("part", lost, num_ps)
    assert scope.mode == "all" and scope.only_ps is None and scope.rolls_back_ledgers


def test_an_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="'none'"):
        RestoreScope("none", (0,), num_ps=1)


def test_the_report_names_what_each_restored_ps_got_back():
    part = rolled_back(RestoreScope("part", (1,), 2), {1: 4}, {1: 17}, closures={1: 30}, checkpoint="/c/ckpt-2")
    assert part == {1: {"mode": "part", "checkpoint": "/c/ckpt-2", "variables": 4, "rows": 17, "closures": 30}}
    every = rolled_back(RestoreScope("all", (1,), 2), {0: 3, 1: 4}, {}, closures={0: 30, 1: 30}, checkpoint=None)
    assert every == {0: {"mode": "all", "checkpoint": None, "variables": 3, "rows": 0, "closures": 30},
                     1: {"mode": "all", "checkpoint": None, "variables": 4, "rows": 0, "closures": 30}}


@pytest.mark.parametrize("mode", ["part", "all"])
def test_a_lost_ps_that_answers_holding_its_variables_is_not_restored(mode):
    # It hung (SIGSTOP, a cut network) and was taken for lost; it was not restarted.
    assert restore_scope(mode, (0, 1), holding=(0, 1), num_ps=4) is None
    scope = restore_scope(mode, (0, 1), holding=(0,), num_ps=4)
    assert scope.lost == (1,)
    # "part": ps 1 alone; "all": every ps goes back, the one that hung too (one version everywhere).
    assert scope.restored_ps == ({1} if mode == "part" else {0, 1, 2, 3})
    assert restore_scope(mode, (2,), holding=(), num_ps=4).lost == (2,)


def test_a_second_restore_of_a_ps_counts_only_the_closures_since_the_first():
    # Checkpoint at 100 closures; ps 0 restored from it at 130, then again (same checkpoint) at 150:
    # 30, then 20 undone there (50 in all, the updates since the checkpoint), not 30 + 50.
    assert closures_undone(130, 100, {}, (0,)) == {0: 30}
    assert closures_undone(150, 100, {0: 130}, (0, 1)) == {0: 20, 1: 50}
    # A newer checkpoint than the last restore: counted from the checkpoint.
    assert closures_undone(220, 200, {0: 130}, (0,)) == {0: 20}
    assert closures_undone(5, None, {}, (0,)) == {0: 5}  # no checkpoint's count


def test_a_ledger_on_a_restored_ps_gets_the_positions_the_coordinator_knows():
    # Shards 0 and 3 in flight (known at 5 and 2 batches), shard 1 given back at batch 7;
    # the others not started, or done (their positions no longer matter).
    positions, again = ledger_positions({"0": 5, "1": 7, "3": 2}, held={0, 3}, num_shards=5)
    assert positions == [5, 7, 0, 2, 0]
    assert again == [0, 3]


# ------------------------------------------------- the recovery thread's step, with fakes
class FakeStore:
    def __init__(self):
        self.renewed = []

    def renew(self, lost):
        self.renewed.append(set(lost))
        return len(lost)

    def named(self):
        return {"v000000": "a variable on ps 0", "v000001": "a variable on ps 1"}

    def tables(self):
        return {}


class FakeCheckpoints:
    """Restores from one checkpoint taken after 7 completed closures, and says what it restored."""

    def __init__(self):
        self.calls = []

    def restore(self, variables, *, tables, only_ps):
        self.calls.append(only_ps)
        held = {0: 3, 1: 2}
        restored = {ps: n for ps, n in held.items() if only_ps is None or ps in only_ps}
        return {"path": "/c/ckpt-3", "completed_closures": 7, "skipped": [], "meta": {"m": 1},
                "restored": {"variables": restored, "rows": {1: 5} if 1 in restored else {}}}


def restore_step(mode, lost=(1,), holding=()):
    from psclient._core import recovery_messages as rm
    from psclient._engine.ps_restore import PsRestore

    told = []
    store, checkpoints = FakeStore(), FakeCheckpoints()
    restore = PsRestore(store, checkpoints, 2, completed=lambda: 19,
                        meta_restored=lambda meta, **kwargs: told.append((meta, kwargs)), clock=lambda: 10.0,
                        holding=lambda asked: tuple(ps for ps in asked if ps in holding))
    assert restore.renew_and_restore(rm.RenewAndRestore(lost, mode)) is True
    restore.recovered(rm.PsRecovered(lost, back_at=9.5), "/c/ckpt-3")
    return store, checkpoints, told, restore.ps_stats


@pytest.mark.parametrize("mode", ["part", "all"])
def test_a_step_whose_lost_ps_all_hold_their_variables_renews_and_restores_nothing(mode):
    store, checkpoints, told, stats = restore_step(mode, lost=(0, 1), holding=(0, 1))
    assert store.renewed == [] and checkpoints.calls == [] and told == []
    for ps in (0, 1):
        assert stats[ps].recoveries == 1 and stats[ps].rolled_back_closures == 0
        assert stats[ps].rolled_back == {"mode": "kept", "checkpoint": None, "variables": 0, "rows": 0,
                                         "closures": 0}


def test_a_step_restores_the_lost_ps_that_restarted_and_not_the_one_that_hung():
    store, checkpoints, told, stats = restore_step("part", lost=(0, 1), holding=(0,))
    assert store.renewed == [{1}] and checkpoints.calls == [frozenset({1})]
    assert told == [({"m": 1}, {"lost": frozenset({1})})]
    assert stats[0].rolled_back["mode"] == "kept" and stats[0].rolled_back_closures == 0
    assert stats[1].rolled_back["mode"] == "part" and stats[1].rolled_back_closures == 12


def test_the_part_step_restores_the_lost_ps_only_and_keeps_the_ledgers():
    store, checkpoints, told, stats = restore_step("part")
    assert store.renewed == [{1}] and checkpoints.calls == [frozenset({1})]
    assert told == [({"m": 1}, {"lost": frozenset({1})})]  # the ledgers keep their done shards
    assert stats[1].recoveries == 1 and stats[1].last_recovery_s == 0.5
    assert stats[1].rolled_back == {"mode": "part", "checkpoint": "/c/ckpt-3", "variables": 2, "rows": 5,
                                    "closures": 12}
    assert stats[1].rolled_back_closures == 12
    assert stats[0].rolled_back is None and stats[0].recoveries == 0


def test_the_all_step_restores_every_ps_and_rolls_the_ledgers_back():
    store, checkpoints, told, stats = restore_step("all")
    assert store.renewed == [{1}] and checkpoints.calls == [None]
    assert told == [({"m": 1}, {})]
    assert stats[0].rolled_back["variables"] == 3 and stats[1].rolled_back["variables"] == 2
    assert stats[0].recoveries == 0 and stats[1].recoveries == 1


def test_a_ps_renewed_by_a_step_that_failed_is_restored_when_the_step_runs_again():
    """Found by a seeded chaos plan (4 ps, ps 0 killed while it hung): the step renewed ps 0's
    variables, then its restore failed (a function not yet registered on the new task), and the step
    run again found ps 0 answering holding variables, the renewed ones, took it for a ps that had
    hung and restored nothing: training went on with ps 0's variables at their initial values."""
    from psclient._core import recovery_messages as rm
    from psclient._engine.ps_restore import PsRestore

    class FailingOnce(FakeCheckpoints):
        def restore(self, variables, *, tables, only_ps):
            if not self.calls:
                self.calls.append(("failed", only_ps))
                raise RuntimeError("function not registered yet")
            return super().restore(variables, tables=tables, only_ps=only_ps)

    store, checkpoints, renewed_ps = FakeStore(), FailingOnce(), set()
    original_renew = store.renew

    def renew(lost):
        renewed_ps.update(lost)  # the renewed variables answer the probes' handle checks
        return original_renew(lost)

    store.renew = renew
    restore = PsRestore(store, checkpoints, 2, completed=lambda: 19, meta_restored=lambda meta, **kwargs: None,
                        clock=lambda: 10.0, holding=lambda asked: tuple(ps for ps in asked if ps in renewed_ps))
    with pytest.raises(RuntimeError):
        restore.renew_and_restore(rm.RenewAndRestore((0,), "part"))
    assert restore.renew_and_restore(rm.RenewAndRestore((0,), "part")) is True
    assert store.renewed == [{0}, {0}]
    assert checkpoints.calls == [("failed", frozenset({0})), frozenset({0})]
    restore.recovered(rm.PsRecovered((0,), back_at=9.5), "/c/ckpt-3")
    assert restore.ps_stats[0].rolled_back["mode"] == "part" and restore.ps_stats[0].rolled_back["variables"] == 3
    # Restored: a later loss of ps 0 that it answers holding its variables is a hang again.
    assert restore.renew_and_restore(rm.RenewAndRestore((0,), "part")) is True
    assert store.renewed == [{0}, {0}]
