"""schedule()'s trace through a ps loss: `Tracer.ready_closure`'s guard (local TF, no cluster)."""

import threading

import pytest

tf = pytest.importorskip("tensorflow")

from psclient._coordinator.parts import Prepare  # noqa: E402
from psclient._coordinator.tracing import Tracer  # noqa: E402
from psclient._tf.variables import renew_handle  # noqa: E402


def place_nowhere(next_creator, **kwargs):
    return next_creator(**kwargs)


def lock_is_free(lock) -> bool:
    """Whether another thread could take `lock` now (the caller's own hold counts: an RLock)."""
    free = []

    def probe():
        if lock.acquire(blocking=False):
            lock.release()
            free.append(True)

    thread = threading.Thread(target=probe)
    thread.start()
    thread.join()
    return bool(free)


def test_a_trace_that_fails_is_made_again_whole_by_the_guard_outside_the_tracers_lock():
    tracer = Tracer(place_nowhere)
    traces, checkpoints, waits = [], [], []

    @tf.function(autograph=False)
    def step():
        traces.append("started")
        if len(traces) == 1:  # what a read of a lost ps at trace time raises
            raise tf.errors.UnavailableError(None, None, "Socket closed")
        return tf.constant(1)

    def guard(attempt, what):
        try:
            return attempt()
        except tf.errors.UnavailableError:
            waits.append((what, lock_is_free(tracer.lock)))  # where the recovery is waited for
            return attempt()

    submitted = []
    closure = tracer.ready_closure(step, (), None, before_trace=lambda: checkpoints.append(1),
                                   submit=submitted.append, guard=guard)
    assert submitted == [closure] and len(traces) == 2
    assert waits == [("tracing 'step' for schedule()", True)]
    assert checkpoints == [1, 1]  # the checkpoint of new variables is part of the attempt
    assert int(closure.fn()) == 1


def test_what_submit_refuses_is_raised_not_retried():
    tracer = Tracer(place_nowhere)
    guarded = []

    def guard(attempt, what):
        outcome = attempt()
        guarded.append(outcome)
        return outcome

    def refuse(closure):
        raise tf.errors.UnavailableError(None, None, "an earlier scheduled function failed")

    with pytest.raises(tf.errors.UnavailableError, match="earlier scheduled function"):
        tracer.ready_closure(tf.function(lambda: tf.constant(1)), (), None, before_trace=lambda: None,
                             submit=refuse, guard=guard)
    assert len(guarded) == 1 and isinstance(guarded[0], tf.errors.UnavailableError)  # returned, not raised


def test_a_closure_out_of_the_queue_at_a_retrace_is_traced_again_before_it_runs():
    """A ps recovery retraces what is queued; a closure elsewhere then (a dispatcher classifying its
    failure, say) and queued again later must not run its old trace, which names the resources the
    recovery made again. `Tracer.current` traces it again; `parts.Prepare` asks it before each call."""
    tracer = Tracer(place_nowhere)
    variable = tf.Variable(1.0)

    @tf.function(autograph=False)
    def read():
        return variable.read_value()

    out_of_the_queue, queued = [], []
    for into in (out_of_the_queue, queued):
        tracer.ready_closure(read, (), None, before_trace=lambda: None, submit=into.append)
    old = out_of_the_queue[0].fn
    # What a ps recovery does to a variable of the lost ps: a new resource under the same object.
    renew_handle(variable, "/job:localhost/replica:0/task:0/device:CPU:0")
    variable.assign(2.0)
    assert float(old()) == 1.0  # the old trace reads the old resource
    tracer.retrace(queued)  # the recovery's retrace: the queued closure only
    assert queued[0].generation == tracer.generation == 1 and out_of_the_queue[0].generation == 0
    function, args, kwargs = Prepare(tracer)(out_of_the_queue[0], 0)
    assert out_of_the_queue[0].generation == 1 and function is not old
    assert float(function(*args, **kwargs)) == 2.0
    assert not tracer.current(out_of_the_queue[0]) and not tracer.current(queued[0])  # an integer compare now


def test_a_trace_again_that_fails_is_tried_again_at_the_next_call():
    """The dispatcher's trace of an old closure can meet a lost ps (a trace reads ps state eagerly):
    the call fails as any failed call does, and the closure keeps its old generation, so its next
    attempt traces again rather than running the old trace."""
    tracer = Tracer(place_nowhere)
    traces = []

    @tf.function(autograph=False)
    def step():
        traces.append(1)
        if len(traces) == 2:  # the first trace again, after the retrace below
            raise tf.errors.UnavailableError(None, None, "Socket closed")
        return tf.constant(len(traces))

    out_of_the_queue = []
    tracer.ready_closure(step, (), None, before_trace=lambda: None, submit=out_of_the_queue.append)
    closure = out_of_the_queue[0]
    tracer.retrace([])
    with pytest.raises(tf.errors.UnavailableError):
        Prepare(tracer)(closure, 0)
    assert closure.generation == 0
    function, args, kwargs = Prepare(tracer)(closure, 0)
    assert closure.generation == 1 and int(function(*args, **kwargs)) == 3
