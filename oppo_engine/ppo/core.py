"""PPO's arithmetic on padded per-token tensors (``[N, L-1]``, see ``batch.py``): forwards of the trained
models, KL-penalised rewards, GAE, whitening and the clipped losses. Pure functions, no state."""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from oppo_engine.model.runner import unwrap_model


def masked_mean(x: torch.Tensor, mask: torch.Tensor, count: torch.Tensor | None = None) -> torch.Tensor:
    """The mean of ``x`` over the masked entries; with ``count``, their sum over ``count`` instead (one
    data-parallel rank's share of a minibatch whose rows are split over ranks: ``count`` is the whole
    minibatch's token count, and the ranks' shares sum to its mean)."""
    return (x * mask).sum() / (mask.sum() if count is None else count).clamp(min=1)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``x`` shifted to mean 0 and scaled to variance 1 over the masked entries (0 elsewhere)."""
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    return (x - mean) * torch.rsqrt(var + 1e-8) * mask


@contextmanager
def eval_semantics(model: nn.Module) -> Iterator[nn.Module]:
    """``model`` with every module in eval mode (no dropout) inside the block; each module's own flag is
    given back after it (a frozen submodule kept in eval stays so). The forwards that stand for the policy
    the engine sampled -- pi_trainer, the stale recompute -- run in it: the engine never decodes with
    dropout, so a dropout-masked forward would report its noise as a rollout-trainer gap."""
    training = [m for m in model.modules() if m.training]
    for m in training:
        m.training = False
    try:
        yield model
    finally:
        for m in training:
            m.training = True


def token_logprobs(
    actor: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    temperature: float,
    position_ids: torch.Tensor | None = None,
    keep: torch.Tensor | None = None,
    model_kwargs: dict | None = None,
) -> torch.Tensor:
    """``[N, L-1]`` log-prob of each next token under ``actor``'s logits over ``temperature`` (the
    distribution the engine samples from without top-k/top-p). A pack (``packing.py``) passes
    ``attention_mask=None`` and ``position_ids`` that restart at every sequence; a shared prefix
    (``prefix.py``) its KV cache in ``model_kwargs`` (more arguments of the forward).

    ``keep`` (bool ``[N, L-1]``) computes only the columns it marks (0 elsewhere): the LM head and the
    log-softmax over the vocabulary run on those positions alone (transformers' boolean ``logits_to_keep``),
    which for a large vocabulary is most of a small model's per-token work. The marked columns' values are
    those of the full computation (to rounding: the head's matmul has fewer rows). A model whose forward
    takes no ``logits_to_keep`` computes every position's logits, and the log-softmax runs on the marked
    ones alone."""
    inputs = dict(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
    )
    inputs.update(model_kwargs or {})
    if keep is None:
        logits = actor(**inputs).logits[:, :-1]
        targets = input_ids[:, 1:]
    elif "logits_to_keep" in inspect.signature(unwrap_model(actor).forward).parameters:
        rows = torch.nn.functional.pad(keep, (0, 1))  # [N, L]: the last position predicts nothing
        logits = actor(**inputs, logits_to_keep=rows).logits  # [K, V]: the kept positions, row-major
        targets = input_ids[:, 1:][keep]
    else:
        logits = actor(**inputs).logits[:, :-1][keep]
        targets = input_ids[:, 1:][keep]
    logits = logits.float()
    if temperature != 1.0:  # NOTE: x / 1.0 is x: skipping it is exact and saves a pass over [tokens, V]
        logits = logits / temperature
    logprobs = logits.log_softmax(-1).gather(-1, targets[..., None])[..., 0]
    if keep is None:
        return logprobs
    return torch.zeros(keep.shape, dtype=logprobs.dtype, device=logprobs.device).index_put((keep,), logprobs)


def token_values(
    critic: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None = None,
    model_kwargs: dict | None = None,
) -> torch.Tensor:
    """``[N, L-1]`` the critic's score head on every position's hidden state: column ``p`` is the value of
    the state before token ``p + 1`` (the convention of the engine's streamed ``values``). ``model_kwargs``:
    more arguments of the forward (a shared prefix's KV cache).

    A PEFT-wrapped critic is unwrapped to the HF model its adapters are injected into (as the engine does):
    its adapters and its trainable score head (``modules_to_save``) take part. An FSDP2 root gathers its own
    weights (embeddings, the head) only in its own forward, so a sharded critic runs whole, and the head's
    output at every position is read by a hook (HF's sequence classifiers apply ``score`` to every position,
    then pool)."""
    inputs = dict(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
    )
    inputs.update(model_kwargs or {})
    if isinstance(critic, FSDPModule):
        scores: list[torch.Tensor] = []
        handle = critic.score.register_forward_hook(lambda _m, _i, out: scores.append(out))
        try:
            critic(**inputs)
        finally:
            handle.remove()
        return scores[0][:, :-1].float()[..., 0]
    model = unwrap_model(critic)
    hidden = getattr(model, model.base_model_prefix)(**inputs)
    return model.score(hidden.last_hidden_state[:, :-1]).float()[..., 0]


def kl_penalized_rewards(
    scores: torch.Tensor,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    kl_coef: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token rewards ``-kl_coef * (logprobs - ref_logprobs)``, plus the score at each row's last
    response token; and the per-token KL estimate itself."""
    kl = (logprobs - ref_logprobs) * mask
    rewards = -kl_coef * kl
    last = (mask * torch.arange(mask.shape[1], device=mask.device)).argmax(1)
    rewards[torch.arange(len(scores), device=mask.device), last] += scores
    return rewards, kl


def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimates and returns (``advantages + values``) over the masked columns;
    the value after a row's last response token is 0 (the episode ends).

    A column outside the mask inside the response (an observation of a multi-turn episode) is skipped: the
    next sampled token's value and advantage carry across it, so the return is not cut at each
    observation -- GAE over the sampled tokens alone, in their order, with the critic's values of the
    states it saw (observations included)."""
    advantages = torch.zeros_like(rewards)
    next_value = torch.zeros_like(rewards[:, 0])
    next_adv = torch.zeros_like(rewards[:, 0])
    for t in range(rewards.shape[1] - 1, -1, -1):
        m = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv = (delta + gamma * lam * next_adv) * m
        advantages[:, t] = adv
        # Outside the mask nothing changes: padding after the response carries the terminal 0, an
        # observation carries its next sampled token's value and advantage, the prompt carries what is unused.
        sampled = m > 0
        next_value = torch.where(sampled, values[:, t], next_value)
        next_adv = torch.where(sampled, adv, next_adv)
    return advantages, (advantages + values) * mask


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_range: float,
    truncation: float | None = None,
    count: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate ``max(-A r, -A clip(r, 1-e, 1+e))`` with ``r = exp(logprobs - old)``.

    ``weights`` (detached, per token) scale each token's surrogate: the rollout correction's importance
    weights (``agreement.correction_weights``); the clip fraction and approx KL are not weighted.

    With ``truncation=c`` the unclipped ratio is first truncated at ``c`` (a truncated importance weight):
    when ``old_logprobs`` are those of an older behaviour policy, a token it made unlikely cannot blow up the
    loss (for ``A < 0``, the plain surrogate is unbounded in ``r``). Returns (loss, clip fraction, approx KL).
    """
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = ratio if truncation is None else ratio.clamp(max=truncation)
    losses = torch.maximum(-advantages * unclipped, -advantages * ratio.clamp(1 - clip_range, 1 + clip_range))
    if weights is not None:
        losses = losses * weights
    clipfrac = masked_mean(((ratio - 1).abs() > clip_range).float(), mask, count)
    approx_kl = masked_mean(0.5 * (logprobs - old_logprobs) ** 2, mask, count)
    return masked_mean(losses, mask, count), clipfrac.detach(), approx_kl.detach()


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip_range: float,
    count: torch.Tensor | None = None,
) -> torch.Tensor:
    """The clipped value loss ``0.5 * max((v - R)^2, (clip(v, v_old +- e) - R)^2)`` (``count``: see
    ``masked_mean``)."""
    clipped = old_values + (values - old_values).clamp(-clip_range, clip_range)
    squared = torch.maximum((values - returns) ** 2, (clipped - returns) ** 2)
    return 0.5 * masked_mean(squared, mask, count)
