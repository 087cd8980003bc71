"""Deprecated: the PPO trainer's rank helpers are now ``oppo_engine.ppo.ranks`` (beside the package
``oppo_engine.distributed``, one name for two things confused readers). This alias stays for one release
and warns when imported."""

from __future__ import annotations

import warnings

from oppo_engine.ppo.ranks import *  # noqa: F403
from oppo_engine.ppo.ranks import __all__  # noqa: F401

warnings.warn(
    "oppo_engine.ppo.distributed is renamed oppo_engine.ppo.ranks; the old name goes in the next release",
    FutureWarning,
    stacklevel=2,
)
