"""The framework-neutral sync core: NumPy buffers in, no torch or TensorFlow inside.

    registry.py      route registry (route, placement) -> synchronizer; SyncSet drives them
    base.py          Variable, GradAccess (the frontends' tensor <-> buffer side), SyncContext
    dense.py         all-reduce and sparse-as-dense      allgather.py   sparse all-gather
    ps_routes.py     parameter server, sharded and replicated placements
    table.py         PS table handles and batched pull/push rounds (the only engine caller)
    agreement.py     rank 0's plan, checked             planning.py    both frontends' planning steps
    server_rules.py  optimizer -> server rule            compression.py codecs by name
    accounting.py    bytes per variable per step
    auto.py          sync: auto -- measure the first steps, choose each sparse route once, switch
    cost_model.py    predicted step time of ps / allgather / allreduce-as-dense from measurements
"""
