"""psclient.Future behaves like concurrent.futures.Future."""

import concurrent.futures

import pytest

import psclient


def test_is_a_stdlib_future_and_works_with_wait_and_as_completed():
    a, b = psclient.Future("a"), psclient.Future("b")
    assert isinstance(a, concurrent.futures.Future)
    b.set_result(2)
    done, not_done = psclient.wait([a, b], timeout=0, return_when=psclient.FIRST_COMPLETED)
    assert done == {b} and not_done == {a}
    a.set_result(1)
    assert sorted(f.result() for f in psclient.as_completed([a, b], timeout=1)) == [1, 2]


def test_resolves_exactly_once():
    f = psclient.Future("f")
    assert f.set_running_or_notify_cancel()
    f.set_result(1)
    with pytest.raises(concurrent.futures.InvalidStateError):
        f.set_result(2)
    with pytest.raises(concurrent.futures.InvalidStateError):
        f.set_exception(ValueError())
    assert f.result() == 1


def test_cancel_only_before_running():
    f = psclient.Future("f")
    assert f.cancel() and f.cancelled()
    g = psclient.Future("g")
    g.set_running_or_notify_cancel()
    assert g.running() and not g.cancel()


def test_result_timeout_and_exception_and_callbacks():
    f = psclient.Future("step")
    with pytest.raises(concurrent.futures.TimeoutError):
        f.result(timeout=0.01)
    seen = []
    f.add_done_callback(lambda fut: seen.append(fut.exception()))
    error = ValueError("x")
    f.set_exception(error)
    assert f.exception(timeout=0) is error
    assert seen == [error]
    with pytest.raises(ValueError):
        f.fetch()


def test_tf_style_aliases_and_repr():
    f = psclient.Future("train_step")
    f.set_result({"loss": 0.5})
    assert f.fetch() == f.get() == {"loss": 0.5}
    assert "train_step" in repr(f) and "finished" in repr(f)
