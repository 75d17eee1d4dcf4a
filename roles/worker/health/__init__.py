"""When a worker should stop serving its stage, and what it watches to know [report 3.3.1.6,
3.5.3.1]. The lowest room of the worker: it imports none of the others (tests/unit/test_layers.py),
so averaging, SparseLoCo and the role can all report to it.

    termination.py    the self-termination rules and the evaluator that decides when one fires
    round_health.py   the averaging self-protection rule: two failed rounds out of the last three
    connectivity.py   whether any peer still answers: the connectivity rule's signal
    preemption.py     an operator's preemption order, read from the DHT, and the switch it arms
"""
