"""TF Serving's layout of a base directory, written safely: `<base_dir>/<version>/`.

TF Serving (and anything that follows its convention) watches `base_dir` and
serves the largest integer-named subdirectory it finds, so:

- a version is written under a hidden temporary name nobody can predict
  (`tempfile.mkdtemp`, mode 0700, beginning with a dot: TF Serving ignores
  names that are not integers) and renamed to its number only when complete,
  after every file in it was flushed to disk; a reader never sees half of one;
- versions are increasing integers (the next one by default); a version that
  exists is never written over;
- `base_dir` belongs to one run: the first export writes `RUN_MARKER` there
  with the run's id, and an export of another run into it is refused (no
  write, no pruning) unless it is told to take the directory over;
- after each version, only the newest `keep` versions are kept.

A run is identified by its `run_id`: by default one id per process
(`PROCESS_RUN_ID`, random), so a training job restarted in a new process must
pass the same explicit `run_id` as before (or `take_over=True`) to go on
writing into its own `base_dir`.

Pure Python (no TensorFlow): the caller writes the SavedModel into the
directory `new_version` hands out.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import threading
import uuid
from collections.abc import Iterator

from psclient._core.errors import PSClientError
from psclient._core.files import replaced_atomically

__all__ = ["PROCESS_RUN_ID", "RUN_MARKER", "ServingDirError", "check_base_dir", "check_keep", "check_run_id", "check_version", "claim",
           "new_version", "next_version", "prune", "sync_dir", "sync_tree", "versions"]

#: The run id of exports that name none: one per process.
PROCESS_RUN_ID = uuid.uuid4().hex
#: The file in `base_dir` that names the run writing it (JSON: {"run_id": ...}).
RUN_MARKER = ".psclient-serving-run.json"
_TEMP_PREFIX = ".psclient-version-"

# One export at a time per process: two threads must not pick the same next version.
_export_lock = threading.Lock()


class ServingDirError(PSClientError, ValueError):
    """`base_dir` cannot take this export: another run writes it, a version exists, or it is no directory."""


def versions(base_dir: str) -> list[int]:
    """The versions in `base_dir` (integer-named directories), oldest first."""
    found = []
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(base_dir):
            if entry.name.isdigit() and entry.is_dir(follow_symlinks=False):
                found.append(int(entry.name))
    return sorted(found)


def check_version(version) -> int | None:
    if version is None:
        return None
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ValueError(f"Invalid value for argument `version`. Received: version={version!r}. "
                         "Expected None (the next version) or an integer >= 0.")
    return version


def check_keep(keep) -> int | None:
    if keep is None:
        return None
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ValueError(f"Invalid value for argument `keep`. Received: keep={keep!r}. "
                         "Expected an integer >= 1 (the newest versions kept), or None to keep all.")
    return keep


def check_run_id(run_id) -> str:
    if run_id is None:
        return PROCESS_RUN_ID
    if not isinstance(run_id, str) or not run_id or len(run_id) > 200:
        raise ValueError(f"Invalid value for argument `run_id`. Received: run_id={run_id!r}. "
                         "Expected None (this process's id) or a non-empty string of at most 200 characters.")
    return run_id


def check_base_dir(base_dir) -> str:
    if not isinstance(base_dir, (str, os.PathLike)) or not os.fspath(base_dir):
        raise TypeError(f"Invalid value for argument `base_dir`. Received: base_dir={base_dir!r}. "
                        "Expected a path (str or os.PathLike) of a directory.")
    base_dir = os.path.abspath(os.fspath(base_dir))
    if os.path.lexists(base_dir) and not os.path.isdir(base_dir):
        raise ServingDirError(f"Invalid value for argument `base_dir`. Received: base_dir={base_dir!r}, which "
                              "is not a directory. Expected a directory (made if missing).")
    return base_dir


def _owner(base_dir: str) -> str | None:
    """The run id in `base_dir`'s marker, or None without one."""
    try:
        with open(os.path.join(base_dir, RUN_MARKER)) as f:
            return str(json.load(f)["run_id"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ServingDirError(f"Invalid value for argument `base_dir`: its run marker "
                              f"{os.path.join(base_dir, RUN_MARKER)!r} cannot be read ({error}). Expected the "
                              "file psclient writes; pass take_over=True to write this run's.") from error


def claim(base_dir: str, run_id: str, take_over: bool = False) -> None:
    """Make `base_dir` this run's (made if missing), or raise `ServingDirError` if another run's.

    A directory without a marker that already holds versions (written by
    something else) is another run's too. `take_over=True` writes this run's
    marker whatever was there.
    """
    os.makedirs(base_dir, exist_ok=True)
    owner = None if take_over else _owner(base_dir)
    if owner == run_id:
        return
    if owner is not None:
        raise ServingDirError(
            f"Invalid value for argument `base_dir`. Received: base_dir={base_dir!r}, which run {owner!r} "
            f"writes (its {RUN_MARKER}); this is run {run_id!r}. Expected a directory of this run or a new one: "
            "pass the same run_id as the run that wrote it, or take_over=True to write and prune it from now on.")
    if not take_over and versions(base_dir):
        raise ServingDirError(
            f"Invalid value for argument `base_dir`. Received: base_dir={base_dir!r}, which holds versions "
            f"{versions(base_dir)} but no psclient run marker. Expected an empty or new directory, or "
            "take_over=True to write and prune it from now on.")
    with replaced_atomically(os.path.join(base_dir, RUN_MARKER)) as temp:
        with open(temp, "w") as f:
            json.dump({"run_id": run_id}, f)


def next_version(base_dir: str, version: int | None) -> int:
    """`version` if it is free, else raise; None: one more than the newest (1 in an empty directory)."""
    held = versions(base_dir)
    if version is None:
        return held[-1] + 1 if held else 1
    if version in held:
        raise ServingDirError(f"Invalid value for argument `version`. Received: version={version}, which exists "
                              f"in {base_dir!r}. Expected a new version (None: the next one, {held[-1] + 1}).")
    return version


def sync_tree(root: str) -> None:
    """Flush every file and directory under `root` to disk (the rename then publishes complete data)."""
    for directory, _, files in os.walk(root):
        for name in files:
            with open(os.path.join(directory, name), "rb") as f:
                os.fsync(f.fileno())
        sync_dir(directory)


def sync_dir(path: str) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


@contextlib.contextmanager
def new_version(base_dir: str, version: int | None) -> Iterator[tuple[str, int]]:
    """Yield (a hidden empty directory, the version it becomes); renamed to `<base_dir>/<version>` when
    the block ends without an error, else removed. One at a time per process."""
    with _export_lock:
        version = next_version(base_dir, version)
        scratch = tempfile.mkdtemp(prefix=_TEMP_PREFIX, dir=base_dir)
        try:
            yield scratch, version
            sync_tree(scratch)
            final = os.path.join(base_dir, str(version))
            if os.path.lexists(final):  # written meanwhile by something outside this process
                raise ServingDirError(f"Invalid value for argument `version`: {final!r} appeared during the export.")
            # mkdtemp's 0700 is for the hidden name only: a version gets its base directory's mode.
            os.chmod(scratch, os.stat(base_dir).st_mode & 0o777)
            os.rename(scratch, final)
            sync_dir(base_dir)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)  # gone after the rename; the partial version after a failure


def prune(base_dir: str, keep: int | None) -> list[int]:
    """Remove all but the newest `keep` versions (None: none removed); return the versions removed."""
    if keep is None:
        return []
    gone = versions(base_dir)[:-keep]
    for version in gone:
        # Renamed away first, so a reader never finds a version half removed.
        doomed = tempfile.mkdtemp(prefix=_TEMP_PREFIX, dir=base_dir)
        os.rename(os.path.join(base_dir, str(version)), os.path.join(doomed, "old"))
        shutil.rmtree(doomed)
    return gone
