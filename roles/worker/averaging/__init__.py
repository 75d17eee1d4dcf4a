"""AsyncSPARTA averaging within a stage [report 4.2, 4.2.2, 3.3.1.7-3.3.1.8]. The flat
parameter layout it works on is roles/worker/layout.py.

    index_sets.py  the seeded segments that tile that vector, one per round, with their digests
    allreduce.py   hivemind's butterfly all-reduce, instrumented to see partial rounds (child side)
    averager.py    the averager process over a fixed-size round buffer, and its host-side handle
    rounds.py      one round: snapshot, all-reduce, delta-rule apply, and what happened
    health.py      the self-protection rule: two failed rounds out of the last three
    schedule.py    when a round is due: every N stage steps, or on a clock in an idle stage
    service.py     with whom a round runs, at what weight, and how it is reported
"""
