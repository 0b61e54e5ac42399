"""Which of this process's threads a strategy owns, for tests that count them.

A fork server's reader (`forkserver.READER_THREAD_NAME`) is LocalCluster's, not
a strategy's: it serves every cluster of the process and ends once its server
has been idle for `fork_serving.IDLE_EXIT_S`, so it may come or go mid-test.
"""

from __future__ import annotations

import threading

from psclient._cluster.forkserver import READER_THREAD_NAME

__all__ = ["cluster_owned", "psclient_threads"]


def cluster_owned(thread: threading.Thread) -> bool:
    """Whether `thread` is a LocalCluster's (a fork server's reader), not a strategy's."""
    return thread.name == READER_THREAD_NAME


def psclient_threads(threads=None) -> list[threading.Thread]:
    """The live psclient threads of `threads` (default: all of this process's) but the clusters' own."""
    threads = threading.enumerate() if threads is None else threads
    return [t for t in threads if t.name.startswith("psclient-") and t.is_alive() and not cluster_owned(t)]
