"""AsyncSPARTA averaging within a stage [report 4.2, 4.2.2, 3.3.1.7-3.3.1.8].

    index_sets.py  the seeded segments that tile that vector, one per round, with their digests
    allreduce.py   hivemind's butterfly all-reduce, instrumented to see partial rounds (child side)
    averager.py    the averager process over a fixed-size round buffer, and its host-side handle
    rounds.py      one round: snapshot, all-reduce, delta-rule apply, and what happened
    health.py      the self-protection rule: two failed rounds out of the last three
    service.py     when rounds run, with whom, at what weight, and how they are reported
"""
