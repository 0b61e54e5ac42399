"""A dataset moved between devices: its graph serialized, rebuilt where it is needed."""

from __future__ import annotations

import tensorflow as tf

__all__ = ["deserialize_dataset", "serialize_dataset"]


def serialize_dataset(dataset):
    """The dataset's graph as a string tensor, to rebuild it on any worker (`deserialize_dataset`).

    TF-internal: a dataset's graph is the only way to move it.
    """
    return dataset._as_serialized_graph(  # noqa: SLF001
        strip_device_assignment=True,
        external_state_policy=tf.data.experimental.ExternalStatePolicy.WARN,
    )


def deserialize_dataset(graph_def, element_spec):
    """The dataset whose graph `serialize_dataset` gave, built where this runs."""
    variant = tf.raw_ops.DatasetFromGraph(graph_def=graph_def)
    return tf.data.experimental.from_variant(variant, element_spec)
