"""What a training step does on the ps beyond the user's ops: optimizer updates on the variable's ps
(`updates`), the rule for model versions (`sync`: tickets, `max_staleness`, `replicas_to_aggregate`)
and its accumulators (`accumulators`). Entry: `sync`.
"""
