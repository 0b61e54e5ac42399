"""The files of a checkpoint directory: which `ckpt-N` are there, the state file, deleting one.

The state file (`checkpoint`, TF's `CheckpointState` text) names the
checkpoints that count; it is replaced atomically, so that a reader never
sees half of it. A checkpoint is deleted index first: without its index it
is no longer a candidate for any reader.
"""

from __future__ import annotations

import logging
import os

import tensorflow as tf

from psclient._core.files import replaced_atomically
from psclient._tf import checkpoints as _checkpoints

__all__ = ["STATE_FILE", "delete", "number", "numbers", "state_numbers", "write_state"]

log = logging.getLogger("psclient")

STATE_FILE = "checkpoint"


def number(name: str) -> int | None:
    """N of `ckpt-N` (a file stem or a checkpoint prefix), else None."""
    prefix, _, n = os.path.basename(name).rpartition("-")
    return int(n) if prefix == "ckpt" and n.isdigit() else None


def numbers(directory: str) -> set[int]:
    """N of every `ckpt-N` in `directory` (index or data file)."""
    found = set()
    for name in tf.io.gfile.listdir(directory):
        stem, _, ext = name.partition(".")
        if ext.startswith(("index", "data")) and (n := number(stem)) is not None:
            found.add(n)
    return found


def state_numbers(directory: str) -> set[int]:
    """N of every `ckpt-N` the state file names (some may be missing)."""
    if not tf.io.gfile.exists(os.path.join(directory, STATE_FILE)):
        return set()
    try:
        state = tf.train.get_checkpoint_state(directory)
    except tf.errors.OpError as error:  # a damaged state file: the files themselves count
        log.warning("checkpoint_dir %s: the state file is unreadable (%s)", directory, error)
        return set()
    paths = [] if state is None else [state.model_checkpoint_path, *state.all_model_checkpoint_paths]
    return {n for p in paths if (n := number(os.path.basename(p))) is not None}


def write_state(directory: str, kept: list[int]) -> None:
    """The state file naming `ckpt-N` for each N of `kept` (the last the newest), replaced atomically."""
    text = _checkpoints.checkpoint_state_text([f"ckpt-{n}" for n in kept])
    final = os.path.join(directory, STATE_FILE)
    if "://" in final:  # a bucket: TF's own atomic write (temporary name, then rename)
        _checkpoints.atomic_write(final, text)
        return
    with replaced_atomically(final) as temp, open(temp, "w", encoding="utf-8") as f:
        f.write(text)


def delete(directory: str, n: int) -> None:
    """Checkpoint `ckpt-n` and its deltas, the index first."""
    prefix = os.path.join(directory, f"ckpt-{n}")
    for name in [prefix + ".index", *tf.io.gfile.glob(prefix + ".data-*"), *tf.io.gfile.glob(prefix + ".delta-*")]:
        try:
            tf.io.gfile.remove(name)
        except tf.errors.NotFoundError:
            pass
