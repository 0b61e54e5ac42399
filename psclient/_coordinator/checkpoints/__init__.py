"""Strategy checkpoints: the directory, commit and restore (`checkpoint`), each ps's part of a
checkpoint (`checkpoint_parts`) and the dynamic tables' shards in it (`table_checkpoint`). Entry:
`checkpoint`.
"""
