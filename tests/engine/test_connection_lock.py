"""The process-wide connection lock: a connect that cannot get it says who holds it."""

import threading

import pytest

from psclient._coordinator import connection


def test_a_connect_that_times_out_names_the_thread_holding_the_lock(monkeypatch):
    monkeypatch.setattr(connection, "CONNECTION_LOCK_TIMEOUT", 0.2)
    holding, release = threading.Event(), threading.Event()

    def hold():
        with connection._connection_lock("reconnect the workers"):
            holding.set()
            release.wait(30)

    holder = threading.Thread(target=hold, name="psclient-health-test", daemon=True)
    holder.start()
    try:
        assert holding.wait(30)
        with pytest.raises(TimeoutError) as raised:
            with connection._connection_lock("connect to the cluster"):
                pass
        message = str(raised.value)
        assert "Cannot connect to the cluster" in message
        assert "'psclient-health-test', to reconnect the workers" in message
    finally:
        release.set()
        holder.join(30)
    with connection._connection_lock("connect to the cluster"):  # free again
        assert connection._lock_holder[1] == "connect to the cluster"
    assert connection._lock_holder is None


def test_connection_changes_count_the_start_and_the_end_of_each_change():
    """What `ps_access` compares before and after an access: odd while a change is under way."""
    before = connection.connection_changes()
    with connection._connection_lock("reconnect the workers"):
        assert connection.connection_changes() == before + 1  # under way
    assert connection.connection_changes() == before + 2
    with pytest.raises(RuntimeError):
        with connection._connection_lock("connect to the cluster"):
            raise RuntimeError("the update failed")
    assert connection.connection_changes() == before + 4  # ended, failed or not


def test_a_slow_change_of_tfs_view_is_logged_naming_the_tasks_it_dropped(monkeypatch, caplog):
    """TF's update closes the old context on each task it drops and waits for every answer without a
    deadline (a reconnect of a seeded chaos plan waited 54 s there): a slow one says what it dropped.
    TF's update itself stands still here (only the clock moves), and so does the module's view."""
    import logging

    import tensorflow as tf

    clock = iter([0.0, 1.0, 100.0, 100.0 + connection.SLOW_VIEW_CHANGE_S + 2])
    monkeypatch.setattr(connection.time, "monotonic", lambda: next(clock))
    monkeypatch.setattr(connection._context, "update_server_def", lambda *args: None)
    monkeypatch.setattr(connection, "_view", {})
    whole = tf.train.ClusterSpec({"chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:2", "127.0.0.1:3"]})
    without_worker_1 = tf.train.ClusterSpec({"chief": ["127.0.0.1:1"], "worker": {0: "127.0.0.1:2"}})
    with caplog.at_level(logging.WARNING, logger="psclient"):
        connection._update_connection(whole, None)  # 1 s: quiet
        assert "took" not in caplog.text
        connection._update_connection(without_worker_1, None)
    assert "took 12.0 s" in caplog.text and "dropped: worker:1" in caplog.text
