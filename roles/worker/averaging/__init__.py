"""AsyncSPARTA averaging within a stage [report 4.2, 4.2.2, 3.3.1.7-3.3.1.8]. The flat
parameter layout it works on is roles/worker/layout.py; the self-protection rule its rounds feed
is roles/worker/health/round_health.py. It imports the health room and the worker's base only,
never serving, steps or state (tests/unit/test_layers.py).

    index_sets.py  the seeded segments that tile that vector, one per round, with their digests
    access.py      who may average with a replica: a credentialed worker of the same stage
    screening.py   which parts a reducer leaves out, so one garbage sender cannot poison a round
    allreduce.py   hivemind's butterfly all-reduce, instrumented to see partial rounds (child side)
    averager.py    the averager process over a fixed-size round buffer, and its host-side handle
    rounds.py      one round: snapshot, all-reduce, delta-rule apply, and what happened
    schedule.py    when a round is due: every N stage steps, or on a clock in an idle stage
    election.py    which workers reduce when too few were started with `--reducer`
    divergence.py  whether this replica is the stage's outlier, from the rounds' published distances
    stage_view.py  the stage as the DHT shows it before a round, and why a replica skips one
    service.py     with whom a round runs, at what weight, and how it is reported
    round_verdicts.py  what a finished round tells: counts, log, self-protection, divergence, digests
    evidence.py    a part refused for its norm as evidence for the authorizer, and its reporter
"""
