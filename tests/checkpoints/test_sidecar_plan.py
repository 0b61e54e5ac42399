"""The sidecar evaluator's rules as plain logic: no TensorFlow, no cluster, a fake clock."""

import json
import os

import pytest

from psclient._sidecar.evaluator import (
    FINAL_MARKER,
    Planner,
    read_final_marker,
    write_final_marker,
)
from psclient._sidecar.formats import KERAS, TF, CheckpointRef, scan


def tf_ref(n, order=None):
    return CheckpointRef(f"/d/ckpt-{n}", f"ckpt-{n}", TF, order if order is not None else n, number=n)


def keras_ref(name, order, size=100):
    return CheckpointRef(f"/d/{name}", name, KERAS, order, size)


def planner(settle_time=2.0, idle_timeout=60.0, max_evaluations=None):
    return Planner(settle_time=settle_time, idle_timeout=idle_timeout, max_evaluations=max_evaluations, now=0.0)


def evaluate(p, refs, now, marker=None):
    """Runs one decision, expecting an evaluation, and records its success."""
    decision = p.decide(refs, marker, now)
    assert decision.action == "evaluate", decision
    p.evaluated(decision, now)
    return decision


# Which checkpoint next ------------------------------------------------------------


def test_tf_checkpoints_are_ready_at_once_and_evaluated_in_order():
    p = planner()
    assert evaluate(p, [tf_ref(1)], 0.0).checkpoint.name == "ckpt-1"
    assert p.decide([tf_ref(1)], None, 0.5).action == "wait"
    assert evaluate(p, [tf_ref(1), tf_ref(2)], 1.0).checkpoint.name == "ckpt-2"


def test_falling_behind_evaluates_the_newest_and_reports_the_skipped():
    p = planner()
    evaluate(p, [tf_ref(1)], 0.0)
    decision = evaluate(p, [tf_ref(1), tf_ref(2), tf_ref(3), tf_ref(4)], 1.0)
    assert decision.checkpoint.name == "ckpt-4"
    assert [r.name for r in decision.skipped] == ["ckpt-2", "ckpt-3"]
    assert p.decide([tf_ref(1), tf_ref(2), tf_ref(3), tf_ref(4)], None, 2.0).action == "wait"


def test_an_unreadable_newest_leaves_the_older_ones_to_evaluate():
    p = planner(settle_time=0.0)
    refs = [tf_ref(1), tf_ref(2)]
    decision = p.decide(refs, None, 0.0)
    assert decision.checkpoint.name == "ckpt-2"
    assert p.unreadable(decision.checkpoint, 0.0) is True  # Given up: TF checkpoints are complete when seen.
    assert evaluate(p, refs, 0.1).checkpoint.name == "ckpt-1"


# The settle rule for Keras files (written in place) ----------------------------------


def test_a_growing_keras_file_is_never_ready():
    p = planner(settle_time=2.0, idle_timeout=None)
    for second in range(10):
        growing = keras_ref("model.weights.h5", order=second, size=100 * (second + 1))
        assert p.decide([growing], None, float(second)).action == "wait"


def test_a_keras_file_is_ready_once_unchanged_for_the_settle_time():
    p = planner(settle_time=2.0)
    ref = keras_ref("model.weights.h5", order=5)
    assert p.decide([ref], None, 10.0).action == "wait"
    assert p.decide([ref], None, 11.9).action == "wait"
    assert evaluate(p, [ref], 12.0).checkpoint is ref


def test_a_keras_file_is_ready_once_a_newer_one_exists():
    p = planner(settle_time=100.0)
    old, new = keras_ref("e1.weights.h5", order=1), keras_ref("e2.weights.h5", order=2)
    decision = p.decide([old, new], None, 0.0)
    assert decision.checkpoint is old  # Keras finished it before starting e2; e2 may be half-written.
    p.evaluated(decision, 0.0)
    assert p.decide([old, new], None, 1.0).action == "wait"


def test_a_rewritten_file_is_a_new_checkpoint():
    p = planner(settle_time=1.0)
    first = keras_ref("best.weights.h5", order=1, size=100)
    p.decide([first], None, 0.0)
    evaluate(p, [first], 1.0)
    rewritten = keras_ref("best.weights.h5", order=7, size=100)
    assert p.decide([rewritten], None, 2.0).action == "wait"  # Changed: settling again.
    assert evaluate(p, [rewritten], 3.0).checkpoint is rewritten


def test_failed_read_is_retried_while_unsettled_and_given_up_when_settled():
    p = planner(settle_time=5.0)
    old, new = keras_ref("e1.weights.h5", order=1), keras_ref("e2.weights.h5", order=2)
    decision = p.decide([old, new], None, 0.0)  # e1 is superseded, not yet settled.
    assert p.unreadable(decision.checkpoint, 0.0) is False
    assert p.decide([old, new], None, 1.0).checkpoint is old  # Retried.
    assert p.unreadable(old, 6.0) is True  # Unchanged for 6 s and still unreadable: corrupt.
    assert p.decide([old, new], None, 6.0).action == "evaluate"  # e2 has settled by now.
    assert p.decide([old, new], None, 6.0).checkpoint is new


# Stop rules ----------------------------------------------------------------------


def test_stops_after_max_evaluations():
    p = planner(max_evaluations=2)
    evaluate(p, [tf_ref(1)], 0.0)
    evaluate(p, [tf_ref(1), tf_ref(2)], 1.0)
    decision = p.decide([tf_ref(1), tf_ref(2), tf_ref(3)], None, 2.0)
    assert (decision.action, decision.reason) == ("stop", "max_evaluations=2 reached")


def test_final_marker_evaluates_its_checkpoint_then_stops():
    p = planner(settle_time=100.0)
    marker = {"checkpoint": "final.weights.h5", "step": 30}
    final = keras_ref("final.weights.h5", order=3)
    refs = [keras_ref("e1.weights.h5", order=1), final]
    decision = evaluate(p, refs, 0.0, marker)  # The marker says it is complete: no settling.
    assert decision.checkpoint is final and [r.name for r in decision.skipped] == ["e1.weights.h5"]
    decision = p.decide(refs, marker, 0.1)
    assert decision.action == "stop" and "final checkpoint final.weights.h5 is done" in decision.reason


def test_final_marker_naming_nothing_stops_with_the_reason():
    decision = planner().decide([tf_ref(1)], {"checkpoint": "ckpt-9", "step": None}, 0.0)
    assert decision.action == "stop"
    assert "'ckpt-9', which is not a checkpoint in the directory" in decision.reason


def test_idle_timeout_counts_from_the_last_new_checkpoint():
    p = planner(idle_timeout=10.0)
    evaluate(p, [tf_ref(1)], 5.0)
    assert p.decide([tf_ref(1)], None, 14.9).action == "wait"
    decision = p.decide([tf_ref(1)], None, 15.0)
    assert decision.action == "stop" and "no new checkpoint for 10 s (idle_timeout)" in decision.reason


def test_missing_directory_waits_until_the_idle_timeout():
    p = planner(idle_timeout=3.0)
    decision = p.decide(None, None, 1.0)
    assert (decision.action, decision.reason) == ("wait", "the checkpoint directory does not exist")
    decision = p.decide(None, None, 3.0)
    assert decision.action == "stop" and "does not exist for 3 s" in decision.reason


# The final marker and scans on real files ------------------------------------------


def test_final_marker_round_trip_is_atomic_and_relative(tmp_path):
    assert read_final_marker(tmp_path) is None
    path = write_final_marker(tmp_path, tmp_path / "ckpt-12", step=1200)
    assert path == os.path.join(tmp_path, FINAL_MARKER)
    marker = read_final_marker(str(tmp_path))
    assert marker["checkpoint"] == "ckpt-12" and marker["step"] == 1200
    assert isinstance(marker["written_at"], float)
    assert os.listdir(tmp_path) == [FINAL_MARKER]  # No temporary left behind.
    write_final_marker(tmp_path, "model.keras")
    assert json.loads((tmp_path / FINAL_MARKER).read_text())["step"] is None
    with pytest.raises(TypeError, match=r"argument `step`. Received: step='3'"):
        write_final_marker(tmp_path, "x", step="3")


def test_scan_sees_keras_files_but_not_temporaries_or_subdirectories(tmp_path):
    assert scan(str(tmp_path / "missing")) is None
    (tmp_path / "a.weights.h5").write_bytes(b"x")
    (tmp_path / "b.keras").write_bytes(b"xy")
    (tmp_path / ".b.keras.tmp-1.keras").write_bytes(b"x")
    (tmp_path / "notes.txt").write_text("x")
    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / "c.keras").write_bytes(b"x")
    # No state file: half-written TF data files are invisible.
    (tmp_path / "ckpt-1.index").write_bytes(b"partial")
    refs = scan(str(tmp_path), frozenset([str(tmp_path / "b.keras")]))
    assert [r.name for r in refs] == ["a.weights.h5"]
    assert refs[0].kind == KERAS and refs[0].size == 1
