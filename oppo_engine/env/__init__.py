"""Environments of multi-turn episodes: the ``Env`` protocol and its ``Observation``, the text-level
``ToolEnv``, and the worker pool that runs environment calls off the actor lane (docs/multi-turn.md)."""

from oppo_engine.env.protocol import Env, Observation
from oppo_engine.env.tools import ToolEnv

__all__ = ["Env", "Observation", "ToolEnv"]
