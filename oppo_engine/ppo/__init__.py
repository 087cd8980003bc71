"""A compact reference PPO trainer on the rollout engine (the engine's first client), and the embedded
demo task it is shown on."""

from oppo_engine.ppo.config import PPOConfig
from oppo_engine.ppo.trainer import PPOStepStats, PPOTrainer, engine_config_for

__all__ = ["PPOConfig", "PPOStepStats", "PPOTrainer", "engine_config_for"]
