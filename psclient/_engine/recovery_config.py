"""How the recovery thread (`psclient._engine.recovery`) is configured."""

from __future__ import annotations

import dataclasses

from psclient._core.machine_config import MachineConfig

__all__ = ["RecoveryConfig"]


@dataclasses.dataclass(frozen=True)
class RecoveryConfig:
    #: When to checkpoint (with `checkpoints` given to `Recovery`).
    checkpoint_interval: float | None = None
    checkpoint_every: int | None = None
    delta_checkpoint_interval: float | None = None
    delta_checkpoint_every: int | None = None
    hang_timeout: float = 30.0
    worker_timeout: float = 300.0
    ps_timeout: float = 300.0
    #: How long a probe made while classifying an error may wait.
    probe_timeout: float = 10.0
    #: Seconds between rounds (heartbeat probes, rejoin checks).
    interval: float = 1.0
    #: See `MachineConfig`. Checkpoints involve only the ps tasks and the
    #: coordinator (see checkpoint.py), so a hung worker does not stop them.
    checkpoint_while_hung: bool = True
    #: What a lost ps gets back: "part" (its own state) or "all" (`psclient._core.part_recovery`).
    ps_recovery: str = "all"

    def machine(self, num_workers: int, num_ps: int, *, checkpointing: bool, has_checkpoint: bool) -> MachineConfig:
        """The recovery machine's configuration: this one's, for a cluster of that shape. With
        checkpoints, their big variables are copied before each cut on a thread of its own."""
        return MachineConfig(
            num_workers=num_workers, num_ps=num_ps, hang_timeout=self.hang_timeout,
            worker_timeout=self.worker_timeout, ps_timeout=self.ps_timeout, interval=self.interval,
            checkpointing=checkpointing, checkpoint_interval=self.checkpoint_interval,
            checkpoint_every=self.checkpoint_every, delta_checkpoint_interval=self.delta_checkpoint_interval,
            delta_checkpoint_every=self.delta_checkpoint_every, has_checkpoint=has_checkpoint,
            checkpoint_while_hung=self.checkpoint_while_hung, ps_recovery=self.ps_recovery,
            copies_before_cut=checkpointing,
        )
