"""What the recovery machine (`psclient._core.recovery_machine`) is configured with. Pure data."""

from __future__ import annotations

import dataclasses

__all__ = ["MachineConfig"]


@dataclasses.dataclass(frozen=True)
class MachineConfig:
    num_workers: int
    num_ps: int
    hang_timeout: float = 30.0
    worker_timeout: float = 300.0
    ps_timeout: float = 300.0
    #: Seconds between rounds while nothing waits.
    interval: float = 1.0
    #: A checkpoint_dir was given.
    checkpointing: bool = False
    checkpoint_interval: float | None = None
    checkpoint_every: int | None = None
    delta_checkpoint_interval: float | None = None
    delta_checkpoint_every: int | None = None
    #: checkpoint_dir already holds a checkpoint.
    has_checkpoint: bool = False
    #: Allow checkpoints while a worker in TF's view hangs.
    checkpoint_while_hung: bool = False
    #: Failed attempts at recovering a ps that came back before giving up.
    ps_attempts: int = 3
    #: What RenewAndRestore restores: "part" (the lost ps) or "all" (`part_recovery`).
    ps_recovery: str = "all"
    #: Big variables are copied before a checkpoint's pause (CopyForCheckpoint).
    copies_before_cut: bool = False
