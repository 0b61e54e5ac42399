"""The rest of `tf.distribute.Strategy`'s public surface, for code written for TF's stack.

`ParameterServerStrategy` answers what parameter-server code calls on TF's
strategy (`scope`, `schedule` and the dataset methods are the strategy's
own). This base class gives the rest of TF's surface: the step helpers `run`
and `reduce`, and the others with TF's parameter-server semantics where they
have a meaning on psclient, and a `StrategyAPIUnsupportedError` naming
psclient's way otherwise. It calls only public methods of the strategy
(`cluster`, `distribute_datasets_from_function`).

As in TF's `ParameterServerStrategy` without GPUs, each scheduled call is one
replica: `experimental_local_results` of a value is `(value,)`, `gather` of a
value is the value, `experimental_distribute_values_from_function` calls its
function once, for replica 0 of 1. A `tf.distribute.DistributedValues` (made
by another strategy) is unpacked into its values as TF does.
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from typing import Any, Callable

import tensorflow as tf

from psclient._coordinator import runtime as _runtime
from psclient._coordinator.tracing import warn_unless_scheduling
from psclient._core.errors import StrategyAPIUnsupportedError

__all__ = ["TFStrategyAPI", "UNSUPPORTED", "refuse_input_options"]

#: TF strategy methods psclient refuses, each with what to use instead.
UNSUPPORTED = types.MappingProxyType({
    "extended": "strategy.placement() for where variables live, strategy.cluster for the tasks, "
    "strategy.schedule() to run on a worker (variable updates already run on their ps)",
    "colocate_vars_with": "tf.device('/job:ps/task:K') inside strategy.scope() (an optimizer's "
    "slots go to the ps of their variable by themselves)",
    "experimental_run": "strategy.schedule(fn, args=(iterator,)) with strategy.run inside fn",
    "make_dataset_iterator": "iter(strategy.distribute_datasets_from_function(dataset_fn))",
    "make_input_fn_iterator": "iter(strategy.distribute_datasets_from_function(dataset_fn))",
    "unwrap": "strategy.experimental_local_results(value)",
    "group": "tf.group(*strategy.experimental_local_results(value))",
    "configure": "the task servers' own configuration (psclient serve, LocalCluster)",
    "update_config_proto": "the task servers' own configuration (psclient serve, LocalCluster)",
})


def refuse_input_options(options: Any) -> None:
    """TF's `options=` (a `tf.distribute.InputOptions`) of the dataset methods: only None."""
    if options is not None:
        raise ValueError(
            f"Invalid value for argument `options`. Received: options={options!r}. Expected None: "
            "psclient builds each worker's dataset on that worker, without input options."
        )


def _values_of(value: Any) -> tuple | None:
    """The per-replica values of a `tf.distribute.DistributedValues`, else None."""
    return tuple(value.values) if isinstance(value, tf.distribute.DistributedValues) else None


class TFStrategyAPI:
    """`tf.distribute.Strategy` methods of `ParameterServerStrategy` (which sets `cluster`)."""

    # ------------------------------------- tf.distribute-style step helpers
    #: Replicas that see each step: one per worker call (TF's PS strategy on CPU says the same).
    num_replicas_in_sync = 1

    def run(self, fn: Callable, args: tuple = (), kwargs: Mapping | None = None):
        """Call `fn` as the one replica of a step: `fn(*args, **kwargs)`.

        Present so code written for TF's strategies runs. Inside `fn`,
        `tf.distribute.in_cross_replica_context()` is False and
        `tf.distribute.get_replica_context()` is the (only) replica's context.
        As TF's does, it logs a warning when called outside a function being
        scheduled: that runs on the coordinator, not on a worker.
        """
        warn_unless_scheduling("run")
        with _runtime.replica_context():  # TF's public replica context of its default strategy: 0 of 1
            return fn(*args, **(kwargs or {}))

    def reduce(self, reduce_op, value, axis=None):
        """Reduce a per-replica value; with one replica per call only `axis` matters.

        `reduce_op` is a `tf.distribute.ReduceOp` or its name ("SUM", "MEAN").
        """
        warn_unless_scheduling("reduce")
        op = str(getattr(reduce_op, "value", reduce_op)).upper()
        if op not in ("SUM", "MEAN"):
            raise ValueError(
                f"Invalid value for argument `reduce_op`. Received: reduce_op={reduce_op!r}. "
                "Expected tf.distribute.ReduceOp.SUM or MEAN (or \"SUM\" / \"MEAN\")."
            )
        if axis is None:
            return value
        reduce = tf.reduce_sum if op == "SUM" else tf.reduce_mean
        return tf.nest.map_structure(lambda v: reduce(v, axis=axis), value)

    def experimental_local_results(self, value: Any) -> tuple:
        """The values of `value`, one per replica, as a tuple: `(value,)` (one replica per call).

        As TF's: works on whatever `strategy.run`, a scheduled function or
        `schedule` returned (a `psclient.Future` comes back as `(future,)`,
        as TF's `RemoteValue` does), inside a function or not.
        """
        values = _values_of(value)
        return values if values is not None else (value,)

    def gather(self, value: Any, axis: int) -> Any:
        """`value` concatenated across replicas along `axis`: with one replica per call, `value`."""
        def gather_one(item):
            values = _values_of(item)
            if values is None:
                return item
            return tf.concat(values, axis=axis)

        if isinstance(value, tf.IndexedSlices):
            raise NotImplementedError("gather does not support IndexedSlices")  # TF's own message
        return tf.nest.map_structure(gather_one, value)

    def experimental_distribute_values_from_function(self, value_fn: Callable) -> Any:
        """`value_fn(tf.distribute.experimental.ValueContext(0, 1))`: the one replica's value."""
        if not callable(value_fn):
            raise TypeError(
                "Invalid value for argument `value_fn`. Received: "
                f"value_fn={value_fn!r}. Expected a function of a tf.distribute.experimental.ValueContext."
            )
        context = tf.distribute.experimental.ValueContext(replica_id_in_sync_group=0, num_replicas_in_sync=1)
        return value_fn(context)

    def experimental_distribute_datasets_from_function(self, dataset_fn, options=None):
        """TF's deprecated name of `distribute_datasets_from_function` (`options` must be None)."""
        return self.distribute_datasets_from_function(dataset_fn, options)

    @property
    def cluster_resolver(self):
        """A `tf.distribute.cluster_resolver.SimpleClusterResolver` of the training cluster,
        seen from the coordinator (task "chief", 0), as TF's strategy keeps its resolver."""
        return tf.distribute.cluster_resolver.SimpleClusterResolver(
            self.cluster.to_cluster_spec(), task_type="chief", task_id=0, rpc_layer="grpc"
        )

    def __getattr__(self, name: str) -> Any:
        # Only names the class does not define arrive here.
        if name in UNSUPPORTED:
            raise StrategyAPIUnsupportedError(
                f"psclient.ParameterServerStrategy has no `{name}` (tf.distribute.Strategy.{name}). "
                f"Use {UNSUPPORTED[name]}."
            )
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
