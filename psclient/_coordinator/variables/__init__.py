"""Variables on the ps tasks: how they are split into shards (`sharding`) and where their initial
values are made (`initial_values`). Entry: `sharding`.
"""
