"""The warning a PPO loop must not miss: a returned batch every token of which an older policy sampled."""

from __future__ import annotations

import warnings


class StaleBatchWarning:
    """Warns (Python ``warnings``, once per engine) the first time a returned batch is entirely stale: every
    token in it was sampled by an older policy than the current one, so ``Rollout.logprobs`` are not the
    current policy's and a loop that takes them as the old log-probs clips its gradient away."""

    def __init__(self) -> None:
        self.warned = False

    def check(self, stale_tokens: int, batch) -> None:
        """Called once per step with the batch's stale tokens and its sequences (their sampled tokens count;
        observation tokens, policy version -1, do not)."""
        batch_tokens = sum(v >= 0 for s in batch for v in s.policy_versions)
        if self.warned or batch_tokens == 0 or stale_tokens < batch_tokens:
            return
        self.warned = True
        warnings.warn(
            f"this step returned a batch whose {batch_tokens} tokens were all sampled by an older policy "
            "(StepMetrics.stale_tokens): recompute the old log-probs with the current policy or weight by "
            "Rollout.policy_versions; lower EngineConfig.max_policy_lag or overcommit to bound it",
            stacklevel=3,
        )
