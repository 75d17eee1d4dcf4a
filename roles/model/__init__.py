"""The stage model: the subspace-reparameterized decoder cut into stages, and the memory plan a
worker sizes itself with [report 4.1]. The run config it is built from is a wire contract and
lives in protocol/run_config.py; it is re-exported here for convenience.

Config and memory planning import without torch, so the authorizer and CLI stay light; the torch
parts (`StageModel`, `FullModel`, the subspace helpers) load on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from protocol.run_config import (
    ModelConfig,
    OptimizerConfig,
    RunConfig,
    StageRange,
    dump_run_config,
    load_run_config,
)
from roles.model.memory_plan import MemoryPlan, plan_memory
from protocol.run_presets import PRESETS

_LAZY = {
    "StageModel": "roles.model.stage",
    "FullModel": "roles.model.stage",
    "build_stage_model": "roles.model.stage",
    "SurrogateStage": "roles.model.surrogate",
    "subspace_basis": "roles.model.subspace",
    "fixed_token_embedding": "roles.model.subspace",
    "compress": "roles.model.subspace",
    "reconstruct": "roles.model.subspace",
}

__all__ = [
    "ModelConfig",
    "OptimizerConfig",
    "RunConfig",
    "StageRange",
    "dump_run_config",
    "load_run_config",
    "MemoryPlan",
    "plan_memory",
    "PRESETS",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
