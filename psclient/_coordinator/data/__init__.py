"""Data on the workers: per-worker datasets and resources (`per_worker`, `datasets`), finite datasets
read once (`finite`), shards read once per epoch (`shards`), the data ledger's feed
(`shard_feed`) and a strategy's ledgers (`ledgers`). Entry: `per_worker`.
"""
