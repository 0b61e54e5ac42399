"""What leaves the cluster for serving: a snapshot of a dynamic table in stock TF (`serving_table`) and
the delta versions written by the ps tasks (`delta_cut`). Entry: `delta_cut`.
"""
