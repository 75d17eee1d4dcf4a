"""Errors the worker role raises on purpose, below `protocol.errors.AgoraError`.

    AgoraError
    └── WorkerError
        ├── AveragingError       a round could not be set up or its result not applied
        ├── StateLoadError       no peer or checkpoint gave this worker its stage's parameters
        ├── CheckpointError      a checkpoint is missing, unreadable or belongs to another run/stage
        └── WorkerLeftStage      the worker's own rules made it leave the stage [report 3.3.1.6];
            │                    the node exits with the code its daemon maps this to (3)
            └── SelfTerminated   one named rule of roles/worker/health/termination.py fired; the node
                                 exits with that rule's code
"""

from __future__ import annotations

from protocol.errors import AgoraError


class WorkerError(AgoraError):
    """Base of the worker role's errors."""


class AveragingError(WorkerError):
    """An averaging round could not be prepared, or its result could not be applied."""


class StateLoadError(WorkerError):
    """Loading the stage's parameters from peers or from a checkpoint failed."""


class CheckpointError(WorkerError):
    """A checkpoint file is missing, unreadable, or does not match this run, stage or layout."""


class WorkerLeftStage(WorkerError):
    """Self-termination: the worker failed too many averaging rounds and left its stage.

    A replica that keeps missing rounds drifts from the stage consensus and harms convergence
    [report 3.3.1.6]; it may rejoin through the normal path and its sync phases.
    """


class SelfTerminated(WorkerLeftStage):
    """A self-termination rule fired (roles/worker/health/termination.py): the worker leaves its stage
    cleanly and the node exits with `exit_code`, the rule's documented code."""

    def __init__(self, rule: str, exit_code: int, message: str):
        super().__init__(message)
        self.rule = rule
        self.exit_code = exit_code
