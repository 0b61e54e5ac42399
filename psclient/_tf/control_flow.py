"""TF's control flow v2 in a traced step: reads moved out of while loops, conditionals kept unlowered.

Loops (`graph_outside_loops`, `read_in`, for `psclient._keras.loop_reads`). TF's while loop
(`while_v2`) traces its body and its condition into graphs of their own (`WhileBodyFuncGraph`,
`WhileCondFuncGraph`, TF internals), nested in the graph that makes the loop; a tensor of an
enclosing graph used inside is captured and passed to each iteration unchanged, and the loop's
gradient reaches it as any other input.

Conditionals (`called_cond`, for the dynamic tables' ps sections), run as function calls (TF's
functional `If`). Inside a `tf.function`, TF lowers each `tf.cond` (an `If` op) to Switch and Merge
nodes before running it: both branches' nodes stay in the partition graph, and every step the
executor walks the branch not taken too, passing it a dead tensor node by node. A dynamic table's
section on a ps holds many conditionals whose big branch runs seldom (an index rebuilt once its
tombstones fill half its buckets, an eviction once a shard runs short of free rows, a scan every
`ceil(ttl_steps/8)` steps): lowered, each step paid for their nodes anyway. Kept as an `If` op (its
`_lower_using_switch_merge` attribute false, a TF internal that `cond_v2` itself sets), the ps runs
the branch taken as a function call and never touches the other. Measured on this machine
(docs/dynamic_embeddings.md, "The section's conditionals as function calls"): 26 `DynamicEmbedding`
layers, three interleaved pairs, 0.85x -> 0.90x the hashing trick's steps/s (medians), the ps and
the workers each about 3 ms a step cheaper; earlier measurements at one layer saw no change.
"""

from __future__ import annotations

from typing import Any, Callable

import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2
from tensorflow.python.ops import control_flow_v2_func_graphs as _cf_graphs

__all__ = ["called_cond", "graph_outside_loops", "read_in"]

_LOOP_GRAPHS = (_cf_graphs.WhileBodyFuncGraph, _cf_graphs.WhileCondFuncGraph)
_IF_OPS = ("If", "StatelessIf")
_NOT_LOWERED = attr_value_pb2.AttrValue(b=False)


def graph_outside_loops(graph: Any, boundary: Any) -> Any | None:
    """The graph that encloses the outermost while loop between `graph` (being built) and
    `boundary` (one of its enclosing graphs, or itself); None when no loop lies between them or
    `graph` is not inside `boundary`."""
    outside = None
    while graph is not boundary:
        if graph is None:
            return None
        if isinstance(graph, _LOOP_GRAPHS):
            outside = graph.outer_graph
        graph = getattr(graph, "outer_graph", None)
    return outside


def read_in(graph: Any, variable: tf.Variable) -> tf.Tensor:
    """A read of `variable` made in `graph` (an enclosing graph of the one being built), as if
    the code had read it there; with a gradient tape recording, the tape records the read."""
    with graph.as_default():
        return variable.value()


def called_cond(pred: Any, true_fn: Callable[[], Any], false_fn: Callable[[], Any]) -> Any:
    """`tf.cond(pred, true_fn, false_fn)`, its `If` op kept for a function call (module doc);
    eagerly, `tf.cond` itself."""
    if tf.executing_eagerly():
        return tf.cond(pred, true_fn, false_fn)
    graph = tf.compat.v1.get_default_graph()
    first = len(graph.get_operations())
    out = tf.cond(pred, true_fn, false_fn)
    for op in graph.get_operations()[first:]:
        if op.type in _IF_OPS:
            op._set_attr("_lower_using_switch_merge", _NOT_LOWERED)  # noqa: SLF001 - TF's own attribute
    return out
