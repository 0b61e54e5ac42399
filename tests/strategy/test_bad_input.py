"""Bad input gets a clear error naming the argument, never a hang."""

import inspect
import time

import portpicker
import pytest
import tensorflow as tf

import psclient

pytestmark = pytest.mark.cluster


def test_unreachable_address_names_task_and_address_within_timeout(local_cluster):
    dead = f"127.0.0.1:{portpicker.pick_unused_port()}"
    jobs = local_cluster.cluster.jobs
    jobs["worker"] = [jobs["worker"][0], dead]
    start = time.monotonic()
    with pytest.raises(psclient.TaskUnreachableError) as info:
        psclient.ParameterServerStrategy(jobs, connect_timeout=2)
    elapsed = time.monotonic() - start
    assert elapsed < 10, elapsed
    assert "worker:1" in str(info.value) and dead in str(info.value)
    assert info.value.task == "worker:1" and info.value.address == dead


def test_default_connect_timeout_is_bounded():
    default = inspect.signature(psclient.StrategyConfig).parameters["connect_timeout"].default
    assert 0 < default <= 30


@pytest.mark.parametrize("depth", [0, -1, 1.5, "2", True])
def test_bad_pipeline_depth(local_cluster, depth):
    with pytest.raises(ValueError, match="pipeline_depth"):
        psclient.ParameterServerStrategy(local_cluster.cluster, pipeline_depth=depth)


def test_bad_cluster_type():
    with pytest.raises(TypeError, match="cluster"):
        psclient.ParameterServerStrategy(["127.0.0.1:1"])


def test_second_strategy_in_one_process_is_refused(strategy, local_cluster):
    with pytest.raises(RuntimeError, match="shutdown"):
        psclient.ParameterServerStrategy(local_cluster.cluster)


def test_dataset_fn_with_wrong_signature(strategy):
    with pytest.raises(TypeError, match="dataset_fn"):
        strategy.distribute_datasets_from_function(lambda: tf.data.Dataset.range(3))
    with pytest.raises(TypeError, match="dataset_fn"):
        strategy.distribute_datasets_from_function(lambda a, b: tf.data.Dataset.range(3))
    with pytest.raises(TypeError, match="dataset_fn"):
        strategy.distribute_datasets_from_function("not a function")


def test_dataset_fn_returning_something_else(strategy):
    with pytest.raises(TypeError, match="tf.data.Dataset"):
        strategy.distribute_datasets_from_function(lambda ctx: [1, 2, 3])


def test_per_worker_iterator_cannot_be_advanced_on_the_coordinator(strategy):
    it = iter(strategy.distribute_datasets_from_function(lambda ctx: tf.data.Dataset.range(3)))
    with pytest.raises(TypeError, match="schedule"):
        next(it)


@pytest.mark.parametrize(
    "kwargs, argument",
    [
        ({"hang_timeout": 0}, "hang_timeout"),
        ({"worker_timeout": -1}, "worker_timeout"),
        ({"ps_timeout": "60"}, "ps_timeout"),
        ({"checkpoint_dir": "/tmp/x", "checkpoint_every": 1.5}, "checkpoint_every"),
        ({"checkpoint_dir": "/tmp/x", "checkpoints_to_keep": 0}, "checkpoints_to_keep"),
        ({"checkpoint_dir": "/tmp/x", "checkpoint_interval": 0}, "checkpoint_interval"),
        ({"checkpoint_interval": 10}, "checkpoint_dir"),
    ],
)
def test_bad_fault_tolerance_settings_name_the_argument_before_connecting(kwargs, argument):
    # Nothing listens at these addresses: the error must come before any connect.
    cluster = {"worker": ["127.0.0.1:1"], "ps": ["127.0.0.1:2"]}
    with pytest.raises(ValueError, match=f"`{argument}`. Received: {argument}="):
        psclient.ParameterServerStrategy(cluster, **kwargs)


def test_checkpoint_dir_of_the_wrong_type():
    with pytest.raises(TypeError, match="checkpoint_dir"):
        psclient.ParameterServerStrategy({"worker": ["127.0.0.1:1"], "ps": ["127.0.0.1:2"]}, checkpoint_dir=5)


def test_restore_and_save_checkpoint_need_a_checkpoint_dir(strategy):
    with pytest.raises(ValueError, match="checkpoint_dir=None"):
        strategy.restore()
    with pytest.raises(ValueError, match="checkpoint_dir=None"):
        strategy.save_checkpoint()


def test_restore_into_other_variables_names_them(local_cluster, strategy, tmp_path):
    from psclient._coordinator.checkpoints.checkpoint import Checkpoints

    with strategy.scope():
        a = tf.Variable(tf.zeros([3]))
    Checkpoints(str(tmp_path), keep=1).save({"v000000": a}, completed=0)
    with strategy.scope():
        b = tf.Variable(tf.zeros([4]))
    with pytest.raises(ValueError, match=r"shape \[3\] there but \[4\] here"):
        Checkpoints(str(tmp_path), keep=1).restore({"v000000": b}, adopt=True)
    with pytest.raises(ValueError, match="v000001 .* is not in it"):
        Checkpoints(str(tmp_path), keep=1).restore({"v000000": a, "v000001": b}, adopt=True)


# Last: it shuts the module's shared strategy down.
def test_schedule_after_shutdown_is_a_clear_error(local_cluster, strategy):
    strategy.shutdown()
    strategy.shutdown()  # idempotent
    assert not [t for t in __import__("threading").enumerate() if t.name.startswith("psclient-worker")]
    with pytest.raises(psclient.StrategyClosedError, match="shut down"):
        strategy.schedule(lambda: tf.constant(1))
    with pytest.raises(psclient.StrategyClosedError):
        with strategy.scope():
            pass
    # A new strategy can connect once the old one is shut down.
    again = psclient.ParameterServerStrategy(local_cluster.cluster)
    try:
        assert again.schedule(tf.function(lambda: tf.constant(7))).result(60) == 7
    finally:
        again.shutdown()
