"""Failure classification by error type and probe, without a cluster."""

import tensorflow as tf

from psclient._core.failures import AfterFailure, Verdict, after_failure, classify


def test_connection_error_type_with_dead_worker_is_worker_lost():
    err = tf.errors.UnavailableError(None, None, "Socket closed")
    assert classify(err, lambda: False) is Verdict.WORKER_LOST


def test_connection_error_type_with_live_worker_is_the_functions_error():
    err = tf.errors.UnavailableError(None, None, "Socket closed")
    assert classify(err, lambda: True) is Verdict.FUNCTION_ERROR


def test_other_errors_probe_only_the_ps_tasks():
    probed = []

    def probe():
        probed.append(1)
        return False

    for err in (tf.errors.InvalidArgumentError(None, None, "bad"), ValueError("x")):
        assert classify(err, probe, probe, ps_lost=lambda: probed.append("ps") and False) \
            is Verdict.FUNCTION_ERROR
    assert probed == ["ps", "ps"]


def test_other_error_while_a_ps_no_longer_holds_its_variables_is_ps_lost():
    # A ps restarted unnoticed: reads of its variables fail with InvalidArgumentError.
    err = tf.errors.InvalidArgumentError(None, None, "Resource input tensor contains an invalid device")
    assert classify(err, lambda: True, ps_lost=lambda: True) is Verdict.PS_LOST


def test_message_text_does_not_matter():
    # An InvalidArgument whose text looks like a network error is still the function's.
    err = tf.errors.InvalidArgumentError(None, None, "Socket closed; connection reset")
    assert classify(err, lambda: False) is Verdict.FUNCTION_ERROR


def test_a_stale_remote_handle_takes_the_worker_out_a_bounded_number_of_times():
    # A worker restarted unnoticed while a ps was lost: after the ps's recovery, its calls name
    # tensors of its old context. Taken out, it rejoins with its resources made again.
    from psclient._core.failures import MAX_TRANSIENT_ATTEMPTS, stale_remote_handle

    stale = tf.errors.InvalidArgumentError(
        None, None, "Unable to find the relevant tensor remote_handle: Op ID: 26, Output num: 0.")
    assert stale_remote_handle(stale)
    assert not stale_remote_handle(tf.errors.UnavailableError(None, None, str(stale)))
    assert not stale_remote_handle(tf.errors.InvalidArgumentError(None, None, "bad shape"))
    assert classify(stale, lambda: True, attempts=1) is Verdict.WORKER_LOST
    assert classify(stale, lambda: True, ps_lost=lambda: True, attempts=1) is Verdict.PS_LOST  # the ps first
    assert classify(stale, lambda: True, attempts=MAX_TRANSIENT_ATTEMPTS) is Verdict.FUNCTION_ERROR


def test_a_worker_that_does_not_know_its_own_device_is_taken_out_a_bounded_number_of_times():
    # A worker restarted while the ps tasks hung (no reconnect could introduce it): its calls fail
    # with TF's "<its own device> unknown device" (seen in a seeded chaos plan, where the closure
    # then failed as the function's own error once the ps were back). Taken out, it rejoins with
    # its context made again; a closure that keeps failing so is the function's own error after a few.
    from psclient._core.failures import MAX_TRANSIENT_ATTEMPTS, unknown_own_device

    own = "/job:worker/replica:0/task:0"
    error = tf.errors.InvalidArgumentError(
        None, None, "/job:worker/replica:0/task:0/device:CPU:0 unknown device. [Op:__inference_step_17459]")
    assert unknown_own_device(error, own)
    assert not unknown_own_device(error, "/job:worker/replica:0/task:1")  # another task's device: the function's
    assert not unknown_own_device(error, "/job:worker/replica:0/task:01")
    assert not unknown_own_device(error, None)
    assert not unknown_own_device(tf.errors.UnavailableError(None, None, str(error)), own)
    assert not unknown_own_device(tf.errors.InvalidArgumentError(None, None, "/job:ps/replica:0/task:3/device:CPU:0 "
                                                                 "unknown device."), own)
    assert classify(error, lambda: True, attempts=1, worker_device=own) is Verdict.WORKER_LOST
    assert classify(error, lambda: True, attempts=1) is Verdict.FUNCTION_ERROR  # no worker named: not its own
    assert classify(error, lambda: True, ps_lost=lambda: True, attempts=1, worker_device=own) is Verdict.PS_LOST
    assert classify(error, lambda: True, attempts=MAX_TRANSIENT_ATTEMPTS, worker_device=own) is Verdict.FUNCTION_ERROR


def test_live_worker_but_another_task_lost_is_retried():
    err = tf.errors.UnavailableError(None, None, "Connection reset by peer")
    assert classify(err, lambda: True, lambda: True) is Verdict.OTHER_TASK_LOST
    assert classify(err, lambda: True, lambda: False) is Verdict.FUNCTION_ERROR


def test_other_tasks_probed_only_when_own_worker_answers():
    probed = []
    err = tf.errors.UnavailableError(None, None, "x")
    classify(err, lambda: False, lambda: probed.append(1) or True)
    assert probed == []


def test_lost_ps_is_reported_before_any_worker_is_probed():
    probed = []
    verdict = classify(
        tf.errors.UnavailableError(None, None, "Socket closed"),
        lambda: probed.append("own worker") or False,
        others_lost=lambda: probed.append("workers") or True,
        ps_lost=lambda: probed.append("ps") or True,
    )
    assert verdict is Verdict.PS_LOST
    assert probed == ["ps"]


def test_unexplained_connection_error_is_retried_a_few_times_then_is_the_functions():
    from psclient._core.failures import MAX_TRANSIENT_ATTEMPTS

    err = tf.errors.UnavailableError(None, None, "Connection refused")
    for attempts in range(1, MAX_TRANSIENT_ATTEMPTS):
        assert classify(err, lambda: True, attempts=attempts) is Verdict.TRANSIENT
    assert classify(err, lambda: True, attempts=MAX_TRANSIENT_ATTEMPTS) is Verdict.FUNCTION_ERROR
    not_connection = tf.errors.InvalidArgumentError(None, None, "bad shape")
    assert classify(not_connection, lambda: True, attempts=1) is Verdict.FUNCTION_ERROR


def test_cancelled_iterator_is_recognised_by_type_and_op_name():
    from psclient._core.failures import iterator_cancelled

    cancelled = tf.errors.CancelledError(None, None, "Operation was cancelled\n\t [[{{node IteratorGetNext}}]]")
    assert iterator_cancelled(cancelled)
    assert not iterator_cancelled(tf.errors.CancelledError(None, None, "Operation was cancelled"))
    assert not iterator_cancelled(tf.errors.UnavailableError(None, None, "[[{{node IteratorGetNext}}]]"))
    assert not iterator_cancelled(ValueError("IteratorGetNext"))


def test_renewing_cancelled_iterators_happens_once_per_breakage():
    # Several calls that failed on the same cancelled iterators renew them once;
    # the dataset (fine on a worker that did not fail) is kept.
    from psclient._coordinator.data.per_worker import PerWorkerDataset
    from psclient._coordinator.stores import PerWorkerRegistry

    registry = PerWorkerRegistry()
    made, datasets = [], []

    def build(worker):
        datasets.append(worker)
        return f"dataset{worker}"

    def make_iterator(worker, dataset):
        made.append((worker, dataset))
        return f"iterator{len(made)}"

    dataset = PerWorkerDataset(build, 2, "d", make_iterator=make_iterator, on_new=registry.track)
    iterator = iter(dataset)
    assert made == [(0, "dataset0"), (1, "dataset1")]
    seen = registry.generation(0)
    assert registry.renew_iterators(0, seen) == 1
    assert registry.renew_iterators(0, seen) == 0  # a second caller that saw the same breakage
    assert made[-1] == (0, "dataset0") and len(made) == 3
    assert iterator.value(0) == "iterator3" and iterator.value(1) == "iterator2"
    assert datasets == [0, 1]
    assert registry.renew_iterators(0, registry.generation(0)) == 1  # a later breakage
    assert registry.generation(1) == 0


def test_another_lost_task_explains_a_closures_failures_a_bounded_number_of_times():
    from psclient._core.failures import MAX_OTHER_LOST_ATTEMPTS, MAX_TRANSIENT_ATTEMPTS

    # A py_function's own exception arrives as UnknownError, a connection-type code.
    err = tf.errors.UnknownError(None, None, "RuntimeError: user bug")
    for n in range(1, MAX_OTHER_LOST_ATTEMPTS + 1):
        assert classify(err, lambda: True, lambda: True, other_lost_attempts=n) is Verdict.OTHER_TASK_LOST
    # Then the usual few unexplained attempts, then it is the function's error.
    past = MAX_OTHER_LOST_ATTEMPTS + 1
    assert classify(err, lambda: True, lambda: True, attempts=1, other_lost_attempts=past) is Verdict.TRANSIENT
    assert classify(err, lambda: True, lambda: True, attempts=MAX_TRANSIENT_ATTEMPTS,
                    other_lost_attempts=past) is Verdict.FUNCTION_ERROR


def test_retry_pauses_grow_and_are_bounded():
    from psclient._core.failures import retry_pause

    assert retry_pause(Verdict.OTHER_TASK_LOST, 1) == 0.0  # the first rerun at once
    pauses = [retry_pause(Verdict.OTHER_TASK_LOST, n) for n in range(2, 12)]
    assert pauses == sorted(pauses) and pauses[0] > 0 and max(pauses) == 2.0
    assert [retry_pause(Verdict.TRANSIENT, n) for n in (1, 2, 3, 9)] == [0.5, 1.0, 2.0, 2.0]
    assert retry_pause(Verdict.WORKER_LOST, 5) == retry_pause(Verdict.PS_LOST, 5) == 0.0


# ------------------------------------------------------------- after_failure


def _after(verdict, unexplained=0, other_lost=0, broken=False):
    return after_failure(verdict, unexplained_failures=unexplained, other_lost_failures=other_lost,
                         broken_iterator=broken)


def test_a_function_error_goes_to_the_future_unless_an_endless_iterator_broke():
    assert _after(Verdict.FUNCTION_ERROR) == AfterFailure(retry=False)
    assert _after(Verdict.FUNCTION_ERROR, broken=True) == AfterFailure(True, unexplained=1, renew_iterators=True)


def test_transient_failures_back_off_more_each_time_up_to_two_seconds():
    pauses = [_after(Verdict.TRANSIENT, unexplained=n).pause for n in range(5)]
    assert pauses == [0.5, 1.0, 2.0, 2.0, 2.0]
    assert all(_after(Verdict.TRANSIENT, unexplained=n).unexplained == 1 for n in range(5))


def test_a_cancelled_iterator_is_made_again_and_retried_at_once():
    assert _after(Verdict.TRANSIENT, unexplained=2, broken=True) == AfterFailure(
        True, unexplained=1, renew_iterators=True)


def test_another_task_lost_retries_at_once_first_then_backs_off():
    assert [_after(Verdict.OTHER_TASK_LOST, other_lost=n).pause for n in range(4)] == [0.0, 0.1, 0.2, 0.4]
    assert _after(Verdict.OTHER_TASK_LOST).other_lost == 1 and _after(Verdict.OTHER_TASK_LOST).unexplained == 0


def test_a_lost_ps_requeues_without_pause_or_count():
    assert _after(Verdict.PS_LOST, unexplained=3, other_lost=3) == AfterFailure(True)
