"""tf.functions that psclient makes once per object, and TF's warning about retracing."""

from __future__ import annotations

from typing import Any

__all__ = ["made_per_object"]


def made_per_object(function: Any) -> Any:
    """`function` (a `tf.function`), one of many made from the same code: one per table shard, made
    again when a ps recovery renews the shard's storage, each traced once by design.

    TF counts traces per code object, not per function, and from the fifth logs "triggered
    tf.function retracing. Tracing is expensive" at every new shard or recovery (101 to 176 such
    lines in a day's chaos plans), which tells a user of a cost that is not there. Turned off for
    `function` with TF's own attribute (its saved-model loader sets it too); where a TF version
    lacks it, nothing changes.
    """
    if hasattr(function, "_omit_frequent_tracing_warning"):
        function._omit_frequent_tracing_warning = True  # noqa: SLF001 - see the docstring
    return function
