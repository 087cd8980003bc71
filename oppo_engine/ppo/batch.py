"""Rollouts from the engine as padded training tensors.

Every per-token tensor is ``[N, L - 1]`` and aligned to the position that *predicts* a token: column ``p``
belongs to ``input_ids[:, p + 1]``. A response token ``response_ids[i]`` of a rollout with a prompt of
``P`` tokens sits at column ``P - 1 + i``; ``mask`` marks those columns where the token was sampled
(``Rollout.action_mask``): the observation tokens of a multi-turn episode are inputs, never trained on.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from oppo_engine.sched.results import Rollout


@dataclass(slots=True)
class RolloutBatch:
    input_ids: torch.Tensor  # [N, L] prompt + response, right-padded
    attention_mask: torch.Tensor  # [N, L]
    mask: torch.Tensor  # [N, L-1] float: 1 at the columns of sampled response tokens (0 at observations)
    logprobs: torch.Tensor  # [N, L-1] behaviour log-probs from the engine
    ref_logprobs: torch.Tensor  # [N, L-1]
    values: torch.Tensor  # [N, L-1] critic values streamed by the engine
    versions: torch.Tensor  # [N, L-1] int64 policy version that sampled each token (-1 elsewhere)
    scores: torch.Tensor  # [N] reward model scores
    carried: torch.Tensor  # [N] bool: the sequence was carried over at least one step (deferred)

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def select(self, idx: torch.Tensor) -> RolloutBatch:
        """The rows ``idx`` (a minibatch)."""
        return RolloutBatch(*(getattr(self, f).index_select(0, idx) for f in self.__slots__))

    def trim(self, width: int) -> RolloutBatch:
        """The first ``width`` columns (``width - 1`` per token): right padding beyond the longest row is
        dropped, which changes nothing a causal model computes for the other columns."""

        def cut(f: str) -> torch.Tensor:
            t = getattr(self, f)
            if t.dim() == 1:  # per row
                return t
            return t[:, : width if f in ("input_ids", "attention_mask") else width - 1]

        return RolloutBatch(*map(cut, self.__slots__))


def canonical_order(rollouts: Sequence[Rollout]) -> list[Rollout]:
    """The rollouts sorted by their tokens: an update must not depend on the order sequences finished in
    (which differs between engine modes)."""
    return sorted(rollouts, key=lambda r: (r.prompt_ids, r.response_ids))


def collate(rollouts: Sequence[Rollout], pad_token_id: int, device: torch.device | str) -> RolloutBatch:
    """Pad ``rollouts`` (which must carry ``ref_logprobs`` and ``values``) into one ``RolloutBatch``."""
    if any(r.ref_logprobs is None or r.values is None for r in rollouts):
        raise ValueError("collate: every rollout needs ref_logprobs and values (engine built without them?)")
    n = len(rollouts)
    length = max(len(r.prompt_ids) + len(r.response_ids) for r in rollouts)
    input_ids = torch.full((n, length), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((n, length), dtype=torch.long)
    per_token = {
        name: torch.zeros((n, length - 1)) for name in ("mask", "logprobs", "ref_logprobs", "values")
    }
    versions = torch.full((n, length - 1), -1, dtype=torch.long)
    for i, r in enumerate(rollouts):
        p, t = len(r.prompt_ids), len(r.response_ids)
        input_ids[i, : p + t] = torch.tensor(r.prompt_ids + r.response_ids)
        attention_mask[i, : p + t] = 1
        cols = slice(p - 1, p - 1 + t)
        per_token["mask"][i, cols] = torch.tensor(r.action_mask or [1] * t, dtype=torch.float32)
        per_token["logprobs"][i, cols] = torch.tensor(r.logprobs)
        per_token["ref_logprobs"][i, cols] = torch.tensor(r.ref_logprobs)
        per_token["values"][i, cols] = torch.tensor(r.values)
        versions[i, cols] = torch.tensor(r.policy_versions)
    scores = torch.tensor([r.reward for r in rollouts], dtype=torch.float32)
    carried = torch.tensor([r.deferred_steps > 0 for r in rollouts], dtype=torch.bool)
    return RolloutBatch(
        input_ids.to(device),
        attention_mask.to(device),
        versions=versions.to(device),
        scores=scores.to(device),
        carried=carried.to(device),
        **{k: v.to(device) for k, v in per_token.items()},
    )
