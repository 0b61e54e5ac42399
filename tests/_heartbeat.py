"""A heartbeat thread in the coordinator: its longest gap is the coordinator's longest stall.

TF calls that block inside C++ with the GIL held stop every Python thread of
the process, the heartbeat's too. The heartbeat is the benchmarks' own
(`benchmarks/_common.py`, as benchmarks/first_trace_stall.py measures with
it): one implementation, so a test and a benchmark measure a stall alike.
"""

import sys

from _paths import ROOT_STR

# benchmarks/ on the path, as tests/engine/test_scale_sim.py puts it for `_sim`.
_BENCHMARKS = f"{ROOT_STR}/benchmarks"
if _BENCHMARKS not in sys.path:
    sys.path.insert(0, _BENCHMARKS)

from _common import Heartbeat  # noqa: E402

__all__ = ["MAX_STALL_S", "Heartbeat"]

#: The longest the coordinator's threads may stall (issue: never more than 1 s).
MAX_STALL_S = 1.0
