"""PPO hyper-parameters (InstructGPT / TRL defaults, scaled for small models)."""

from __future__ import annotations

from dataclasses import dataclass

OFF_POLICY_CORRECTIONS = ("recompute", "truncated_is")
ROLLOUT_CORRECTIONS = (None, "tis", "mis")
ROLLOUT_CORRECTION_LEVELS = ("token", "sequence")
ON_NONFINITE = ("raise", "skip")
PACK_ATTENTION = ("auto", "dense", "batched")


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

    ``max_tokens_per_microbatch`` (``None``: one padded forward per minibatch) splits each minibatch into
    padding-free packs of at most this many tokens whose gradients accumulate into the minibatch's one
    optimizer step (``ppo/packing.py``); it must hold the longest sequence a step can return.
    ``pack_attention`` says how a pack's attention runs: ``"batched"`` as causal sdpa calls over its
    sequences, bucketed by length, each bucket gathered into a right-padded batch (``ppo/pack_attention.py``:
    about each sequence's own square, not the pack's; packs then hold sequences of similar length), or
    ``ValueError`` at build naming why a model cannot; ``"dense"`` over transformers' ``T x T``
    block-diagonal mask; ``"auto"`` (default) batched for each model whose build-time probe passes, dense for
    the other. Only with ``max_tokens_per_microbatch``.

    ``share_prefix`` computes a minibatch's longest common prompt prefix once and runs each row's rest over
    its KV cache (``ppo/prefix.py``; the padded forward's results to rounding, and the prefix's share of the
    arithmetic saved): ``"auto"`` (default) where a probe at build shows the models give the same over a
    cache as over whole rows, one process, padded minibatches; ``True`` the same, or ``ValueError`` at build
    naming the reason; ``False`` never.

    ``measure_agreement`` runs one no-grad forward of the actor before the first optimizer step and
    reports the gap between its log-probs and the engine's (``PPOStepStats.agreement``).
    ``rollout_correction`` corrects that gap: ``"tis"`` (truncated importance sampling, Yao et al. 2025,
    "Your efficient RL framework secretly brings you off-policy RL training") scales each token's policy
    loss by ``min(pi_trainer / pi_behaviour, rollout_correction_cap)``; ``"mis"`` (masked importance
    sampling, Liu et al. 2025, "When speed kills stability: demystifying RL collapse from the
    training-inference mismatch") drops the tokens whose ratio leaves ``[1/cap, cap]`` from the loss (its
    denominator kept); ``rollout_correction_level="sequence"`` takes the ratio ``exp(sum of the log-ratio)``
    over each sequence. With a correction the PPO ratio is taken against the trainer's own log-probs.

    ``on_nonfinite``: a minibatch whose loss or gradient norm is not finite is never stepped: ``"raise"``
    (a ``RuntimeError``) or ``"skip"`` (skipped, warned and counted in ``PPOStepStats.skipped_minibatches``).
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
    max_tokens_per_microbatch: int | None = None
    pack_attention: str = "auto"
    share_prefix: bool | str = "auto"
    measure_agreement: bool = True
    rollout_correction: str | None = None
    rollout_correction_cap: float = 2.0
    rollout_correction_level: str = "token"
    on_nonfinite: str = "raise"

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
        budget = self.max_tokens_per_microbatch
        if budget is not None and not (isinstance(budget, int) and budget >= 2):
            raise ValueError(
                f"PPOConfig.max_tokens_per_microbatch must be None or an int >= 2, got {budget!r}"
            )
        if self.pack_attention not in PACK_ATTENTION:
            raise ValueError(
                f"PPOConfig.pack_attention must be one of {PACK_ATTENTION}, got {self.pack_attention!r}"
            )
        if self.pack_attention != "auto" and budget is None:
            raise ValueError(
                f"PPOConfig.pack_attention={self.pack_attention!r} is the attention of packs: set "
                "max_tokens_per_microbatch (or leave pack_attention='auto')"
            )
        if not (isinstance(self.share_prefix, bool) or self.share_prefix == "auto"):
            raise ValueError(
                f"PPOConfig.share_prefix must be True, False or 'auto', got {self.share_prefix!r}"
            )
        if self.share_prefix is True and budget is not None:
            raise ValueError(
                "PPOConfig.share_prefix=True shares a prefix across padded rows; with "
                "max_tokens_per_microbatch the update runs on packs: choose one"
            )
        if self.rollout_correction not in ROLLOUT_CORRECTIONS:
            raise ValueError(
                f"PPOConfig.rollout_correction must be one of {ROLLOUT_CORRECTIONS}, got "
                f"{self.rollout_correction!r}"
            )
        if self.rollout_correction_level not in ROLLOUT_CORRECTION_LEVELS:
            raise ValueError(
                f"PPOConfig.rollout_correction_level must be one of {ROLLOUT_CORRECTION_LEVELS}, got "
                f"{self.rollout_correction_level!r}"
            )
        if not self.rollout_correction_cap > 1:
            raise ValueError(
                f"PPOConfig.rollout_correction_cap must be > 1, got {self.rollout_correction_cap!r}"
            )
        if self.on_nonfinite not in ON_NONFINITE:
            raise ValueError(
                f"PPOConfig.on_nonfinite must be one of {ON_NONFINITE}, got {self.on_nonfinite!r}"
            )
