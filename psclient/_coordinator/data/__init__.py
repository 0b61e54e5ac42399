"""Data on the workers: per-worker datasets and resources (`per_worker`, `datasets`), finite datasets
read once (`finite`), shards read once per epoch (`shards`) and the data ledger's feed
(`shard_feed`). Entry: `per_worker`.
"""
