"""Two bugs a throttled worker (LocalCluster.throttle) brought out in benchmarks/sync_vs_async.py.

1. Futures the scheduler cancelled (an earlier step failed, or shutdown) were
   never seen as done by `concurrent.futures.wait`/`as_completed` (hence
   `psclient.wait`): stdlib's `Future.cancel()` does not wake them. A
   benchmark waiting on its warm-up steps hung for good.
2. A call that overtook its function's registration on a slow worker failed
   with TF's "... is neither a type of a primitive operation nor a name of a
   function registered ..." NotFoundError, a wording the retry did not know.
"""

import concurrent.futures

import pytest

from psclient._core.future import Future
from psclient._core.closure import Closure
from psclient._core.scheduler import Scheduler


def make(name="fn"):
    return Closure(lambda: None, (), {}, Future(name))


def test_futures_cancelled_after_an_error_are_done_for_wait_and_as_completed():
    s = Scheduler(num_workers=1)
    closures = [make(f"c{i}") for i in range(4)]
    for c in closures:
        s.submit(c)
    taken = s.take(0, timeout=0)
    s.failed(0, taken, ValueError("boom"), retry=False)
    futures = [c.future for c in closures]
    done, not_done = concurrent.futures.wait(futures, timeout=5)
    assert not not_done and len(done) == 4
    assert sorted(f.cancelled() for f in futures) == [False, True, True, True]
    assert len(list(concurrent.futures.as_completed(futures, timeout=5))) == 4
    with pytest.raises(ValueError, match="boom"):
        s.join(timeout=1)


def test_futures_cancelled_by_close_are_done_for_wait():
    s = Scheduler(num_workers=1)
    queued = [make("a"), make("b")]
    for c in queued:
        s.submit(c)
    queued[0].future.cancel()  # The user cancelled one first: closing must not trip over it.
    s.close()
    _, not_done = concurrent.futures.wait([c.future for c in queued], timeout=5)
    assert not not_done and all(c.future.cancelled() for c in queued)


def test_the_primitive_operation_wording_counts_as_not_registered_yet():
    tf = pytest.importorskip("tensorflow")
    from psclient._coordinator.runtime import function_not_registered_yet

    seen = ("'__inference_train_step_342' is neither a type of a primitive operation nor a name of a "
            "function registered in binary running on vm. Make sure the operation or function is "
            "registered in the binary running in this process.")
    assert function_not_registered_yet(tf.errors.NotFoundError(None, None, seen))
    assert function_not_registered_yet(tf.errors.NotFoundError(None, None, "Op type not registered 'f'"))
    assert not function_not_registered_yet(tf.errors.NotFoundError(None, None, "/tmp/x: No such file"))
    # A function the called one calls, not arrived yet: the worker fails building the call's graph
    # (seen in a seeded chaos plan, a step's first call on a rejoined worker).
    inside = ("Op type not registered 'functional_3_1_chaos_table_1_cond_1_false_84632' in binary running "
              "on vm. Make sure the Op and Kernel are registered in the binary running in this process.")
    assert function_not_registered_yet(tf.errors.InvalidArgumentError(None, None, inside))
    assert function_not_registered_yet(tf.errors.InvalidArgumentError(None, None, seen))
    assert not function_not_registered_yet(tf.errors.InvalidArgumentError(None, None, "Unable to find Function 'f'"))
    assert not function_not_registered_yet(tf.errors.InvalidArgumentError(None, None, "Incompatible shapes"))


def test_a_function_no_task_received_is_traced_again_and_the_new_one_kept():
    """A registration lost on its way (a chaos plan: a shard's stats function never reached two ps)
    failed every later call with "not registered"; a new trace is registered afresh."""
    tf = pytest.importorskip("tensorflow")
    from psclient._tf.registrations import RegisteredCall

    lost = "'__inference__stats_values_1' is neither a type of a primitive operation nor a name of a function registered"
    made, calls = [], []

    def make():
        number = len(made)

        def function():
            calls.append(number)
            if number == 0:  # the first trace's registration never arrives
                raise tf.errors.NotFoundError(None, None, lost)
            return f"trace {number}"

        made.append(function)
        return function

    call = RegisteredCall(make, attempts=3)
    assert call() == "trace 1"
    assert calls == [0, 0, 0, 1]  # the first trace tried `attempts` times, then a new one
    assert call() == "trace 1" and len(made) == 2 and call.function is made[1]  # the new one is kept

    def own_error():
        raise tf.errors.NotFoundError(None, None, "/tmp/x: No such file")

    with pytest.raises(tf.errors.NotFoundError, match="No such file"):
        RegisteredCall(lambda: own_error, attempts=3)()  # not a registration: raised at once
