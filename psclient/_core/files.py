"""Writing a file so that readers see all of it or none, under a name nobody can predict.

`replaced_atomically(final)` hands out a path in a fresh private directory
(`tempfile.mkdtemp`, mode 0700) beside `final`; whatever the caller writes
there is renamed onto `final` (`os.replace`, atomic on POSIX) when the block
ends without an error. Nobody can plant a link at the temporary name (it is
unpredictable, in a directory only this user can enter), and the file gets the
mode any new file here gets (0666 less the umask, the directory's default ACL),
like the checkpoints beside it: not mkstemp's 0600.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator

__all__ = ["replaced_atomically"]


@contextlib.contextmanager
def replaced_atomically(final: str | os.PathLike) -> Iterator[str]:
    """Yield a temporary path to write; on success it replaces `final` atomically."""
    final = os.fspath(final)
    directory = os.path.dirname(os.path.abspath(final))
    scratch = tempfile.mkdtemp(prefix=".psclient-tmp-", dir=directory)
    temp = os.path.join(scratch, os.path.basename(final))  # same name: writers that check suffixes agree
    try:
        yield temp
        with open(temp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(temp, final)
    finally:
        shutil.rmtree(scratch)  # empty after the rename; the partial file after a failure
