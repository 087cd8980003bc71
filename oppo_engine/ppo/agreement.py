"""The gap between the engine's behaviour log-probs and the trainer's own forward, and its correction.

PPO's ratio divides the trainer's probability of a token by the probability it was sampled with. The
engine computes the latter with its own kernels (paged attention, its sampler, perhaps another dtype),
so even on-policy the two differ by rounding; a stale token (sampled before the last ``update_policy()``)
differs by a policy update too. Every step the trainer measures ``delta = log pi_trainer - log
pi_behaviour`` over the sampled tokens (``mask > 0``), in three classes reported apart:

- ``fresh``: tokens of sequences never carried over a step;
- ``carried_current``: tokens of carried sequences sampled by the current policy (under
  ``retained_kv="reuse"`` they attended over KV an older policy wrote);
- ``stale``: tokens sampled by an older policy.

:func:`correction_weights` turns the same ``delta`` into truncated (TIS, Yao et al. 2025) or masked (MIS,
Liu et al. 2025) importance weights on the per-token policy loss.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

CLASSES = ("fresh", "carried_current", "stale")
LARGE = 0.1  # |delta| above this counts in Agreement.frac_large


@dataclass(slots=True)
class Agreement:
    """The gap ``delta = log pi_trainer - log pi_behaviour`` over one class of tokens (NaN when the
    class is empty)."""

    tokens: int
    sequences: int  # rows holding at least one token of the class
    mean_abs: float  # mean |delta|
    max_abs: float  # max |delta|
    mean_k3: float  # mean of k3 = e^delta - 1 - delta (Schulman's KL estimator, >= 0)
    frac_large: float  # fraction of tokens with |delta| > LARGE
    seq_sum_std: float  # spread (population std) over sequences of the per-sequence sum of delta
    seq_sum_max_abs: float  # the largest |sum of delta| of a sequence


def measure(
    trainer_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    mask: torch.Tensor,
    stale: torch.Tensor,
    carried: torch.Tensor,
) -> dict[str, Agreement]:
    """``{class: Agreement}`` over the ``[N, L-1]`` per-token log-probs, for tokens with ``mask > 0``;
    ``stale [N, L-1]`` marks tokens of an older policy, ``carried [N]`` rows carried over a step."""
    delta = (trainer_logprobs.double() - behaviour_logprobs.double()).detach()
    sampled = mask > 0
    carried = carried.bool()[:, None]
    classes = {
        "fresh": sampled & ~stale & ~carried,
        "carried_current": sampled & ~stale & carried,
        "stale": sampled & stale,
    }
    return {name: _agreement(delta, where) for name, where in classes.items()}


def _agreement(delta: torch.Tensor, where: torch.Tensor) -> Agreement:
    d = delta[where]
    rows = where.any(1)
    if not len(d):
        nan = math.nan
        return Agreement(0, 0, nan, nan, nan, nan, nan, nan)
    sums = (delta * where)[rows].sum(1)
    return Agreement(
        tokens=len(d),
        sequences=int(rows.sum()),
        mean_abs=float(d.abs().mean()),
        max_abs=float(d.abs().max()),
        mean_k3=float((torch.expm1(d) - d).mean()),
        frac_large=float((d.abs() > LARGE).double().mean()),
        seq_sum_std=float(sums.std(correction=0)),
        seq_sum_max_abs=float(sums.abs().max()),
    )


def correction_weights(
    delta: torch.Tensor, mask: torch.Tensor, method: str, cap: float, level: str
) -> torch.Tensor:
    """``[N, L-1]`` detached weights of the per-token policy loss from ``delta = log pi_trainer - log
    pi_behaviour`` (``delta`` is 0 where a token is not corrected: its token-level weight is 1; at the
    sequence level it gets its row's, and the trainer sets it back to 1).

    ``level="token"``: the ratio is ``exp(delta)`` per token; ``"sequence"``: ``exp(sum of delta over
    the row's masked tokens)`` for every token of the row (as TRL and verl do).
    ``method="tis"``: truncated importance sampling (Yao et al. 2025), ``w = min(ratio, cap)``.
    ``method="mis"``: masked importance sampling (Liu et al. 2025), ``w = 1`` where ``1/cap <= ratio <=
    cap`` and 0 elsewhere: the token (or the whole sequence) is dropped from the loss, whose denominator
    stays the minibatch's token count."""
    delta = delta.detach() * (mask > 0)
    log_ratio = delta if level == "token" else delta.sum(1, keepdim=True).expand_as(delta)
    ratio = torch.exp(log_ratio)
    if method == "tis":
        return ratio.clamp(max=cap)
    if method == "mis":
        return ((ratio >= 1 / cap) & (ratio <= cap)).to(delta.dtype)
    raise ValueError(f"rollout_correction must be 'tis' or 'mis', got {method!r}")
