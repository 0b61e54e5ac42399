"""What a TCP connect to a task's port found: the one vocabulary of reachability.

A str enum: its members compare equal to their values, so a report made with
the plain string (a test's, a simulated edge's) means the same.
"""

from __future__ import annotations

import enum

__all__ = ["TcpState"]


class TcpState(str, enum.Enum):
    #: Something accepts connections: the process is there (it may still hang).
    OPEN = "open"
    #: A definite no (refused, unreachable): the process is gone.
    CLOSED = "closed"
    #: No answer at all, as from a host cut off by the network or a stopped one: it may answer again.
    SILENT = "silent"
