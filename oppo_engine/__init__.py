"""oppo_engine: a rollout backend for PPO-RLHF that overlaps generation with scoring (OPPO, ICLR 2026)."""
