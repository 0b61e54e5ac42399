"""Strategy checkpoints: the directory, commit and restore (`checkpoint`), each ps's part of a
checkpoint (`checkpoint_parts`), the snapshot taken in a cut and its write (`checkpoint_snapshot`),
the thread that writes while training goes on (`checkpoint_writer`) and the dynamic tables'
shards in it (`table_checkpoint`). Entry: `checkpoint`.
"""
