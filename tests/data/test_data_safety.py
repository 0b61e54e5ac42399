"""Checkpoints are user data: nothing of another run is overwritten, pruned or half-restored.

A strategy refuses a checkpoint_dir holding another run's
checkpoints unless restore() adopts them or overwrite_checkpoints=True;
restore() falls back from a missing or damaged newest checkpoint to the newest
complete one and says so; damaged or mismatching checkpoints raise errors
naming the file and the variable, before any variable is assigned; temporary
files have unpredictable names and finished files the mode of any new file; a
failed constructor leaves nothing connected; join() rejects negative timeouts.

The `Checkpoints` tests use local variables (no cluster); the strategy tests
share the session's LocalCluster, one strategy at a time.
"""

import gc
import math
import os
import stat

import numpy as np
import pytest

import psclient
from psclient._engine import registry
from psclient._coordinator.checkpoints.checkpoint import Checkpoints, CheckpointUnreadable
from psclient._core.files import replaced_atomically

pytestmark = pytest.mark.timeout(300)


# ------------------------------------------------------------------ helpers
def variables(dtype="float32", big=64):
    import tensorflow as tf

    return {"v000000": tf.Variable(tf.zeros([4], dtype), name="small"),
            "v000001": tf.Variable(tf.zeros([big], dtype), name="big")}


def fill(named, value):
    for v in named.values():
        v.assign(np.full(v.shape, value, v.dtype.as_numpy_dtype))


def write_run(directory, values, keep=5, dtype="float32"):
    """One run's checkpoints: ckpt-1.. with every variable = values[i]; returns their paths."""
    named, ckpt = variables(dtype), Checkpoints(str(directory), keep=keep)
    paths = []
    for i, value in enumerate(values):
        fill(named, value)
        paths.append(ckpt.save(named, completed=10 * (i + 1)))
    return paths


def listing(directory):
    return {name: (os.stat(directory / name).st_size, os.stat(directory / name).st_mtime_ns)
            for name in os.listdir(directory)}


def data_file(path):
    """The data file of the variables' part: the first of two (the last holds the coordinator's scalars)."""
    return path + ".data-00000-of-00002"


def damage_big_variable(path, value):
    """Flip bytes inside the big variable's values in checkpoint `path` (found by its bytes)."""
    data = data_file(path)
    with open(data, "r+b") as f:
        offset = f.read().find(np.full(64, value, np.float32).tobytes())
        assert offset >= 0
        f.seek(offset + 40)
        f.write(b"\xff" * 8)


def new_file_mode():
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


# --------------------------------------------- another run's checkpoints
def test_a_new_run_refuses_another_runs_checkpoints_and_leaves_them_as_they_are(tmp_path):
    write_run(tmp_path, [1.0, 2.0, 3.0], keep=3)
    before = listing(tmp_path)
    second = Checkpoints(str(tmp_path), keep=1)  # would prune all but one
    assert second.latest() is None  # never restored into this run (e.g. by a ps recovery)
    with pytest.raises(FileExistsError) as error:
        second.save(variables(), completed=1)
    message = str(error.value)
    for part in (repr(str(tmp_path)), "3 checkpoint(s)", str(tmp_path / "ckpt-3"), "after 30 completed closures",
                 "strategy.restore()", "overwrite_checkpoints=True"):
        assert part in message
    assert listing(tmp_path) == before


def test_restore_adopts_them_and_the_run_goes_on_numbering_past_them(tmp_path):
    write_run(tmp_path, [1.0, 2.0])
    second, named = Checkpoints(str(tmp_path), keep=5), variables()
    restored = second.restore(named, adopt=True)
    assert restored == {"path": str(tmp_path / "ckpt-2"), "completed_closures": 20, "skipped": [], "meta": {},
                        "restored": {"variables": {-1: 2}, "rows": {}}}  # per ps task; -1: on none
    assert named["v000001"].numpy().tolist() == [2.0] * 64
    assert second.save(named, completed=21) == str(tmp_path / "ckpt-3")
    assert second.latest() == str(tmp_path / "ckpt-3")


def test_overwrite_starts_over_and_never_reads_the_old_ones(tmp_path):
    write_run(tmp_path, [1.0, 2.0])
    second, named = Checkpoints(str(tmp_path), keep=2, overwrite=True), variables()
    assert second.latest() is None and second.restore(named) is None  # a ps recovery finds nothing old
    fill(named, 7.0)
    assert second.save(named, completed=1) == str(tmp_path / "ckpt-3")
    second.save(named, completed=2)
    assert not any(n.startswith(("ckpt-1.", "ckpt-2.")) for n in os.listdir(tmp_path))  # pruned: asked for
    fill(named, 0.0)
    assert second.restore(named)["path"] == str(tmp_path / "ckpt-4")
    assert named["v000000"].numpy().tolist() == [7.0] * 4


# -------------------------------------------------------- restore fallback
def test_a_missing_newest_checkpoint_falls_back_to_the_newest_complete_one(tmp_path):
    paths = write_run(tmp_path, [1.0, 2.0, 3.0])
    for name in os.listdir(tmp_path):
        if name.startswith("ckpt-3."):
            os.remove(tmp_path / name)  # the state file still names it
    named = variables()
    restored = Checkpoints(str(tmp_path), keep=5).restore(named, adopt=True)
    assert restored["path"] == paths[1] and restored["completed_closures"] == 20
    (skipped,) = restored["skipped"]
    assert skipped["path"] == paths[2] and "ckpt-3.index is missing" in skipped["error"]
    assert named["v000000"].numpy().tolist() == [2.0] * 4


def test_a_corrupt_newest_checkpoint_is_named_with_its_variable_and_passed_over(tmp_path):
    paths = write_run(tmp_path, [1.0, 2.0], dtype="float32")
    damage_big_variable(paths[1], 2.0)
    named = variables()
    restored = Checkpoints(str(tmp_path), keep=5).restore(named, adopt=True)
    assert restored["path"] == paths[0]
    (skipped,) = restored["skipped"]
    assert skipped["path"] == paths[1]
    assert "v000001 (big" in skipped["error"] and "cannot be read" in skipped["error"]
    assert named["v000001"].numpy().tolist() == [1.0] * 64


def test_no_complete_checkpoint_raises_naming_each_and_restores_nothing(tmp_path):
    (path,) = write_run(tmp_path, [5.0], dtype="float32")
    damage_big_variable(path, 5.0)
    named = variables()
    fill(named, -1.0)
    with pytest.raises(CheckpointUnreadable) as error:
        Checkpoints(str(tmp_path), keep=5).restore(named, adopt=True)
    assert path in str(error.value) and "v000001 (big" in str(error.value)
    assert "no variable was restored" in str(error.value)
    # v000000 was readable, but nothing is assigned before everything is read.
    assert named["v000000"].numpy().tolist() == [-1.0] * 4


def test_a_truncated_checkpoint_names_the_file_and_variable(tmp_path):
    (path,) = write_run(tmp_path, [5.0])
    os.truncate(data_file(path), 30)
    with pytest.raises(CheckpointUnreadable, match="cannot be read") as error:
        Checkpoints(str(tmp_path), keep=5).restore(variables(), adopt=True)
    assert path in str(error.value) and ("(small" in str(error.value) or "(big" in str(error.value))


def test_a_checkpoint_of_another_dtype_names_the_file_and_variable(tmp_path):
    (path,) = write_run(tmp_path, [5.0], dtype="float64")
    named = variables("float32")
    fill(named, -1.0)
    with pytest.raises(ValueError, match="does not match") as error:
        Checkpoints(str(tmp_path), keep=5).restore(named, adopt=True)
    assert path in str(error.value)
    assert "v000000 (small" in str(error.value) and "dtype float64 there but float32 here" in str(error.value)
    assert all(v.numpy().tolist() == [-1.0] * v.shape[0] for v in named.values())


# ------------------------------------------------------------ atomic files
def test_temporary_files_are_unpredictable_and_finished_ones_readable_like_any_new_file(tmp_path):
    final = tmp_path / "best.keras"
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    # The old predictable temporary name, planted as a link to another file.
    os.symlink(victim, tmp_path / f".best.keras.tmp-{os.getpid()}.keras")
    with replaced_atomically(final) as temp:
        assert os.path.dirname(temp) != str(tmp_path) and stat.S_IMODE(os.stat(os.path.dirname(temp)).st_mode) == 0o700
        with open(temp, "w") as f:
            f.write("new")
    assert final.read_text() == "new" and victim.read_text() == "keep me"
    assert stat.S_IMODE(os.stat(final).st_mode) == new_file_mode()
    assert sorted(os.listdir(tmp_path)) == sorted(["best.keras", "victim", f".best.keras.tmp-{os.getpid()}.keras"])


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    final = tmp_path / "marker.json"
    final.write_text("old")
    with pytest.raises(RuntimeError), replaced_atomically(final) as temp:
        with open(temp, "w") as f:
            f.write("half")
        raise RuntimeError("the writer failed")
    assert final.read_text() == "old" and os.listdir(tmp_path) == ["marker.json"]


def test_the_final_marker_is_readable_like_the_checkpoints_beside_it(tmp_path):
    path = psclient.write_final_marker(tmp_path, tmp_path / "ckpt-1", step=3)
    assert stat.S_IMODE(os.stat(path).st_mode) == new_file_mode()
    assert psclient.read_final_marker(tmp_path)["checkpoint"] == "ckpt-1"
    assert os.listdir(tmp_path) == ["psclient-final.json"]


# --------------------------------------------------------- on a cluster
@pytest.mark.long
@pytest.mark.cluster
def test_a_strategy_refuses_at_the_first_schedule_until_restore_or_overwrite(local_cluster, tmp_path):
    import tensorflow as tf

    def make(**kwargs):
        strategy = psclient.ParameterServerStrategy(local_cluster.cluster, checkpoint_dir=tmp_path, **kwargs)
        with strategy.scope():
            v = tf.Variable(0.0)
        return strategy, v

    @tf.function
    def step(v):
        v.assign_add(1.0)

    first, v = make()
    first.schedule(step, (v,))
    first.join()
    first.shutdown()
    before = listing(tmp_path)

    second, v = make()
    with pytest.raises(FileExistsError, match="holds the checkpoints of another run"):
        second.schedule(step, (v,))
    with pytest.raises(FileExistsError, match="overwrite_checkpoints=True"):
        second.save_checkpoint()
    assert listing(tmp_path) == before
    assert second.restore()["path"] == str(tmp_path / "ckpt-1")
    second.schedule(step, (v,))
    second.join()
    assert v.numpy() == 1.0  # restored 0.0 (taken before the first step), plus one step
    second.shutdown()

    third, v = make(overwrite_checkpoints=True)
    third.schedule(step, (v,))
    third.join()
    assert third.save_checkpoint() == str(tmp_path / "ckpt-3")  # ckpt-2: before its first step
    third.shutdown()


@pytest.mark.cluster
def test_a_failed_constructor_leaves_nothing_connected(local_cluster, tmp_path, monkeypatch):
    from psclient._engine.dispatch import Dispatcher

    a_file = tmp_path / "not-a-dir"
    a_file.write_text("x")
    gc.disable()  # the next strategy must not depend on a collection of the failed one
    try:
        with pytest.raises(ValueError, match="which is a file, not a directory") as before_connecting:
            psclient.ParameterServerStrategy(local_cluster.cluster, checkpoint_dir=a_file)
        assert str(a_file) in str(before_connecting.value) and registry.current() is None

        def broken_start(self):
            raise RuntimeError("cannot start a thread")

        with monkeypatch.context() as patch:  # a failure after connecting is undone
            patch.setattr(Dispatcher, "start", broken_start)  # the dispatcher starts once connected
            with pytest.raises(RuntimeError, match="cannot start a thread") as after_connecting:
                psclient.ParameterServerStrategy(local_cluster.cluster)
        assert registry.current() is None

        strategy = psclient.ParameterServerStrategy(local_cluster.cluster)  # at once
        try:
            for timeout in (-1, math.nan):
                with pytest.raises(ValueError, match=r"`timeout`. Received: timeout=.*Expected a number"):
                    strategy.join(timeout=timeout)
            strategy.join(timeout=0)
            strategy.join(timeout=math.inf)
        finally:
            strategy.shutdown()
        del before_connecting, after_connecting  # they held the failed objects alive until here
    finally:
        gc.enable()
