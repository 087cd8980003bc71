"""A pack's attention as one batched causal call over its sequences: ``sum(len_i^2)`` work, not ``T^2``.

transformers' sdpa and eager attention over a pack (``packing.py``) take a dense block-diagonal ``T x T``
mask and compute the whole square, though only the blocks on its diagonal are real. Here the pack's queries,
keys and values are gathered into a right-padded batch ``[n, heads, L, head_dim]`` (``L``: the pack's
longest sequence), one ``scaled_dot_product_attention(is_causal=True)`` runs over it, and the outputs are
scattered back to the packed layout. With right padding a real query never reaches a padding key (they lie
after it) and the padding's query rows are dropped, so every sequence gets exactly its own causal
attention. The projections and the MLP stay packed; gather and scatter are indexing, so gradients flow
through them (a padding row's output is dropped, so nothing flows back from it).

The function is registered with ``transformers.AttentionInterface`` under ``ATTN_IMPL`` without a mask
function, so transformers builds no mask at all and passes ``attention_mask=None``; it is switched on only
inside :func:`batched_attention`, which binds the pack's layout to the thread (not every decoder forwards
``**kwargs`` to its attention modules) and gives every config its implementation back on exit, error
included. What the call cannot do exactly it refuses with ``ValueError`` naming the feature: a sliding
window shorter than the pack's longest sequence, logit softcapping, attention sinks, a mask or position bias
the model built itself, non-causal attention. :func:`refusal` names what rules a model out before any
forward: an attention other than sdpa or eager (the batched call stands in for those two only), activation
checkpointing (its recompute in the backward would run outside the switch, over the whole row).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface, PreTrainedModel

from oppo_engine.ppo.prefix import checkpointing

ATTN_IMPL = "oppo_pack_batched"
REPLACES = ("sdpa", "eager")  # the implementations the batched call computes exactly (to rounding)


@dataclass(slots=True)
class PackLayout:
    """Where each sequence of a pack lies in its row, for attention over a right-padded batch."""

    gather: torch.Tensor  # [n, L] int64: packed position of token min(p, len_k - 1) of sequence k
    scatter: torch.Tensor  # [T] int64: where packed position t lies in the flattened [n * L] batch
    tokens: int  # T = sum of the lengths
    longest: int  # L
    calls: int = 0  # attention calls served inside the switch
    window: int | None = None  # the smallest sliding window a call was given (None: none)

    @classmethod
    def of(cls, lengths: Sequence[int], device: torch.device | str) -> PackLayout:
        lens = torch.tensor(list(lengths), device=device)
        cols = torch.arange(max(lengths), device=device)
        offsets = torch.cumsum(lens, 0) - lens
        gather = offsets[:, None] + torch.minimum(cols[None], lens[:, None] - 1)
        # NOTE: row-major, a sequence's valid entries follow the previous one's: the packed order. Found once
        # per pack (nonzero waits for the device), then every layer indexes without a sync.
        scatter = (cols[None] < lens[:, None]).flatten().nonzero()[:, 0]
        return cls(gather, scatter, int(sum(lengths)), int(max(lengths)))


def batched_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layout: PackLayout,
    scaling: float | None = None,
    dropout: float = 0.0,
) -> torch.Tensor:
    """``query [1, Hq, T, D]``, ``key``/``value [1, Hkv, T, D]`` of a pack -> ``[1, T, Hq, D]``: each
    sequence's causal attention over its own tokens, from one sdpa call over the right-padded batch
    ``[n, Hq, L, D]``. Grouped K/V heads as transformers' sdpa takes them without a mask: ``enable_gqa`` for
    head sizes up to 256, else repeated."""
    heads, kv_heads = query.shape[1], key.shape[1]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads are not a multiple of {kv_heads} key/value heads")
    # [1, H, T, D] -> [T, H, D] -> [n, L, H, D] -> [n, H, L, D]
    q, k, v = (x[0].transpose(0, 1)[layout.gather].transpose(1, 2) for x in (query, key, value))
    gqa = heads != kv_heads and key.shape[-1] == value.shape[-1] <= 256
    if heads != kv_heads and not gqa:
        k, v = (x.repeat_interleave(heads // kv_heads, dim=1) for x in (k, v))
    out = F.scaled_dot_product_attention(
        q, k, v, dropout_p=dropout, scale=scaling, is_causal=True, enable_gqa=gqa
    )  # [n, H, L, Dv]
    # [n, L, H, Dv] -> [n * L, H, Dv] -> [T, H, Dv] (packed order) -> [1, T, H, Dv]
    return out.transpose(1, 2).flatten(0, 1)[layout.scatter][None]


_bound = threading.local()


def bound() -> PackLayout | None:
    """The layout :func:`batched_attention` bound to this thread (``None`` outside its block)."""
    return getattr(_bound, "layout", None)


def batched_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """HF attention over the pack bound by :func:`batched_attention`: ``([1, T, Hq, D], None)``."""
    layout = bound()
    if layout is None:
        raise RuntimeError(
            f"{type(module).__name__}: the model is switched to the pack's batched attention and was called "
            "outside a batched_attention block"
        )
    name = type(module).__name__
    causal = kwargs.get("is_causal")
    unsupported = [
        (attention_mask is not None, "an attention mask or bias the model built itself"),
        (kwargs.get("position_bias") is not None, "a position bias"),
        (softcap is not None, "attention logit softcapping"),
        (kwargs.get("s_aux") is not None, "attention sinks (s_aux)"),
        (kwargs.get("head_mask") is not None, "a head mask"),
        (causal is False or (causal is None and getattr(module, "is_causal", True) is False), "non-causal "
         "attention"),
        (sliding_window is not None and sliding_window < layout.longest, f"a sliding attention window of "
         f"{sliding_window} tokens, shorter than the pack's longest sequence ({layout.longest})"),
    ]  # fmt: skip
    for found, feature in unsupported:
        if found:
            raise ValueError(f"{name} uses {feature}, which pack_attention='batched' cannot apply")
    if query.shape[0] != 1 or query.shape[2] != layout.tokens or key.shape[2] != layout.tokens:
        raise RuntimeError(
            f"{name}: queries {tuple(query.shape)} and keys {tuple(key.shape)} are not the bound pack's "
            f"[1, heads, {layout.tokens}, head_dim]"
        )
    layout.calls += 1
    if sliding_window is not None:
        layout.window = sliding_window if layout.window is None else min(layout.window, sliding_window)
    return batched_sdpa(query, key, value, layout, scaling, dropout), None


_register_lock = threading.Lock()


def register() -> None:
    """Register ``ATTN_IMPL`` with ``transformers.AttentionInterface`` (idempotent, no mask function)."""
    with _register_lock:
        if ATTN_IMPL not in AttentionInterface():
            AttentionInterface.register(ATTN_IMPL, batched_attention_forward)


def _configs(model: nn.Module) -> list:
    """Every config the model's modules read their attention implementation from, sub-configs included
    (HF sets an implementation recursively on them)."""
    found: dict[int, object] = {}
    todo = [m.config for m in model.modules() if isinstance(m, PreTrainedModel)]
    while todo:
        config = todo.pop(0)
        if id(config) in found:
            continue
        found[id(config)] = config
        todo += [getattr(config, k) for k in getattr(config, "sub_configs", {}) if getattr(config, k, None)]
    return list(found.values())


def refusal(model: nn.Module) -> str | None:
    """Why ``model``'s packs cannot take the batched attention before any forward (``None``: nothing)."""
    impls = sorted({str(c._attn_implementation) for c in _configs(model)} - set(REPLACES))
    if impls:
        return (
            f"{type(model).__name__} runs attention {', '.join(map(repr, impls))}; the batched call "
            f"stands in for {' or '.join(map(repr, REPLACES))} only"
        )
    if checkpointing(model):
        return (
            f"{type(model).__name__} has activation checkpointing on: its recompute in the backward "
            "would run outside the pack's batched attention"
        )
    return None


@contextmanager
def batched_attention(model: nn.Module, lengths: Sequence[int]) -> Iterator[PackLayout]:
    """Run ``model``'s attention over a pack of sequences of ``lengths`` (end to end, in this order) as one
    batched call inside the block (``ValueError`` if :func:`refusal` names a reason); every config gets its
    implementation back on exit, error included. Not for a model another thread runs meanwhile (the switch
    is the model's configs')."""
    reason = refusal(model)
    if reason is not None:
        raise ValueError(f"pack_attention='batched': {reason}")
    register()
    layout = PackLayout.of(lengths, next(model.parameters()).device)
    configs = _configs(model)
    saved = [c._attn_implementation_internal for c in configs]
    previous = getattr(_bound, "layout", None)
    try:
        for c in configs:
            c._attn_implementation_internal = ATTN_IMPL
        _bound.layout = layout
        yield layout
    finally:
        _bound.layout = previous
        for c, impl in zip(configs, saved, strict=True):
            c._attn_implementation_internal = impl
