"""Delta versions beside TF Serving's full versions: their layout, and what a reader does next.

A full version is `<base_dir>/<V>/` (a SavedModel, `psclient._core.serving_dirs`).
The deltas taken after it are

    <base_dir>/deltas/<V>/<seq>/          seq = 1, 2, 3 ...
        delta.json                        the manifest: what is in the delta (written last)
        t<i>_s<k>_keys, _rows, _removed   per dynamic table i, per shard k: rows changed since
                                          the previous cut and their keys, keys gone since it
        d<j>  (d<j>_p<i>: shard i)        dense variable j, whole (manifest: "form" "whole")
        d<j>_idx, d<j>_rows               or its rows changed: their int64 indices in the
          (d<j>_p<i>_idx, _rows)          shard, the rows ("form" "rows"; a shard whose rows
                                          are no smaller written whole, "written" per shard)

each file one `tf.io.serialize_tensor`. Manifest format 2 (this one) adds the
dense entries' "form"; a format 1 delta (dense variables all whole) reads as
"form" "whole", and a format this module does not know is refused.

A delta holds what changed since the cut before it (delta seq - 1, or the
full version V for seq 1), so a reader applies them in order and never skips one. `deltas` is not an integer: TF
Serving, which loads integer-named directories of `base_dir` only, never
sees a delta. A delta is written under a hidden name in its chain's
directory and renamed to its number when every file is on disk (as a full
version is), so a reader never finds half of one.

`next_step` is what a reader (`psclient.serving`) does next, as plain logic:
load the newest full version, apply the next delta, or, when the next delta
is missing but a later one exists (a gap: deltas are never applied out of
order), load the newest full version again.

Pure Python (no TensorFlow).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import NamedTuple

from psclient._core import serving_dirs
from psclient._core.serving_dirs import ServingDirError

__all__ = ["DELTAS", "MANIFEST", "Step", "chain_dir", "deltas", "new_delta", "next_step", "prune_chains",
           "read_manifest"]

DELTAS = "deltas"
MANIFEST = "delta.json"
FORMAT = 2
#: The formats `read_manifest` accepts: 1 (before row diffs of dense variables), 2.
READABLE_FORMATS = (1, 2)
_TEMP_PREFIX = ".psclient-delta-"


def chain_dir(base_dir: str, version: int) -> str:
    """The directory of the deltas taken after full version `version`."""
    return os.path.join(base_dir, DELTAS, str(version))


def deltas(base_dir: str, version: int) -> list[int]:
    """The deltas written after full version `version` (their sequence numbers), oldest first."""
    return serving_dirs.versions(chain_dir(base_dir, version))


@contextlib.contextmanager
def new_delta(base_dir: str, version: int, seq: int) -> Iterator[str]:
    """Yield a hidden empty directory, renamed to `<base_dir>/deltas/<version>/<seq>` when the block ends
    without an error (every file flushed first), else removed."""
    chain = chain_dir(base_dir, version)
    os.makedirs(chain, exist_ok=True)
    final = os.path.join(chain, str(seq))
    if os.path.lexists(final):
        raise ServingDirError(f"Invalid value for argument `seq`. Received: seq={seq}, which exists in {chain!r}. "
                              "Expected the next delta of the chain.")
    scratch = tempfile.mkdtemp(prefix=_TEMP_PREFIX, dir=chain)
    try:
        yield scratch
        serving_dirs.sync_tree(scratch)
        os.chmod(scratch, os.stat(base_dir).st_mode & 0o777)
        os.rename(scratch, final)
        serving_dirs.sync_dir(chain)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)  # gone after the rename; the partial delta after a failure


def write_manifest(directory: str, manifest: dict) -> None:
    with open(os.path.join(directory, MANIFEST), "w") as f:
        json.dump({"format": FORMAT, **manifest}, f)


def read_manifest(directory: str) -> dict:
    """A delta's manifest; `ServingDirError` if it is not one psclient wrote in this format."""
    path = os.path.join(directory, MANIFEST)
    try:
        with open(path) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as error:
        raise ServingDirError(f"The delta {directory!r} cannot be read: {path!r} ({error}).") from error
    if not isinstance(manifest, dict) or manifest.get("format") not in READABLE_FORMATS:
        raise ServingDirError(f"The delta {directory!r} is in an unknown format: {path!r} holds "
                              f"format {manifest.get('format') if isinstance(manifest, dict) else manifest!r}, "
                              f"expected one of {list(READABLE_FORMATS)} (a newer psclient wrote it?).")
    for entry in manifest.get("dense", []):
        entry.setdefault("form", "whole")  # format 1: every dense variable whole
    return manifest


def prune_chains(base_dir: str) -> list[int]:
    """Remove the deltas of full versions that are gone (pruned); return those versions."""
    kept = set(serving_dirs.versions(base_dir))
    root = os.path.join(base_dir, DELTAS)
    gone = [version for version in serving_dirs.versions(root) if version not in kept]
    for version in gone:
        # Renamed away first, so a reader never lists a chain half removed.
        doomed = tempfile.mkdtemp(prefix=_TEMP_PREFIX, dir=root)
        os.rename(os.path.join(root, str(version)), os.path.join(doomed, "old"))
        shutil.rmtree(doomed)
    return gone


class Step(NamedTuple):
    """What a reader does next: `kind` is "load" (full `version`), "apply" (delta `seq` of `version`)
    or "wait" (nothing new); `gap` is the missing delta that made it load again, if one did."""

    kind: str
    version: int | None = None
    seq: int | None = None
    gap: int | None = None


def next_step(at: tuple[int, int] | None, fulls: list[int], chain: list[int],
              gap_handled: tuple[int, int] | None = None) -> Step:
    """The reader's next step.

    at: (full version, last delta applied; 0 for none) the reader serves, or None;
    fulls: the full versions in `base_dir`; chain: the deltas after `at`'s full version;
    gap_handled: a gap (version, missing delta) already answered by a reload: it waits
    for the missing delta or a newer full version rather than reloading again.
    """
    if not fulls:
        return Step("wait")
    newest = fulls[-1]
    if at is None or newest > at[0]:
        return Step("load", newest)
    version, applied = at
    if applied + 1 in chain:
        return Step("apply", version, applied + 1)
    if any(seq > applied + 1 for seq in chain) and gap_handled != (version, applied + 1):
        return Step("load", newest, gap=applied + 1)  # never a delta out of order
    return Step("wait")
