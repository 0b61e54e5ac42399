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
