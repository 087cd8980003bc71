"""oppo_engine: a rollout backend for PPO-RLHF that overlaps generation with scoring (OPPO, ICLR 2026).

Public API: ``RolloutEngine``, ``EngineConfig``, ``SamplingParams``, ``BatchedReward``, for multi-turn
episodes ``Env``, ``Observation`` and ``ToolEnv``, and ``load_pretrained`` for real checkpoints (see
docs/api/, docs/multi-turn.md, docs/models-and-inputs.md and DESIGN.md). They are imported lazily,
so ``import oppo_engine.ops`` (or ``.cache``) does not pull in transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "BatchedReward": "oppo_engine.model.rewards",
    "Env": "oppo_engine.env.protocol",
    "Observation": "oppo_engine.env.protocol",
    "ToolEnv": "oppo_engine.env.tools",
    "EngineConfig": "oppo_engine.config",
    "SamplingParams": "oppo_engine.config",
    "RolloutEngine": "oppo_engine.engine",
    "Rollout": "oppo_engine.sched.results",
    "StepResult": "oppo_engine.sched.results",
    "CacheStats": "oppo_engine.cache.stats",
    "StepMetrics": "oppo_engine.obs.metrics",
    "load_pretrained": "oppo_engine.pretrained",
}
__all__ = [
    "BatchedReward",
    "CacheStats",
    "EngineConfig",
    "Env",
    "Observation",
    "Rollout",
    "RolloutEngine",
    "SamplingParams",
    "StepMetrics",
    "StepResult",
    "ToolEnv",
    "load_pretrained",
]

if TYPE_CHECKING:
    from oppo_engine.cache.stats import CacheStats
    from oppo_engine.config import EngineConfig, SamplingParams
    from oppo_engine.engine import RolloutEngine
    from oppo_engine.env.protocol import Env, Observation
    from oppo_engine.env.tools import ToolEnv
    from oppo_engine.model.rewards import BatchedReward
    from oppo_engine.obs.metrics import StepMetrics
    from oppo_engine.pretrained import load_pretrained
    from oppo_engine.sched.results import Rollout, StepResult


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'oppo_engine' has no attribute {name!r}")
