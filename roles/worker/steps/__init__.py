"""A stage's optimizer step and the rules that say when the replicas take it [report 3.2, 3.3.1]:
which step each sample joins, when a step is complete, and how the replicas agree on it. These are
rules and records, driven by the compute thread (roles/worker/serving/runtime.py) and never driving
it: nothing here imports the serving room (tests/unit/test_layers.py).

    optimizer.py          gradient accumulation, stage-wise clipping and the CPU-offloaded AdamW step
    step_ledger.py        step boundaries: which global step a sample belongs to, when a step is due
    step_tagger.py        the one tail replica per step that hands out step tags, and its cursor
    gradient_exchange.py  the replicas' sum of their gradients before every step
    progress.py           the stage's progress records in the DHT, fed to the step ledger
"""
