"""PPO hyper-parameters (InstructGPT / TRL defaults, scaled for small models)."""

from __future__ import annotations

from dataclasses import dataclass

OFF_POLICY_CORRECTIONS = ("recompute", "truncated_is")


@dataclass(slots=True)
class PPOConfig:
    """One PPO step = one ``engine.step()`` of ``batch_size`` rollouts, then ``epochs`` passes over them in
    minibatches of ``minibatch_size``.

    Rewards: the reward model's score at the last response token minus ``kl_coef`` times the per-token KL
    estimate ``log pi_old - log pi_ref`` at every token. Advantages: GAE(``gamma``, ``lam``) over the
    critic's values, whitened over the batch. Losses: PPO's clipped surrogate (``clip_range``) and the
    clipped value loss (``clip_range_value``), weighted ``value_coef``; AdamW at ``lr`` /
    ``critic_lr``, gradients clipped to ``max_grad_norm``.

    Tokens sampled by an older policy (deferred sequences under overcommit): ``off_policy="recompute"``
    (default) replaces their old log-probs with the current actor's before the update, so the PPO ratio
    starts at 1 as in on-policy PPO; ``"truncated_is"`` keeps the behaviour log-probs and truncates the
    importance ratio ``pi_theta / pi_behaviour`` at ``is_truncation`` (no extra forward; a stale token
    cannot dominate the update). ``release_memory`` frees the engine's KV arena during the update.
    ``group_by_length`` puts rows of similar length in one minibatch (the minibatches in random order):
    each is padded only to its own longest row, which saves most of the update under long-tailed lengths.
    """

    batch_size: int = 16
    minibatch_size: int = 8
    epochs: int = 2
    lr: float = 1e-4
    critic_lr: float = 1e-4
    kl_coef: float = 0.05
    gamma: float = 1.0
    lam: float = 0.95
    clip_range: float = 0.2
    clip_range_value: float = 0.2
    value_coef: float = 0.1
    max_grad_norm: float = 1.0
    whiten_advantages: bool = True
    temperature: float = 1.0
    max_new_tokens: int = 48
    off_policy: str = "recompute"
    is_truncation: float = 2.0
    release_memory: bool = False
    seed: int = 0
    group_by_length: bool = False

    def __post_init__(self) -> None:
        positive = ("batch_size", "minibatch_size", "epochs", "max_new_tokens")
        for name in positive:
            if not (isinstance(getattr(self, name), int) and getattr(self, name) >= 1):
                raise ValueError(f"PPOConfig.{name} must be an int >= 1, got {getattr(self, name)!r}")
        if self.batch_size % self.minibatch_size:
            raise ValueError(
                f"PPOConfig.minibatch_size={self.minibatch_size} must divide batch_size={self.batch_size}"
            )
        for name in ("lr", "critic_lr", "clip_range", "clip_range_value", "max_grad_norm", "temperature"):
            if not getattr(self, name) > 0:
                raise ValueError(f"PPOConfig.{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("kl_coef", "value_coef"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"PPOConfig.{name} must be >= 0, got {getattr(self, name)!r}")
        for name in ("gamma", "lam"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"PPOConfig.{name} must be in [0, 1], got {getattr(self, name)!r}")
        if self.off_policy not in OFF_POLICY_CORRECTIONS:
            raise ValueError(
                f"PPOConfig.off_policy must be one of {OFF_POLICY_CORRECTIONS}, got {self.off_policy!r}"
            )
        if not self.is_truncation >= 1:
            raise ValueError(f"PPOConfig.is_truncation must be >= 1, got {self.is_truncation!r}")
