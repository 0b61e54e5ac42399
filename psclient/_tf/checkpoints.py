"""TF's checkpoint file operations that have no public API.

`SaveV2`/`RestoreV2` run where their device scope puts them (a ps task writes
and reads its own part of a checkpoint), `MergeV2Checkpoints` joins the parts'
indexes into one checkpoint that TF's own readers open.
"""

from __future__ import annotations

from google.protobuf import text_format
from tensorflow.python.checkpoint.checkpoint_management import CheckpointState
from tensorflow.python.lib.io import file_io
from tensorflow.python.ops import gen_io_ops

__all__ = ["atomic_write", "checkpoint_state_text", "merge", "restore", "save"]


def save(prefix: str, keys: list[str], specs: list[str], values: list) -> None:
    """Write `values` under `keys` as checkpoint `prefix`, on the device in force."""
    gen_io_ops.save_v2(prefix, keys, specs, values)


def restore(prefix: str, keys: list[str], specs: list[str], dtypes: list) -> list:
    """Read `keys` of checkpoint `prefix`, on the device in force."""
    return gen_io_ops.restore_v2(prefix, keys, specs, dtypes)


def merge(prefixes: list[str], prefix: str) -> None:
    """Join the checkpoints `prefixes` into `prefix` (their data files renamed), deleting their directories."""
    gen_io_ops.merge_v2_checkpoints(prefixes, prefix, delete_old_dirs=True)


def checkpoint_state_text(names: list[str]) -> str:
    """The text of TF's `checkpoint` state file naming `names`, the last the newest."""
    state = CheckpointState(model_checkpoint_path=names[-1], all_model_checkpoint_paths=names)
    return text_format.MessageToString(state)


def atomic_write(path: str, text: str) -> None:
    """Write `text` to `path` on any of TF's filesystems (a bucket too): a temporary name, then a rename."""
    file_io.atomic_write_string_to_file(path, text)

