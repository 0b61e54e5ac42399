"""tf.distribute.Strategy's public surface on psclient's strategy, as TF's parameter-server code calls it.

Each offered method is checked on the shared cluster's strategy, inside a
scheduled function where TF's code calls it there; each refused one raises
`psclient.StrategyAPIUnsupportedError` naming psclient's way.
"""

import numpy as np
import pytest
import tensorflow as tf

import psclient
from psclient._coordinator.tf_api import UNSUPPORTED

pytestmark = pytest.mark.cluster


def test_local_results_of_run_in_a_scheduled_function(strategy):
    # The pattern of TF's own coordinator tests.
    coordinator = psclient.ClusterCoordinator(strategy)

    @tf.function
    def worker_fn(x):
        def replica_fn(value):
            return {"double": value * 2.0, "same": value}

        return strategy.experimental_local_results(strategy.run(replica_fn, args=(x,)))

    result = coordinator.schedule(worker_fn, args=(tf.constant(3.0),))
    fetched = coordinator.fetch(result)
    assert isinstance(fetched, tuple) and len(fetched) == strategy.num_replicas_in_sync == 1
    assert float(fetched[0]["double"]) == 6.0 and float(fetched[0]["same"]) == 3.0
    # On the coordinator, of the future itself: TF gives (remote_value,).
    assert strategy.experimental_local_results(result) == (result,)
    structure = [tf.constant(1.0), tf.constant(2.0)]
    assert strategy.experimental_local_results(structure) == (structure,)


def test_local_results_and_gather_unpack_distributed_values(strategy):
    from tensorflow.python.distribute.values import PerReplica  # what another strategy's run returns

    per_replica = PerReplica((tf.constant([1.0]), tf.constant([2.0])))
    assert [float(v[0]) for v in strategy.experimental_local_results(per_replica)] == [1.0, 2.0]
    np.testing.assert_array_equal(strategy.gather(per_replica, axis=0).numpy(), [1.0, 2.0])


def test_gather_and_values_from_function_in_a_scheduled_function(strategy):
    contexts = []

    def value_fn(context):
        contexts.append((context.replica_id_in_sync_group, context.num_replicas_in_sync))
        return tf.constant([[1.0, 2.0]])

    values = strategy.experimental_distribute_values_from_function(value_fn)
    assert contexts == [(0, 1)]

    @tf.function
    def worker_fn(v):
        per_replica = strategy.run(lambda x: x + 1.0, args=(v,))
        return strategy.gather(per_replica, axis=0), strategy.reduce("SUM", per_replica, axis=None)

    gathered, reduced = strategy.schedule(worker_fn, args=(values,)).result()
    np.testing.assert_array_equal(gathered, [[2.0, 3.0]])
    np.testing.assert_array_equal(reduced, [[2.0, 3.0]])
    with pytest.raises(NotImplementedError, match="IndexedSlices"):
        strategy.gather(tf.IndexedSlices(tf.constant([1.0]), tf.constant([0])), axis=0)
    with pytest.raises(TypeError, match=r"Invalid value for argument `value_fn`\. Received: value_fn=3\."):
        strategy.experimental_distribute_values_from_function(3)


def test_deprecated_datasets_from_function_name_builds_each_workers_dataset(strategy):
    def dataset_fn(context):
        return tf.data.Dataset.from_tensors(tf.cast(context.input_pipeline_id, tf.int64)).repeat()

    iterator = iter(strategy.experimental_distribute_datasets_from_function(dataset_fn))

    @tf.function
    def worker_fn(iterator):
        return next(iterator)

    # Enough calls that both workers take some; each reads its own pipeline's id.
    seen = {int(f.result()) for f in [strategy.schedule(worker_fn, args=(iterator,)) for _ in range(40)]}
    assert seen <= set(range(strategy.num_workers)) and seen
    for method in (strategy.experimental_distribute_datasets_from_function, strategy.distribute_datasets_from_function):
        with pytest.raises(ValueError, match=r"Invalid value for argument `options`\. Received: options='x'"):
            method(dataset_fn, options="x")


def test_cluster_resolver_describes_the_training_cluster(strategy):
    resolver = strategy.cluster_resolver
    assert isinstance(resolver, tf.distribute.cluster_resolver.ClusterResolver)
    assert resolver.cluster_spec().as_dict() == strategy.cluster.to_cluster_spec().as_dict()
    assert (resolver.task_type, resolver.task_id, resolver.rpc_layer) == ("chief", 0, "grpc")
    assert psclient.Cluster.from_resolver(resolver) == psclient.Cluster(strategy.cluster.training_spec())


@pytest.mark.parametrize("name", sorted(UNSUPPORTED))
def test_unsupported_methods_name_psclients_way(strategy, name):
    with pytest.raises(psclient.StrategyAPIUnsupportedError) as raised:
        getattr(strategy, name)
    message = str(raised.value)
    assert f"has no `{name}` (tf.distribute.Strategy.{name}). Use " in message
    assert UNSUPPORTED[name] in message
    assert isinstance(raised.value, (NotImplementedError, psclient.PSClientError))
    assert not hasattr(strategy, name)  # feature detection sees it absent
    assert set(UNSUPPORTED) <= set(dir(tf.distribute.Strategy))  # real TF names, none invented
    with pytest.raises(AttributeError, match="no attribute 'not_a_method'"):
        strategy.not_a_method
