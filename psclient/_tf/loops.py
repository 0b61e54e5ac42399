"""Where a read of a variable can leave TF's while loops: the graphs of `tf.while_loop` (v2).

TF's while loop (`while_v2`) traces its body and its condition into graphs of their own
(`WhileBodyFuncGraph`, `WhileCondFuncGraph`, TF internals), nested in the graph that makes
the loop; a tensor of an enclosing graph used inside is captured and passed to each
iteration unchanged, and the loop's gradient reaches it as any other input.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf
from tensorflow.python.ops import control_flow_v2_func_graphs as _cf_graphs

__all__ = ["graph_outside_loops", "read_in"]

_LOOP_GRAPHS = (_cf_graphs.WhileBodyFuncGraph, _cf_graphs.WhileCondFuncGraph)


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
