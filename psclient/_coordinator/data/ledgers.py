"""A strategy's data ledgers: its `ShardFeed`s, what its checkpoints save of them, what comes back.

One `Ledgers` per strategy, built by the assembly (`psclient._coordinator.parts`) over its
variable store and handed to the recovery as bound methods (`meta`, `roll_back`): nothing
here holds the strategy, and no registry outside it holds its feeds.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

from psclient._coordinator.data.shard_feed import LEDGERS_KEY, ShardFeed

__all__ = ["Ledgers"]


class Ledgers:
    """One strategy's data ledgers: its feeds (weakly: a feed the program dropped is not kept),
    what each checkpoint saves of them, and what a restore or a ps recovery gives back.

    Built with the strategy's parts (`psclient._coordinator.parts`), over its variable store,
    which names each feed's ledger by its positions variable's checkpoint key.
    """

    def __init__(self, store):
        self._store = store
        self._lock = threading.Lock()
        self._feeds: "weakref.WeakSet[ShardFeed]" = weakref.WeakSet()
        # Ledgers restored by strategy.restore() whose feed is not created yet, by positions variable key.
        self._restored: dict = {}
        # The feeds made for an owner (a model's sharded fit), by sharded dataset: made once each.
        self._by_owner: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()

    def feed_for(self, owner: Any, sharded: Any, make: Callable[[], ShardFeed]) -> ShardFeed:
        """The feed of (`owner`, `sharded`): made by `make()` the first time (its ps variables with it),
        the same one after, while both live."""
        with self._lock:
            feed = self._by_owner.get(owner, {}).get(id(sharded))
        if feed is None or feed.sharded is not sharded:
            feed = make()  # outside the lock: a new feed adds itself
            with self._lock:
                self._by_owner.setdefault(owner, {})[id(sharded)] = feed
        return feed

    def add(self, feed: ShardFeed) -> None:
        """A new feed; created after strategy.restore() (fit creates its feed), it takes the ledger saved for it."""
        with self._lock:
            self._feeds.add(feed)
            saved = self._restored.pop(self.key_of(feed), None) if self._restored else None
        if saved is not None:
            feed.load(saved)

    def key_of(self, feed: ShardFeed, variables: dict | None = None) -> str | None:
        """The checkpoint key of `feed`'s positions variable (its creation index), which names its ledger."""
        variables = self._store.named() if variables is None else variables
        return next((key for key, v in variables.items() if v is feed.positions_variable), None)

    def _each(self) -> list:
        with self._lock:
            return list(self._feeds)

    def meta(self, variables: dict) -> dict | None:
        """What a strategy checkpoint of `variables` saves of the data ledgers (recovery thread,
        between closures): each feed's state by its positions variable's key, plus restored
        ledgers whose feed does not exist yet. None without any."""
        with self._lock:
            ledgers = dict(self._restored)
        for feed in self._each():
            key = self.key_of(feed, variables)
            if key is not None:
                ledgers[key] = feed.state()
        return {LEDGERS_KEY: ledgers} if ledgers else None

    def restore(self, saved: dict) -> int:
        """Hand the ledgers of a restored strategy checkpoint to their feeds: those that exist now
        load theirs at once (`LedgerMismatchError` for other shards); the others when created."""
        pending = dict(saved)
        for feed in self._each():
            key = self.key_of(feed)
            if key in pending:
                feed.load(pending.pop(key))
        with self._lock:
            self._restored = pending
        return len(saved)

    def roll_back(self, meta: dict | None, lost: frozenset | None = None) -> None:
        """A lost ps was restored from a checkpoint with `meta` (recovery thread): every feed
        goes back to that checkpoint's ledger, as its variables did. With `lost`, only those
        ps were restored (`ps_recovery="part"`): the ledgers keep what is done
        (`ShardFeed.keep_through_part_restore`)."""
        saved = (meta or {}).get(LEDGERS_KEY, {})
        for feed in self._each():
            if lost is not None:
                feed.keep_through_part_restore(lost)
            else:
                feed.roll_back(saved.get(self.key_of(feed)))

    def stats(self) -> dict:
        """`strategy.stats()["data"]`: every feed's ledger stats, and their replayed records together."""
        feeds = [feed.stats() for feed in self._each()]
        return {"feeds": feeds, "replayed_records": sum(f["replayed_records"] for f in feeds)}
