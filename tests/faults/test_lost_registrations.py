"""A function whose registration never reaches a task is traced again, by every caller that can.

TF sends a function to the tasks at its first reference in the process; in a seeded chaos plan
one such registration never reached two ps tasks, and every later call of it failed "not
registered" (docs/chaos.md, seed 419). Calls overtaking a registration still on its way are
retried (`until_registered`); once the retries are spent, a caller that says how (`remake`) drops
its trace, and a new one, under a new name, is registered afresh. Here the lost registration is a
call that fails as TF's does; the traces, restores and checkpoints around it are real.
"""

from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from psclient._tf import registrations  # noqa: E402
from psclient._tf.registrations import Renewable, until_registered  # noqa: E402

LOST = ("'__inference_section_1' is neither a type of a primitive operation nor a name of a function "
        "registered in binary running on ps-1.")


def lost(*_args, **_kwargs):
    raise tf.errors.NotFoundError(None, None, LOST)


@pytest.fixture()
def few_attempts(monkeypatch):
    """Two calls per trace instead of 25 (about 10 s of pauses)."""
    monkeypatch.setattr(registrations, "ATTEMPTS", 2)


def test_spent_retries_remake_the_function_once_then_call_the_new_one(few_attempts, caplog):
    calls, current = [], {"function": lost}

    def call():
        calls.append(current["function"])
        return current["function"]()

    def remake():
        current["function"] = lambda: "the new trace"

    assert until_registered(call, remake=remake) == "the new trace"
    assert calls[:2] == [lost, lost] and len(calls) == 3  # the lost one tried ATTEMPTS times, then the new
    assert "never reached a task" in caplog.text


def test_without_remake_or_for_another_error_the_error_is_raised(few_attempts):
    with pytest.raises(tf.errors.NotFoundError, match="neither a type"):
        until_registered(lost)  # no way to trace it again: as before
    remade = []

    def missing_file():
        raise tf.errors.NotFoundError(None, None, "/tmp/x: No such file or directory")

    with pytest.raises(tf.errors.NotFoundError, match="No such file"):
        until_registered(missing_file, remake=lambda: remade.append(1))
    assert not remade  # the function's own error: nothing traced again


def test_a_remade_function_that_is_still_unknown_fails_with_the_error(few_attempts):
    remade = []
    with pytest.raises(tf.errors.NotFoundError, match="neither a type"):
        until_registered(lost, remake=lambda: remade.append(1))
    assert remade == [1]  # once: bounded


def test_a_renewed_function_is_a_new_trace_under_a_new_name():
    def double(x):
        return 2 * x

    function = Renewable(double, autograph=False)
    spec = tf.TensorSpec([], tf.int32)
    first = function.get_concrete_function(spec)
    assert int(function(tf.constant(3))) == 6 and function.tracing_count() == 1
    function.renew()
    second = function.get_concrete_function(spec)
    assert second.name != first.name  # what TF registers on the tasks: a new function
    assert int(function(tf.constant(4))) == 8
    assert function.tracing_count() == 2  # the earlier function's trace counted too


def test_a_restore_section_whose_registration_was_lost_is_traced_again(few_attempts):
    """Without a cluster: a table's import (a restore's section, one trace per form of shard) goes
    through, the shard holds what was imported, and the form's next import uses the new trace."""
    from psclient._coordinator.tables import shard_restore
    from psclient._coordinator.tables.dynamic_tables import DynamicTable
    from psclient._core.dynamic_tables import Policy

    def table(name):
        made = DynamicTable(name, 5, [None], ("zeros",), Policy(capacity=40))
        made.ensure_slots({"accumulator": 0.0390625})  # a form of this module's own
        return made

    def state(seed):
        keys = np.arange(seed, seed + 8, dtype=np.int64)
        return {"keys": keys, "counters": np.stack([np.ones(8, np.int64), np.full(8, 3, np.int64)], 1),
                "row_keys": keys, "rows": np.full([8, 5], seed, np.float32),
                "slots": {"accumulator": np.full([8, 5], 0.5, np.float32)},
                "clock": 7, "admissions": 8, "evictions": 0}

    first, second = table("lost_a"), table("lost_b")
    first.import_shards([state(100)])  # traced the form's section
    ours = [key for key in shard_restore._traced if key[2] == shard_restore.form_of(first.shards[0])]
    assert len(ours) == 1
    shard_restore._traced[ours[0]] = lost  # its registration lost on the way
    traced = shard_restore.trace_count()
    second.import_shards([state(200)])
    assert shard_restore.trace_count() == traced + 1  # traced again, once
    assert shard_restore._traced[ours[0]] is not lost
    exported = second.export_shard(0)
    assert sorted(np.asarray(exported["row_keys"]).tolist()) == list(range(200, 208))
    np.testing.assert_array_equal(np.asarray(exported["rows"]), np.full([8, 5], 200, np.float32))
    first.import_shards([state(300)])  # the new trace, kept
    assert shard_restore.trace_count() == traced + 1
    assert sorted(np.asarray(first.export_shard(0)["row_keys"]).tolist()) == list(range(300, 308))
