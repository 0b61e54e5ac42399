"""What a ps recovery restores, and what it reports of it. Pure logic.

`ps_recovery="all"` (psclient's only behaviour before): when a lost ps comes
back, every variable of every ps goes back to the newest checkpoint, one
consistent state; the closures completed since are undone everywhere and the
data ledgers roll back with them (the shards done since are handed out
again).

`ps_recovery="part"` (the default in asynchronous training): only what the
lost ps held is restored, from its own part of the newest checkpoint (its
variables and shards, the optimizer slots there, its dynamic tables' rows,
counters and clocks); the other ps keep their values. So the closures
completed since the checkpoint are *not* undone: their updates stay on every
other ps and are lost on the lost ps only. Nothing is replayed for them:

- the data ledgers keep their done shards (their records' updates survive
  elsewhere; training them again would apply those twice there);
- a ledger whose own variables (each shard's position and attempts) were on
  the lost ps gets the positions the coordinator knows back
  (`ledger_positions`), not the checkpoint's: those may be another epoch's. A
  shard in flight at the loss then resumes from the position known at the
  newest checkpoint (or its last hand-back): its batches trained between that
  and the loss are trained again;
- `optimizer.iterations`, or any counter, on the lost ps goes back to the
  checkpoint with the rest of that ps (as do the slots of that ps's
  variables); it then counts fewer steps than were applied elsewhere. Its
  value at the loss died with the ps: nothing could take the larger one.

Asynchronous training has no consistent state between checkpoints anyway
(each update applies to whatever the other workers left), so a part that is
older than the rest is one more form of staleness. Synchronous training
(`replicas_to_aggregate`) promises that every step reads one version of
every weight and that each version applies one aggregate to all of them; a
part restored alone breaks that (the lost ps's weights would be of an older
version than the version counter says), so it keeps "all".
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["KEPT", "MODES", "RestoreScope", "closures_undone", "kept", "ledger_positions", "resolve_ps_recovery", "restore_scope",
           "rolled_back"]

#: The values of `StrategyConfig.ps_recovery` (None: chosen by the kind of training).
MODES = ("part", "all")


def resolve_ps_recovery(value: Any, replicas_to_aggregate: int | None) -> str:
    """The mode a strategy uses: `value` checked, or (None) "part" for asynchronous
    training and "all" for synchronous (`replicas_to_aggregate`).

    Raises ValueError naming the argument, what was received and what was expected.
    """
    if value is None:
        return "all" if replicas_to_aggregate is not None else "part"
    if not isinstance(value, str) or value not in MODES:
        raise ValueError(
            f"Invalid value for argument `ps_recovery`. Received: ps_recovery={value!r}. Expected "
            "\"part\" (restore only the lost ps from the newest checkpoint), \"all\" (roll every "
            "variable back to it) or None (\"part\", or \"all\" with replicas_to_aggregate)."
        )
    if value == "part" and replicas_to_aggregate is not None:
        raise ValueError(
            f"Invalid value for argument `ps_recovery`. Received: ps_recovery={value!r} with "
            f"replicas_to_aggregate={replicas_to_aggregate!r}. Expected \"all\" or None: synchronous "
            "training applies each aggregated update to every variable as one version, and a ps "
            "restored alone would hold an older version than the others."
        )
    return value


@dataclasses.dataclass(frozen=True)
class RestoreScope:
    """What one recovery restores: `lost` ps came back; `mode` says whose state goes back.

    A "part" that is every ps (one ps in all, or every ps lost at once) is "all":
    nothing survives anywhere, so the ledgers roll back and the work since is replayed.
    """

    mode: str
    lost: tuple
    num_ps: int

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"Invalid ps recovery mode {self.mode!r}. Expected one of {MODES}.")
        if self.mode == "part" and set(range(self.num_ps)) <= set(self.lost):
            object.__setattr__(self, "mode", "all")

    @property
    def restored_ps(self) -> frozenset:
        """The ps tasks whose state is restored from the checkpoint."""
        return frozenset(self.lost) if self.mode == "part" else frozenset(range(self.num_ps))

    @property
    def only_ps(self) -> frozenset | None:
        """What a restore is limited to: the lost ps ("part"), or None (every ps)."""
        return frozenset(self.lost) if self.mode == "part" else None

    @property
    def rolls_back_ledgers(self) -> bool:
        """Whether the data ledgers go back to the checkpoint's (shards done since: handed out again)."""
        return self.mode == "all"


def restore_scope(mode: str, lost: tuple, holding: tuple, num_ps: int) -> RestoreScope | None:
    """What a recovery restores once the `lost` ps answer again; None: nothing.

    A lost ps that answers holding the variables this coordinator made there
    (`holding`) hung (SIGSTOP, a cut network, a stall long enough to be taken
    for a loss) and was not restarted: its state is what it was, so restoring
    it would undo its updates since the checkpoint for nothing. Only the
    others count as lost: restored alone ("part"), or, if any is left, with
    every ps ("all": one version everywhere, the ones that hung included).
    """
    gone = tuple(ps for ps in lost if ps not in set(holding))
    return RestoreScope(mode, gone, num_ps) if gone else None


#: `rolled_back`'s mode for a lost ps that came back holding its variables: nothing restored there.
KEPT = "kept"


def rolled_back(scope: RestoreScope, variables: dict[int, int], rows: dict[int, int], closures: dict[int, int],
                checkpoint: str | None) -> dict[int, dict]:
    """ps -> what this recovery took back to the checkpoint on it (`stats()["ps"][k]["rolled_back"]`).

    `variables` / `rows`: per ps, the variables (shards of partitioned ones
    counted each) and dynamic-table rows restored there; `closures`: per ps,
    the closures completed since the checkpoint (or since that ps's previous
    restore, if later) whose updates on it were undone.
    """
    return {ps: {"mode": scope.mode, "checkpoint": checkpoint, "variables": variables.get(ps, 0),
                 "rows": rows.get(ps, 0), "closures": closures.get(ps, 0)} for ps in sorted(scope.restored_ps)}


def kept(ps_tasks) -> dict[int, dict]:
    """ps -> the report of a lost ps that came back holding its variables (`restore_scope`)."""
    return {ps: {"mode": KEPT, "checkpoint": None, "variables": 0, "rows": 0, "closures": 0} for ps in ps_tasks}


def closures_undone(completed: int, checkpoint_completed: int | None, restored_at: dict[int, int],
                    ps_tasks) -> dict[int, int]:
    """ps -> the closures whose updates a restore undid there: those completed since the
    checkpoint, or since that ps's previous restore if that came later (the same checkpoint
    restored twice on a ps undoes the closures before the first restore once, not twice)."""
    base = checkpoint_completed or 0
    return {ps: max(0, completed - max(base, restored_at.get(ps, 0))) for ps in ps_tasks}


def ledger_positions(known: dict, held: set, num_shards: int) -> tuple[list[int], list[int]]:
    """A ledger's ps slots after a part-only recovery restored them from an older checkpoint:
    (position of each shard, the shards whose attempt count is raised by one).

    `known`: the positions the coordinator's ledger knows (slot -> batches, as
    `Ledger.state()["positions"]` gives them); `held`: shards in flight, whose
    closures run again (their first batches may be a replay: counted so).
    """
    positions = [0] * num_shards
    for slot, position in known.items():
        positions[int(slot)] = int(position)
    return positions, sorted(int(s) for s in held)
