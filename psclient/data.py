"""`psclient.data`: training data read once per epoch, through a ledger.

    shards = psclient.data.range_shards(num_records=60_000, shard_size=1_000)
    data = psclient.data.ShardedDataset(shards, make_dataset, seed=0)
    model.fit(data, epochs=3)                       # every shard once per epoch

`make_dataset(shard)` returns one shard's batches, with `shard.start`,
`shard.end` (int64 scalars), `shard.file` (a string scalar, file shards)
and `shard.epoch` (int64 scalar) as tensors; it is traced once and runs on
the workers. For custom loops,
`ShardFeed` drives the same ledger with `strategy.schedule`. The guarantee
and how it holds across failures and restarts: docs/data_ledger.md.
"""

from psclient._coordinator.data.shard_feed import ShardFeed, ShardWork
from psclient._coordinator.data.shards import Shard, ShardedDataset, file_shards, range_shards
from psclient._core.ledger import LedgerMismatchError

__all__ = [
    "LedgerMismatchError",
    "Shard",
    "ShardFeed",
    "ShardWork",
    "ShardedDataset",
    "file_shards",
    "range_shards",
]
