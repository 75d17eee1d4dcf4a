"""Protocol and client versions, and the handler names every role registers or calls."""

from __future__ import annotations

PROTOCOL_VERSION = 2
"""Bumped only for changes an older node cannot ignore; new optional fields do not bump it."""

SUPPORTED_PROTOCOL_VERSIONS = frozenset({2})

HANDLER_PREFIX = "agora/v1/"
FORWARD = HANDLER_PREFIX + "forward"
BACKWARD = HANDLER_PREFIX + "backward"
INFO = HANDLER_PREFIX + "info"
CHAIN = HANDLER_PREFIX + "chain"
"""A training sample routed worker to worker (protocol/messages.py ChainRequest, roles/worker/serving/chain.py)."""
HOP_RECORD = HANDLER_PREFIX + "hop_record"
"""What a worker kept of a chained sample, asked by the sample's trainer for a spot check of the
worker before or after it (roles/worker/serving/hop_records.py)."""
STATE = HANDLER_PREFIX + "state"
"""A stage replica's parameters, served in chunks to a joining worker [report 3.3.1.1]; the
fallback for donors without STATE_MANIFEST."""
WEIGHTS = HANDLER_PREFIX + "weights"
"""The parameters a worker computed with at one weight version, in chunks, for a trainer that
re-executes a disputed hop itself (roles/worker/serving/weights_server.py)."""
STATE_MANIFEST = HANDLER_PREFIX + "state_manifest"
"""A donor's manifest of one frozen snapshot of its stage state (parameters and optimizer state):
fixed-size chunks, each with its SHA-256."""
STATE_CHUNK = HANDLER_PREFIX + "state_chunk"
"""One chunk of a snapshot a donor published with STATE_MANIFEST."""
ABANDON = HANDLER_PREFIX + "abandon"
"""A trainer tells a stage that a sample tagged with a step will not reach it (it was dropped
below a failed stage), so the stage closes that step without waiting for it."""
RETRACT = HANDLER_PREFIX + "retract"
"""A trainer takes back a sample of a step still open at a stage: the stage recomputes the sample's
parameter gradient and subtracts it (roles/worker/serving/retractions.py), after the trainer
excluded a worker the sample went through (roles/trainer/retraction.py)."""
TAGS = HANDLER_PREFIX + "tags"
"""A tail replica asks the stage's tagger for the step tags of the samples it is about to compute."""
STEP_COUNTS = HANDLER_PREFIX + "step_counts"
"""A replica's sample counts, pushed to the other replicas of its stage on every change."""
STEP_GRADIENTS = HANDLER_PREFIX + "step_gradients"
"""A replica's gradient sum for one step, pushed to the other replicas of its stage before it steps."""
SPARSELOCO_FRAGMENT = HANDLER_PREFIX + "sparseloco_fragment"
"""A replica's signed, compressed pseudo-gradient fragment for one SparseLoCo round, pushed to the
other replicas of its stage (roles/worker/sparseloco/transport.py)."""
EVALUATE = HANDLER_PREFIX + "evaluate"
"""A held-out sample's forward through one stage, for the run's evaluation: no gradient, no step
tag, nothing counted towards a step (roles/trainer/evaluation.py)."""
RELAY_HELLO = HANDLER_PREFIX + "relay_hello"
"""A node shows one of the run's relays its credential, so the relay keeps its connection (and
the reservation or circuits on it) instead of dropping it as an outsider's (roles/relay/)."""


def client_version() -> str:
    """The installed agora-node version, or 0.0.0 when running from an uninstalled tree."""
    try:
        from importlib.metadata import version

        return version("agora-node")
    except Exception:  # noqa: BLE001 - metadata missing is not an error worth surfacing
        return "0.0.0"
