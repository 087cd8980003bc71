"""Batch-invariant sampling: top-k / top-p truncation per row, then Gumbel-max with counter-based noise."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from oppo_engine import ops


def _truncate(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor):
    """Mask to -inf the tokens outside each row's top-k and top-p set (computed on ``logits / T``).

    Every operation is row-local, so a row's result never depends on the other rows of the batch.
    """
    scaled = logits / temperature.clamp_min(1e-6).unsqueeze(1)
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    rank = torch.arange(vocab, device=logits.device).unsqueeze(0)
    k = torch.where(top_k > 0, top_k, vocab).unsqueeze(1)
    drop = rank >= k
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    # A token stays while the mass before it is < top_p: the smallest set reaching top_p, at least one token.
    mass_before = probs.cumsum(dim=-1) - probs
    drop |= mass_before >= top_p.unsqueeze(1)
    drop_by_token = torch.zeros_like(drop).scatter(1, order, drop)
    return logits.masked_fill(drop_by_token, float("-inf"))


class Sampler:
    """Samples one token per row of ``logits [N, V]`` and returns its behaviour log-prob.

    ``temperature == 0`` is greedy (log-prob of the unscaled logits). Otherwise the token is drawn from
    ``softmax(truncated_logits / T)`` with noise keyed by (seed, position), and the log-prob is that of the
    truncated, tempered distribution -- the one PPO must see as the behaviour policy.
    """

    def __call__(
        self,
        logits: torch.Tensor,
        *,
        temperatures: Sequence[float],
        top_ks: Sequence[int],
        top_ps: Sequence[float],
        seeds: Sequence[int],
        positions: Sequence[int],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        device = logits.device
        temperature = torch.tensor(temperatures, dtype=torch.float32, device=device)
        if any(k > 0 for k in top_ks) or any(p < 1.0 for p in top_ps):
            top_k = torch.tensor(top_ks, dtype=torch.int64, device=device)
            top_p = torch.tensor(top_ps, dtype=torch.float32, device=device)
            truncated = _truncate(logits.float(), temperature, top_k, top_p)
            # Greedy rows keep their unscaled logits: argmax and its log-prob are unaffected by truncation.
            logits = torch.where((temperature > 0).unsqueeze(1), truncated, logits.float())
        return ops.sample(
            logits,
            temperature,
            torch.tensor(seeds, dtype=torch.int64, device=device),
            torch.tensor(positions, dtype=torch.int64, device=device),
        )
