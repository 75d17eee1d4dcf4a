"""A stage's state on its way in and out of a worker: served to joiners, downloaded from donors,
written to and read from checkpoints, and the joiner's catch-up phases [report 3.3.1.1, 5.6].
It builds only on the worker's own base (layout.py, errors.py), never on the serving or step rooms
(tests/unit/test_layers.py): state moves as bytes and flat tensors, not as requests.

    state_snapshot.py     a stage's state frozen as one canonical byte string, chunked and hashed
    state_donor.py        a worker as a donor: `agora/v1/state_manifest` and `agora/v1/state_chunk`
    state_download.py     a joiner's multi-donor download of one snapshot, chunk by chunk
    donor_client.py       a joiner's side of the donors' RPCs: pick the state, fetch it, apply it
    state_server.py       `agora/v1/state`: this replica's parameters, in chunks, to a joiner
    state_loader.py       the `agora/v1/state` client: the fallback when no donor serves a snapshot
    stage_checkpoint.py   stage checkpoints in a directory, written by designated nodes
    run_checkpoint_io.py  a worker's part in run checkpoints: write at agreed steps, load from the store
    sync_phase.py         a joiner's catch-up: weight sync, then optimizer sync, then full participation
    joining.py            the join: the state sources in order (donors, peers, checkpoint, store, seed)
"""
