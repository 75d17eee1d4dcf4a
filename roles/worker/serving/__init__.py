"""What a worker serves: requests in over `agora/v1/*`, batches through the stage model on the
compute thread, results back, and the replicas of a stage talking to each other directly
[report 3.3.1.2-3.3.1.4]. It builds on the step room (roles/worker/steps/) and is built on by the
role and SparseLoCo; the state and health rooms never import it (tests/unit/test_layers.py).

    runtime.py           the compute loop: owns the model, optimizer, queues and ledger, runs batches
    request_checks.py    the checks every request passes before it is queued
    step_decision.py     when the compute thread takes the stage's step, between two batches
    batches.py           what one forward or backward batch does to the stage model
    compute_stats.py     what the compute thread records: forwards in flight, staleness, balance, fingerprints
    queues.py            task queues and batch coalescing between the handlers and the compute thread
    kept_activations.py  forward activations kept for the backward within a memory budget
    handlers.py          the `agora/v1/*` handlers: parse, validate, queue, await, reply
    retractions.py       a sample taken back out of a step still open here: `agora/v1/retract`
    chain.py             worker-to-worker routing: the `agora/v1/chain` handler
    chain_signatures.py  the neighbours' signatures a chained worker checks before it uses what they sent
    hop_records.py       what a worker keeps of its chained samples for the trainers' checks: `agora/v1/hop_record`
    replicas.py          the replicas' direct RPCs: step tags and the gradient exchange, wired into the runtime
"""
