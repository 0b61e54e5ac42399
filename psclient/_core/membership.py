"""Which worker slots are joining and which are retired. Pure logic.

Worker indices are slots that never move: a new worker gets the next index,
a retired one keeps its slot (and its stats) until a worker at the same
address takes it again. The scheduler owns one `Membership` and asks it; it
is guarded by the scheduler's lock (every method is called with it held).

State                 | meaning
----------------------|-----------------------------------------------------
joining               | a new slot, or a retired one taken again, not yet up
                      | once (its first worker_up is no rejoin)
retired               | takes nothing; its dispatcher threads end
"""

from __future__ import annotations

__all__ = ["Membership"]


class Membership:
    """The joining and retired worker slots; see the module docstring."""

    def __init__(self):
        self._retired: set[int] = set()
        self._joining: set[int] = set()

    def joined(self, worker: int) -> None:
        """A new slot: joining until its first `first_up`."""
        self._joining.add(worker)

    def rejoin(self, worker: int) -> None:
        """A retired slot becomes a joining worker again.

        Raises:
            ValueError: the slot is not retired.
        """
        if worker not in self._retired:
            raise ValueError(f"worker {worker} is not retired")
        self._retired.discard(worker)
        self._joining.add(worker)

    def retire(self, worker: int) -> None:
        self._retired.add(worker)
        self._joining.discard(worker)

    def is_retired(self, worker: int) -> bool:
        return worker in self._retired

    def retired(self) -> frozenset:
        return frozenset(self._retired)

    def first_up(self, worker: int) -> bool:
        """Whether this up is a joining worker's first (not a rejoin); forgets it."""
        if worker in self._joining:
            self._joining.discard(worker)
            return True
        return False
