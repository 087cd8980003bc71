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

    Multi-turn episodes (docs/multi-turn.md): ``response_ids`` is the whole transcript after the prompt --
    turns sampled by the actor and the environment's observations between them. ``action_mask[i]`` is 1
    where ``response_ids[i]`` was sampled and 0 where it is an observation token (all ones without an
    environment); at observation tokens ``logprobs`` hold 0.0 and ``policy_versions`` -1 (no policy
    sampled them), while ``ref_logprobs`` and ``values`` are the scorers' as at any token (they read the
    whole transcript). ``turns`` lists each turn's ``(start, end)`` range of ``response_ids`` (one turn,
    the whole response, without an environment); ``truncated_observations`` counts observations cut to
    ``SamplingParams.max_observation_tokens``. ``reward`` is the environment's when its last observation
    gave one, else the reward model's or function's over the whole transcript.
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
    # "eos" | "stop" | "length" | "max_model_len" | "env_done" | "max_turns" | "error"
    finish_reason: str = "length"
    error: str | None = None  # the failure's message when finish_reason == "error"
    action_mask: list[int] = field(default_factory=list)
    turns: list[tuple[int, int]] = field(default_factory=list)
    truncated_observations: int = 0

    @classmethod
    def of(cls, seq: Sequence, error: str | None = None) -> Rollout:
        """``seq`` as a returned rollout; with ``error``, a quarantined one (NaN reward, no scores)."""
        n = len(seq.response_ids)
        episode = seq.episode
        return cls(
            prompt_ids=list(seq.prompt_ids),
            response_ids=list(seq.response_ids),
            logprobs=list(seq.logprobs),
            reward=math.nan if error is not None else float(seq.final_reward),
            policy_versions=list(seq.policy_versions),
            deferred_steps=seq.deferred_steps,
            ref_logprobs=None if error is not None else seq.ref_logprobs,
            values=None if error is not None else seq.values,
            group_id=seq.group_id,
            sample_index=seq.sample_index,
            finish_reason="error" if error is not None else seq.finish_reason or "length",
            error=error,
            action_mask=[1] * n if episode is None else episode.action_mask(n),
            turns=([(0, n)] if n else []) if episode is None else episode.all_turns(n),
            truncated_observations=0 if episode is None else episode.truncated,
        )

    @classmethod
    def failed_unstarted(cls, prompt_ids: list[int], error: str, group_id: int, sample_index: int) -> Rollout:
        """A failed rollout of an episode that never had a sequence (a served agent that raised before its
        group's first requests were all in): no tokens, NaN reward; ``prompt_ids`` its first request's, or
        empty."""
        return cls(
            prompt_ids=list(prompt_ids), response_ids=[], logprobs=[], reward=math.nan, policy_versions=[],
            deferred_steps=0, group_id=group_id, sample_index=sample_index, finish_reason="error",
            error=error,
        )  # fmt: skip


@dataclass(slots=True)
class StepResult:
    """The rollouts of one ``step()`` in finish order, and what the step measured. ``failed`` holds the
    quarantined rollouts: whole groups whose forward or reward failed alone (``finish_reason="error"``,
    ``error`` the message, NaN reward), never counted among the B."""

    rollouts: list[Rollout]
    metrics: StepMetrics
    failed: list[Rollout] = field(default_factory=list)
