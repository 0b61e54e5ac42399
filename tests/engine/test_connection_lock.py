"""The process-wide connection lock: a connect that cannot get it says who holds it."""

import re
import threading

import pytest

from psclient._coordinator import connection
from psclient._core.view_changes import ViewChanges


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
    record = ViewChanges(slow_s=connection.SLOW_VIEW_CHANGE_S, clock=lambda: next(clock))
    monkeypatch.setattr(connection, "_view_changes", record)
    monkeypatch.setattr(connection, "warning_times", lambda: iter(()))  # the clock is the test's
    monkeypatch.setattr(connection._context, "update_server_def", lambda *args: None)
    monkeypatch.setattr(connection, "_view", {})
    whole = tf.train.ClusterSpec({"chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:2", "127.0.0.1:3"]})
    without_worker_1 = tf.train.ClusterSpec({"chief": ["127.0.0.1:1"], "worker": {0: "127.0.0.1:2"}})
    with caplog.at_level(logging.WARNING, logger="psclient"):
        connection._update_connection(whole, None)  # 1 s: quiet
        assert "took" not in caplog.text
        connection._update_connection(without_worker_1, None)
    assert "took 12.0 s" in caplog.text and "dropped: worker:1" in caplog.text
    assert record.stats() == {"changes": 2, "slow_changes": 1, "longest_s": 12.0, "changing_for_s": 0.0,
                              "changing_tasks": []}


def test_a_change_of_tfs_view_still_waiting_is_logged_and_counted_while_it_waits(monkeypatch):
    """No step runs while TF's update waits, and nothing can cut it short: it is told while it waits
    (in the log, naming the tasks it waits on, and in `view_changes()`, which stats() and the metrics
    read), not only once it returns. TF's update here waits for the test, on the real clock."""
    import logging

    import tensorflow as tf

    record = ViewChanges(slow_s=connection.SLOW_VIEW_CHANGE_S)
    monkeypatch.setattr(connection, "_view_changes", record)
    monkeypatch.setattr(connection, "warning_times", lambda: iter([0.05, 0.1]))
    monkeypatch.setattr(connection, "_view", {})
    warned, release, returned = threading.Event(), threading.Event(), threading.Event()
    messages: list = []

    class Seen(logging.Handler):
        def emit(self, entry):
            messages.append(entry.getMessage())
            if "has waited" in entry.getMessage() and len(messages) >= 2:
                warned.set()

    def update_waits(*args):
        assert release.wait(60), "the test never released TF's update"

    monkeypatch.setattr(connection._context, "update_server_def", update_waits)
    handler = Seen(logging.WARNING)
    logging.getLogger("psclient").addHandler(handler)
    spec = tf.train.ClusterSpec({"localhost": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"], "ps": ["127.0.0.1:3"]})
    changing = threading.Thread(target=lambda: (connection._update_connection(spec, None), returned.set()),
                                name="test-view-change")
    changing.start()
    try:
        assert warned.wait(60), messages
        under_way = connection.view_changes()
        assert under_way["changing_for_s"] > 0 and under_way["changes"] == 0
        assert under_way["changing_tasks"] == ["ps:0", "worker:0"]
    finally:
        release.set()
        changing.join(60)
        logging.getLogger("psclient").removeHandler(handler)
    assert returned.is_set()
    assert re.search(r"has waited \d+ s so far; no step runs until it returns", messages[0]), messages[0]
    assert "ps:0 at 127.0.0.1:3, worker:0 at 127.0.0.1:2" in messages[0] and "127.0.0.1:1" not in messages[0]
    assert not [t for t in threading.enumerate() if t.name == "psclient-view-change-watch"]
    after = connection.view_changes()
    assert after["changes"] == 1 and after["changing_for_s"] == 0.0 and after["changing_tasks"] == []
