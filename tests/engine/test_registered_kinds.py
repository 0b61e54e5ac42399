"""The kinds of local op psclient runs first, streamed, so that a hung worker holds no later read.

Only local ops may be made so (a streamed op to a task that dies waits for good): under a
device scope naming a task (Keras colocating a slot with its variable) nothing is made, and
the kind stays to be made by the next variable of that dtype.
"""

import tensorflow as tf

from psclient._tf import executors


def test_the_device_in_force_is_local_unless_a_scope_names_a_task():
    assert executors.local_device_in_force()
    with tf.device("/job:ps/replica:0/task:0/device:CPU:0"):
        assert not executors.local_device_in_force()
    with tf.device(tf.config.list_logical_devices("CPU")[0].name):
        assert executors.local_device_in_force()


def test_read_kinds_are_made_once_and_never_under_a_tasks_device(monkeypatch):
    made = []  # one entry per time the kinds' ops are made (each inside a streamed scope)
    streamed = executors.streamed_registrations

    def counted():
        made.append(1)
        return streamed()

    monkeypatch.setattr(executors, "streamed_registrations", counted)
    dtype = tf.float16  # made by no other test of this process
    executors._read_kinds.discard((dtype, 3))
    with tf.device("/job:ps/replica:0/task:0/device:CPU:0"):
        executors.register_read_kinds(dtype, 3)
    assert (dtype, 3) not in executors._read_kinds and not made
    executors.register_read_kinds(dtype, 3)
    assert (dtype, 3) in executors._read_kinds and len(made) == 1
    executors.register_read_kinds(dtype, 3)  # made once: nothing more
    assert len(made) == 1


def test_eager_ops_run_as_themselves_while_any_thread_asks_and_wrapped_again_after(monkeypatch):
    import threading

    switched = []  # TF's switch, each time it is set
    monkeypatch.setattr(executors, "_set_run_eager_op_as_function", switched.append)
    # As in a process never connected (a connection leaves the switch off for good, below).
    monkeypatch.setattr(executors, "_unwrapped_users", 0)
    monkeypatch.setattr(executors, "_unwrapped_for_good", False)
    inside, leave = threading.Event(), threading.Event()

    def other_thread():
        with executors.eager_ops_as_themselves():
            inside.set()
            leave.wait(30)

    thread = threading.Thread(target=other_thread)
    thread.start()
    try:
        assert inside.wait(30)
        with executors.eager_ops_as_themselves():  # a second user: TF's switch is left alone
            assert switched == [False]
        assert switched == [False], "unwrapped while the other thread is still inside"
    finally:
        leave.set()
        thread.join(30)
    assert switched == [False, True] and executors._unwrapped_users == 0
    # And for real, with TF's switch: an op of a kind new to this process runs inside, and another
    # after it (the switch set back; which way TF runs an op is not visible from here).
    monkeypatch.undo()
    with executors.eager_ops_as_themselves():
        assert int(tf.raw_ops.PopulationCount(x=tf.constant(7, tf.int16))) == 3
    assert int(tf.raw_ops.PopulationCount(x=tf.constant(15, tf.uint16))) == 4


def test_once_connected_eager_ops_run_as_themselves_for_good(monkeypatch):
    """A connection switches TF's wrapping off for the rest of the process (a new kind of op
    after a fit waited 36 s for a hung worker): a later user leaving does not switch it back."""
    switched = []
    monkeypatch.setattr(executors, "_set_run_eager_op_as_function", switched.append)
    monkeypatch.setattr(executors, "_unwrapped_users", 0)
    monkeypatch.setattr(executors, "_unwrapped_for_good", False)
    with executors.eager_ops_as_themselves():
        executors.eager_ops_as_themselves_from_now()
        executors.eager_ops_as_themselves_from_now()  # a second connection: nothing more
    assert switched == [False] and executors._unwrapped_users == 1
    with executors.eager_ops_as_themselves():
        pass
    assert switched == [False], "switched back on after a connection"
