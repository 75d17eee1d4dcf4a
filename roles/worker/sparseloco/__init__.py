"""SparseLoCo within a stage: an alternative to AsyncSPARTA (`averaging.method:
sparseloco`). Every replica steps on its own samples; every H steps it sends the largest coordinates
of its error-fed pseudo-gradient, two bits each, and every replica applies the mean of what arrived.

    chunks.py     which coordinates form a chunk (never across a tensor) and a fragment
    codec.py      top-k per chunk, b-bit quantisation with a scale per chunk, the signed wire form
    outer.py      the consensus anchor, the error-feedback buffer and the outer step
    transport.py  how fragments travel: pushed over the swarm's streams, or through an object store
    evidence.py   a poisoned fragment as evidence the authorizer checks, and the replica reporting it
    service.py    when a fragment is captured, exchanged and applied, and what is reported
    endpoint.py   the transport on the swarm: the fragment handler and the push to each replica
    lifecycle.py  a worker's SparseLoCo from start to stop: built, announced, started, reloaded

It builds on the health room (the averaging rule's window), the steps room and the serving room
(the replicas' streams), never on state (tests/unit/test_layers.py): a reload of the stage's state
comes in as a callable from the role.
"""
