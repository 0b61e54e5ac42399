"""Strategy checkpoints: the directory, commit and restore (`checkpoint`), each ps's part of a
checkpoint (`checkpoint_parts`; its calls on every ps at once, given up on a ps that stops answering:
`ps_calls`), the snapshot taken on each ps in a cut (`checkpoint_snapshot`) and
its write while training goes on (`checkpoint_writer`), the dynamic tables' shards in it
(`table_checkpoint`), and what is copied before the cut, training going on (`fuzzy_copy`; the
dynamic tables' shards: `table_copy`, `hash_copy`). Entry: `checkpoint`.
"""
