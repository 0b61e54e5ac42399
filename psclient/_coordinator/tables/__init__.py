"""Dynamic embedding tables on the ps tasks: the table (`dynamic_tables`), one shard's storage
(`dense_shard`, `key_index`, `key_hash`) and one admission and update per ps for a step's tables
(`fused_admission`). Entry: `dynamic_tables`.
"""
