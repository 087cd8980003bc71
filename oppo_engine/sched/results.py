"""What ``RolloutEngine.step()`` returns: scored rollouts, and the step's result with its metrics."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from oppo_engine.obs import StepMetrics
from oppo_engine.sched.sequence import Sequence


@dataclass(slots=True)
class Rollout:
    """One scored rollout. ``logprobs[i]``, ``policy_versions[i]``, ``ref_logprobs[i]`` and ``values[i]``
    belong to ``response_ids[i]``.

    ``logprobs`` are the behaviour log-probs (of the distribution the token was drawn from, after
    temperature, top-k and top-p); ``ref_logprobs`` the reference model's (logits over the temperature, no
    truncation; None without a reference); ``values`` the critic's value of the state before each token
    (None without a critic).
    """

    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    reward: float
    policy_versions: list[int]
    deferred_steps: int
    ref_logprobs: list[float] | None = None
    values: list[float] | None = None
    group_id: int = 0
    sample_index: int = 0
    finish_reason: str = "length"  # "eos" | "stop" | "length" | "max_model_len" | "error"
    error: str | None = None  # the failure's message when finish_reason == "error"

    @classmethod
    def of(cls, seq: Sequence, error: str | None = None) -> Rollout:
        """``seq`` as a returned rollout; with ``error``, a quarantined one (NaN reward, no scores)."""
        return cls(
            prompt_ids=list(seq.prompt_ids),
            response_ids=list(seq.response_ids),
            logprobs=list(seq.logprobs),
            reward=math.nan if error is not None else float(seq.reward),
            policy_versions=list(seq.policy_versions),
            deferred_steps=seq.deferred_steps,
            ref_logprobs=None if error is not None else seq.ref_logprobs,
            values=None if error is not None else seq.values,
            group_id=seq.group_id,
            sample_index=seq.sample_index,
            finish_reason="error" if error is not None else seq.finish_reason or "length",
            error=error,
        )


@dataclass(slots=True)
class StepResult:
    """The rollouts of one ``step()`` in finish order, and what the step measured. ``failed`` holds the
    quarantined rollouts: whole groups whose forward or reward failed alone (``finish_reason="error"``,
    ``error`` the message, NaN reward), never counted among the B."""

    rollouts: list[Rollout]
    metrics: StepMetrics
    failed: list[Rollout] = field(default_factory=list)
