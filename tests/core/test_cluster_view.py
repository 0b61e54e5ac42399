"""The gate between TF's cluster view changes and function registrations (`psclient._tf.cluster_view`).

Pure Python: threads and events stand in for TF's calls.
"""

import threading
import time

import pytest

from psclient._tf import cluster_view

WAIT_S = 10.0  # generous: a loaded machine schedules threads late
#: How long a test's view change stays inside until the test releases it: far above WAIT_S, so that
#: a process stopped for a while (a collection in another thread, a loaded machine) does not let
#: the change end on its own while the test still looks for what it holds (it did once, in CI's
#: order of modules). Every release is set at the test's end, passed or failed.
HELD_S = 6 * WAIT_S
_RELEASES: list = []


@pytest.fixture(autouse=True)
def _released():
    yield
    while _RELEASES:
        _RELEASES.pop().set()


def _release() -> threading.Event:
    event = threading.Event()
    _RELEASES.append(event)
    return event


def test_a_registration_waits_while_another_thread_changes_the_view():
    inside, release, registered = threading.Event(), _release(), threading.Event()

    def change():
        with cluster_view.changing_view():
            inside.set()
            release.wait(HELD_S)

    def register():
        with cluster_view.registration_gate():
            registered.set()

    changer = threading.Thread(target=change)
    changer.start()
    assert inside.wait(WAIT_S)
    registrar = threading.Thread(target=register)
    registrar.start()
    assert not registered.wait(0.3), "a registration went into TF while the view changed"
    release.set()
    assert registered.wait(WAIT_S), "the registration did not go on after the change"
    changer.join(WAIT_S)
    registrar.join(WAIT_S)


def test_the_thread_that_changes_the_view_passes_its_own_gate():
    # (A garbage collection in it may remove a function while it changes the view.)
    passed = []
    with cluster_view.changing_view(), cluster_view.registration_gate():
        passed.append(True)
    assert passed == [True]


def test_a_view_change_waits_for_registrations_already_past_the_gate():
    inside, release, changed = threading.Event(), _release(), threading.Event()

    def register():
        with cluster_view.registration_gate():
            inside.set()
            release.wait(HELD_S)

    def change():
        with cluster_view.changing_view():
            changed.set()

    registrar = threading.Thread(target=register)
    registrar.start()
    assert inside.wait(WAIT_S)
    changer = threading.Thread(target=change)
    changer.start()
    assert not changed.wait(0.3), "the view changed under a registration inside TF"
    release.set()
    assert changed.wait(WAIT_S)
    registrar.join(WAIT_S)
    changer.join(WAIT_S)


def test_registrations_pass_one_another():
    inside, release = threading.Event(), _release()
    second = threading.Event()

    def first():
        with cluster_view.registration_gate():
            inside.set()
            release.wait(HELD_S)

    holder = threading.Thread(target=first)
    holder.start()
    assert inside.wait(WAIT_S)
    with cluster_view.registration_gate():
        second.set()
    assert second.is_set()
    release.set()
    holder.join(WAIT_S)


def test_a_view_change_ends_after_the_registrations_it_held_have_passed():
    # The held registrations go before the changing thread goes on (module doc: TF's streaming
    # switch, which a streamed registration turns on for the whole process).
    inside, release, order = threading.Event(), _release(), []

    def change():
        with cluster_view.changing_view():
            inside.set()
            release.wait(HELD_S)
        order.append("change ended")

    def register():
        with cluster_view.registration_gate():
            order.append("registered")

    changer = threading.Thread(target=change)
    changer.start()
    assert inside.wait(WAIT_S)
    registrar = threading.Thread(target=register)
    registrar.start()
    deadline = time.monotonic() + WAIT_S
    while not cluster_view._waiting and time.monotonic() < deadline:  # noqa: SLF001 - held at the gate
        time.sleep(0.01)
    assert cluster_view._waiting, "the registration was not held at the gate"  # noqa: SLF001
    release.set()
    changer.join(WAIT_S)
    registrar.join(WAIT_S)
    assert order == ["registered", "change ended"]
