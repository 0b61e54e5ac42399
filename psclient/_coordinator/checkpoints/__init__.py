"""Strategy checkpoints: the directory, commit and restore (`checkpoint`), each ps's part of a
checkpoint (`checkpoint_parts`), the snapshot taken on each ps in a cut (`checkpoint_snapshot`) and
its write while training goes on (`checkpoint_writer`), and the dynamic tables' shards in it
(`table_checkpoint`). Entry: `checkpoint`.
"""
