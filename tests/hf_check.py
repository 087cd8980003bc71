"""The exactness check the multi-turn and serve tests share: a rollout's (or a response's) behaviour log-probs
equal one HF forward over its whole transcript."""

from __future__ import annotations

import pytest
import torch


def hf_logprobs(model, token_ids: list[int]) -> torch.Tensor:
    """``[len(token_ids), vocab]`` log-softmax of ``model``'s logits over ``token_ids`` (fp32)."""
    with torch.inference_mode():
        logits = model(torch.tensor([token_ids])).logits[0].float()
    return logits.log_softmax(-1)


def assert_logprobs_equal_hf(
    model, prompt_ids: list[int], response_ids: list[int], logprobs: list[float], action_mask=None, *,
    abs: float = 1e-5,
) -> None:  # fmt: skip
    """Each sampled token's log-prob (``action_mask`` 1; all of them without a mask) equals ``model``'s over
    the transcript within ``abs``; a token not sampled (mask 0: a template or tool token) has 0.0."""
    logp = hf_logprobs(model, list(prompt_ids) + list(response_ids))
    p = len(prompt_ids)
    mask = [1] * len(response_ids) if action_mask is None else action_mask
    for i, (tok, sampled) in enumerate(zip(response_ids, mask, strict=True)):
        if sampled:
            assert logprobs[i] == pytest.approx(logp[p - 1 + i, tok].item(), abs=abs), i
        else:
            assert logprobs[i] == 0.0, i
