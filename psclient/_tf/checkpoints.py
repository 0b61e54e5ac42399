"""TF's checkpoint file operations that have no public API.

`SaveV2`/`RestoreV2` run where their device scope puts them (a ps task writes
and reads its own part of a checkpoint), `MergeV2Checkpoints` joins the parts'
indexes into one checkpoint that TF's own readers open.
"""

from __future__ import annotations

from google.protobuf import text_format
from tensorflow.python.checkpoint.checkpoint_management import CheckpointState
from tensorflow.python.framework import constant_op, dtypes, ops
from tensorflow.python.lib.io import file_io
from tensorflow.python.ops import gen_io_ops

from psclient._tf.context import coordinator_cpu

__all__ = ["atomic_write", "checkpoint_state_text", "merge", "restore", "save"]


def save(prefix: str, keys: list[str], specs: list[str], values: list) -> None:
    """Write `values` under `keys` as checkpoint `prefix`, on the device in force."""
    values = [v if isinstance(v, ops.EagerTensor) else _here(v) for v in values]
    gen_io_ops.save_v2(_here(prefix), _here(keys), _here(specs), values)


def restore(prefix: str, keys: list[str], specs: list[str], dtypes: list) -> list:
    """Read `keys` of checkpoint `prefix`, on the device in force."""
    return gen_io_ops.restore_v2(_here(prefix), _here(keys), _here(specs), dtypes)


def merge(prefixes: list[str], prefix: str) -> None:
    """Join the checkpoints `prefixes` into `prefix` (their data files renamed), deleting their directories."""
    gen_io_ops.merge_v2_checkpoints(_here(prefixes), _here(prefix), delete_old_dirs=True)


def _here(value, dtype=None):
    """`value` as a tensor on the coordinator's CPU, whatever device is in force.

    Converted under a task's device, TF would copy it to the task from inside
    the conversion, holding the GIL: a hung task would then stop every thread
    of the coordinator. The op that uses it copies it without the GIL.
    """
    if dtype is None and isinstance(value, (str, list)):
        dtype = dtypes.string
    with ops.device(coordinator_cpu()):
        return constant_op.constant(value, dtype)


def checkpoint_state_text(names: list[str]) -> str:
    """The text of TF's `checkpoint` state file naming `names`, the last the newest."""
    state = CheckpointState(model_checkpoint_path=names[-1], all_model_checkpoint_paths=names)
    return text_format.MessageToString(state)


def atomic_write(path: str, text: str) -> None:
    """Write `text` to `path` on any of TF's filesystems (a bucket too): a temporary name, then a rename."""
    file_io.atomic_write_string_to_file(path, text)

