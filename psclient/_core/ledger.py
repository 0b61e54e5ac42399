"""The data ledger: which shards of an epoch are done, and where the others stand.

Pure bookkeeping, no TensorFlow. The coordinator owns one `Ledger` per
`ShardedDataset` in use; its state changes only through the methods below,
each a documented transition, so failure handling is testable without a
cluster:

- `start_epoch(epoch)`: a new epoch gets a fresh, seeded shard order; the
  epoch the ledger already holds (a resumed one) keeps its done shards.
- `hand_out()`: the next shard no one holds, with the position (batches
  already done) to resume it from. Called when a worker is free: late binding.
- `progress(slot, position)`: a shard's batches done so far (monotonic).
- `finish(slot, records, replayed)`: a shard is done, with the records its
  last attempt read and those it may have read twice (see below).
- `give_back(slot, position)`: a holder failed or hung; the shard goes back to
  the front of the queue and is resumed from `position`.
- `roll_back(saved)`: the variables were restored from a checkpoint whose
  ledger was `saved` (a lost ps): shards done since then are not done any more.

`replayed_records` counts records that a failure may have made train twice:
the batch that was in flight when an attempt was cut off is read again by the
next attempt (a step cut off before its update reached the ps trained nothing,
so the count is an upper bound).

`state()` is JSON-serialisable; `load(state)` checks it against the shards
given now (their number and a fingerprint of their bounds and files) and
raises `LedgerMismatchError` naming both, rather than starting over silently.
"""

from __future__ import annotations

import collections
import hashlib
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from psclient._core.errors import PSClientError

__all__ = ["Ledger", "LedgerMismatchError", "ShardKey", "Work", "shard_order"]

#: Bumped when the meaning of a saved state changes.
STATE_VERSION = 1


class LedgerMismatchError(PSClientError, ValueError):
    """A saved ledger does not describe the shards given now."""


@dataclass(frozen=True)
class ShardKey:
    """What identifies a shard: records `[start, end)` of `file` (None for an indexed source)."""

    start: int
    end: int
    file: str | None = None

    def as_list(self) -> list:
        return [self.file, self.start, self.end]


@dataclass(frozen=True)
class Work:
    """One shard handed out: its slot (index in the shard list), bounds and resume position."""

    slot: int
    shard: ShardKey
    position: int  # batches of the shard already done
    epoch: int


def fingerprint(shards: Sequence[ShardKey]) -> str:
    """A short digest of every shard's file and bounds, in order."""
    text = json.dumps([s.as_list() for s in shards], separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def shard_order(num_shards: int, seed: int | None, epoch: int) -> list[int]:
    """The order shards are handed out in `epoch`: as given without a seed,
    else a shuffle that depends only on (seed, epoch), the same in every run."""
    order = list(range(num_shards))
    if seed is not None:
        random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return order


class Ledger:
    """Per-epoch state of a list of shards (module doc)."""

    def __init__(self, shards: Sequence[ShardKey], seed: int | None = None):
        if not shards:
            raise ValueError("Invalid value for argument `shards`. Received: an empty list. Expected at least one shard.")
        self._shards = tuple(shards)
        self._seed = seed
        self._fingerprint = fingerprint(self._shards)
        self._epoch: int | None = None
        self._order: list[int] = []
        self._queue: collections.deque[int] = collections.deque()
        self._done: set[int] = set()
        self._held: set[int] = set()
        self._positions: dict[int, int] = {}
        self._records = 0
        self._replayed = 0
        self._given_back = 0
        self._rolled_back = 0
        self._finished_records: dict[int, int] = {}  # records each done shard added to _records
        # Shards held when a loaded state was saved: their next attempt may replay a batch.
        self._cut_off: set[int] = set()

    # ---------------------------------------------------------------- info
    @property
    def shards(self) -> tuple[ShardKey, ...]:
        return self._shards

    @property
    def epoch(self) -> int | None:
        return self._epoch

    @property
    def seed(self) -> int | None:
        return self._seed

    def complete(self) -> bool:
        """Whether every shard of the current epoch is done."""
        return self._epoch is not None and len(self._done) == len(self._shards)

    def remaining(self) -> int:
        """Shards of the current epoch not done yet (held ones included)."""
        return len(self._shards) - len(self._done)

    def held(self) -> set[int]:
        """Shards handed out and not finished or given back."""
        return set(self._held)

    def cut_off(self) -> set[int]:
        """Shards that were held when the loaded state was saved (their holders were cut off)."""
        return set(self._cut_off)

    def stats(self) -> dict:
        return {
            "epoch": self._epoch,
            "shards": len(self._shards),
            "done": len(self._done),
            "in_flight": len(self._held),
            "records": self._records,
            "replayed_records": self._replayed,
            "given_back": self._given_back,
            "rolled_back_shards": self._rolled_back,
        }

    # --------------------------------------------------------- transitions
    def start_epoch(self, epoch: int) -> None:
        """Begin `epoch`; the epoch already held (resumed from a saved state) is kept as it is."""
        if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
            raise ValueError(f"Invalid value for argument `epoch`. Received: epoch={epoch!r}. Expected an integer >= 0.")
        if epoch == self._epoch and not self.complete():
            # Resuming: what was held when the state was saved is handed out again.
            self._requeue_held()
            return
        self._epoch = epoch
        self._order = shard_order(len(self._shards), self._seed, epoch)
        self._queue = collections.deque(self._order)
        self._done.clear()
        self._held.clear()
        self._cut_off.clear()
        self._positions.clear()
        self._finished_records.clear()

    def hand_out(self) -> Work | None:
        """The next shard to run, or None when every shard is done or held."""
        self._require_epoch("hand_out")
        while self._queue:
            slot = self._queue.popleft()
            if slot in self._done or slot in self._held:
                continue
            self._held.add(slot)
            return Work(slot, self._shards[slot], self._positions.get(slot, 0), self._epoch)
        return None

    def progress(self, slot: int, position: int) -> None:
        """Shard `slot` has `position` batches done (positions only grow)."""
        self._check_slot(slot)
        if slot not in self._done:
            self._positions[slot] = max(position, self._positions.get(slot, 0))

    def finish(self, slot: int, records: int = 0, replayed: int = 0) -> None:
        """Shard `slot` is done for this epoch. Finishing it twice is a no-op (a late duplicate)."""
        self._require_epoch("finish")
        self._check_slot(slot)
        self._held.discard(slot)
        if slot in self._done:
            return
        self._done.add(slot)
        self._positions.pop(slot, None)
        self._records += int(records)
        self._finished_records[slot] = int(records)
        self._replayed += int(replayed)

    def give_back(self, slot: int, position: int | None = None, replayed: int = 0) -> None:
        """A holder of `slot` failed: hand it out next, resumed from `position` (or the last known one)."""
        self._require_epoch("give_back")
        self._check_slot(slot)
        if slot in self._done:
            return
        if position is not None:
            self.progress(slot, position)
        self._replayed += int(replayed)
        self._given_back += 1
        self._held.discard(slot)
        self._queue.appendleft(slot)

    def roll_back(self, saved: dict | None) -> tuple[list[int], bool]:
        """The variables (shard positions included) were restored from a checkpoint whose
        ledger was `saved`: what was trained since is lost, so the shards done since are
        handed out again, first, from their positions then. Held shards stay held (their
        closures run again, from the positions restored). `saved` None or of another epoch
        (a checkpoint older than this epoch): nothing of this epoch is done, every position
        is 0. Returns (the shards handed out again, whether the epoch started over)."""
        self._require_epoch("roll_back")
        same_epoch = saved is not None and saved.get("epoch") == self._epoch
        if saved is not None:
            self._check_state(saved)
        kept = {int(s) for s in saved["done"]} if same_epoch else set()
        undone = sorted(self._done - kept)
        for slot in undone:
            self._records -= self._finished_records.pop(slot, 0)
        self._done &= kept
        self._positions = {int(s): int(p) for s, p in saved["positions"].items()} if same_epoch else {}
        self._rolled_back += len(undone)
        waiting = [s for s in self._order if s not in self._done and s not in self._held]
        # Those done since the checkpoint first: they are the ones the epoch lost.
        self._queue = collections.deque([s for s in waiting if s in undone] + [s for s in waiting if s not in undone])
        return undone, not same_epoch

    def _requeue_held(self) -> None:
        for slot in sorted(self._held, key=self._order.index, reverse=True):
            self._queue.appendleft(slot)
        self._held.clear()

    # ---------------------------------------------------------- persistence
    def state(self) -> dict:
        """Everything needed to resume this epoch in another process, as JSON-ready data."""
        return {
            "version": STATE_VERSION,
            "num_shards": len(self._shards),
            "fingerprint": self._fingerprint,
            "seed": self._seed,
            "epoch": self._epoch,
            "done": sorted(self._done),
            "held": sorted(self._held),
            # Held shards resume from their last known position; a restart hands them out again.
            "positions": {str(slot): position for slot, position in sorted(self._positions.items())},
            "records": self._records,
            "replayed_records": self._replayed,
        }

    def load(self, state: Any) -> None:
        """Take over a saved `state()`; raise `LedgerMismatchError` if it describes other shards."""
        self._check_state(state)
        epoch = state["epoch"]
        self._epoch = epoch
        self._order = shard_order(len(self._shards), self._seed, epoch) if epoch is not None else []
        self._done = {int(s) for s in state["done"]}
        self._held = set()
        self._cut_off = {int(s) for s in state["held"]}
        self._positions = {int(s): int(p) for s, p in state["positions"].items()}
        # The shards cut off first, then the others in this epoch's order.
        first = [s for s in self._order if s in self._cut_off]
        self._queue = collections.deque(first + [s for s in self._order if s not in self._done and s not in self._cut_off])
        self._records = int(state["records"])
        self._replayed = int(state["replayed_records"])
        self._finished_records.clear()

    def _check_state(self, state: Any) -> None:
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            raise LedgerMismatchError(
                f"Invalid data ledger state. Received: {_short(state)}. Expected a dict saved by "
                f"psclient's data ledger, version {STATE_VERSION}."
            )
        if state["num_shards"] != len(self._shards) or state["fingerprint"] != self._fingerprint:
            raise LedgerMismatchError(
                "The saved data ledger does not match the shards given now. Received: a ledger of "
                f"{state['num_shards']} shards (fingerprint {state['fingerprint']}). Expected "
                f"{len(self._shards)} shards (fingerprint {self._fingerprint}), first "
                f"{self._shards[0].as_list()}. Pass the same files and shard sizes as the run that "
                "saved it, or start in a fresh directory; psclient does not restart the epoch silently."
            )
        if state["seed"] != self._seed:
            raise LedgerMismatchError(
                f"The saved data ledger was shuffled with another seed. Received: seed={state['seed']!r}. "
                f"Expected seed={self._seed!r} (the ShardedDataset's seed now)."
            )

    # -------------------------------------------------------------- checks
    def _require_epoch(self, what: str) -> None:
        if self._epoch is None:
            raise RuntimeError(f"Cannot call {what}() before start_epoch().")

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < len(self._shards):
            raise IndexError(f"Shard slot {slot} out of range: the ledger has {len(self._shards)} shards.")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."
