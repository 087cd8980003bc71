"""A pack's attention as batched causal calls over its sequences: about ``sum(len_i^2)`` work, not ``T^2``.

transformers' sdpa and eager attention over a pack (``packing.py``) take a dense block-diagonal ``T x T``
mask and compute the whole square, though only the blocks on its diagonal are real. Here the pack's queries,
keys and values are gathered into a right-padded batch ``[n, heads, L, head_dim]`` (``L``: the longest of
its sequences), one ``scaled_dot_product_attention(is_causal=True)`` runs over it, and the outputs are
scattered back to the packed layout. With right padding a real query never reaches a padding key (they lie
after it) and the padding's query rows are dropped, so every sequence gets exactly its own causal
attention. The projections and the MLP stay packed; gather and scatter are indexing, so gradients flow
through them (a padding row's output is dropped, so nothing flows back from it).

A padded batch costs ``n x L^2``: one over a pack of mixed lengths (a long sequence among short ones, as a
random minibatch packed whole is) would cost about the dense ``T^2``. So the sequences are bucketed by
length (:class:`PackLayout`: a new bucket wherever a sequence is shorter than half its bucket's longest),
one call per bucket: each sequence's square paid at most 4x, in a few calls (one where the lengths are
within 2x of each other), where one call per sequence pays a call's overhead per sequence.

The function is registered with ``transformers.AttentionInterface`` under ``ATTN_IMPL`` without a mask
function, so transformers builds no mask at all and passes ``attention_mask=None``; it is switched on only
inside :func:`batched_attention`, which binds the pack's layout to the thread (not every decoder forwards
``**kwargs`` to its attention modules) and gives every config its implementation back when the last block
on it leaves (blocks may nest, or overlap in several threads), error included. What the call cannot do
exactly it refuses with ``ValueError`` naming the feature: a sliding window shorter than the pack's longest
sequence, logit softcapping, attention sinks, a mask or position bias the model built itself, non-causal
attention. :func:`refusal` names what rules a model out before any forward: an attention other than sdpa or
eager (the batched call stands in for those two only), activation checkpointing (its recompute in the
backward would run outside the switch, over the whole row).
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


BUCKET_RATIO = 2.0  # a sequence shorter than its bucket's longest over this starts a new bucket


def bucket_lengths(lengths: Sequence[int], ratio: float = BUCKET_RATIO) -> list[list[int]]:
    """Positions into ``lengths`` sorted longest first (ties by position) and cut into buckets: a new one
    wherever a length is shorter than its bucket's longest over ``ratio``."""
    groups: list[list[int]] = []
    for k in sorted(range(len(lengths)), key=lambda k: (-lengths[k], k)):
        if groups and lengths[k] * ratio >= lengths[groups[-1][0]]:
            groups[-1].append(k)
        else:
            groups.append([k])
    return groups


@dataclass(slots=True)
class Bucket:
    """Sequences of a pack whose attention runs as one call over a right-padded batch."""

    gather: torch.Tensor  # [n, L] int64: packed position of token min(p, len_k - 1) of its sequence k
    scatter: torch.Tensor  # [T_b] int64: the real tokens' rows of the flattened [n * L] batch, in order


@dataclass(slots=True)
class PackLayout:
    """Where each sequence of a pack lies in its row, grouped into buckets of similar length."""

    buckets: list[Bucket]
    order: torch.Tensor | None  # [T] int64: packed position t's row in the buckets' outputs, concatenated
    tokens: int  # T = sum of the lengths
    longest: int  # L
    calls: int = 0  # attention calls served inside the switch
    window: int | None = None  # the smallest sliding window a call was given (None: none)

    @classmethod
    def of(
        cls, lengths: Sequence[int], device: torch.device | str, ratio: float = BUCKET_RATIO
    ) -> PackLayout:
        """The layout of a pack of sequences of ``lengths`` (end to end, in this order). Sorted longest
        first (ties in pack order), the sequences fall into buckets: a new one wherever a sequence is shorter
        than its bucket's longest over ``ratio``, so a bucket's padded batch holds each sequence's own square
        at most ``ratio^2`` times over, and a pack of lengths within ``ratio`` of each other is one call
        (``ratio=math.inf``: always one call). ``order`` is ``None`` where the buckets' outputs are already in
        packed order (a pack sorted longest first, as ``plan_sorted_packs`` makes them)."""
        lens = [int(n) for n in lengths]
        offsets = [sum(lens[:k]) for k in range(len(lens))]
        buckets, tokens = [], []
        for group in bucket_lengths(lens, ratio):
            n, off = (torch.tensor([v[k] for k in group]) for v in (lens, offsets))
            cols = torch.arange(int(n[0]))
            gather = off[:, None] + torch.minimum(cols[None], n[:, None] - 1)
            scatter = (cols[None] < n[:, None]).flatten().nonzero()[:, 0]
            tokens.append(gather.flatten()[scatter])
            buckets.append(Bucket(gather.to(device), scatter.to(device)))
        # Built on the host: nonzero would wait for the device; every layer then indexes without a sync.
        concatenated = torch.cat(tokens)
        order = None
        if not torch.equal(concatenated, torch.arange(len(concatenated))):
            order = torch.empty_like(concatenated)
            order[concatenated] = torch.arange(len(concatenated))
            order = order.to(device)
        return cls(buckets, order, sum(lens), max(lens))


def batched_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layout: PackLayout,
    scaling: float | None = None,
    dropout: float = 0.0,
) -> torch.Tensor:
    """``query [1, Hq, T, D]``, ``key``/``value [1, Hkv, T, D]`` of a pack -> ``[1, T, Hq, D]``: each
    sequence's causal attention over its own tokens, from one sdpa call per bucket of ``layout`` over its
    right-padded batch ``[n, Hq, L, D]``. Grouped K/V heads as transformers' sdpa takes them without a mask:
    ``enable_gqa`` for head sizes up to 256, else repeated."""
    heads, kv_heads = query.shape[1], key.shape[1]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads are not a multiple of {kv_heads} key/value heads")
    gqa = heads != kv_heads and key.shape[-1] == value.shape[-1] <= 256
    rows = [x[0].transpose(0, 1) for x in (query, key, value)]  # [1, H, T, D] -> [T, H, D]
    outs = []
    for bucket in layout.buckets:
        q, k, v = (x[bucket.gather].transpose(1, 2) for x in rows)  # [n, L, H, D] -> [n, H, L, D]
        if heads != kv_heads and not gqa:
            k, v = (x.repeat_interleave(heads // kv_heads, dim=1) for x in (k, v))
        out = F.scaled_dot_product_attention(
            q, k, v, dropout_p=dropout, scale=scaling, is_causal=True, enable_gqa=gqa
        )  # [n, H, L, Dv]
        outs.append(out.transpose(1, 2).flatten(0, 1)[bucket.scatter])  # [n * L, H, Dv] -> [T_b, H, Dv]
    out = torch.cat(outs) if len(outs) > 1 else outs[0]
    return (out if layout.order is None else out[layout.order])[None]  # packed order, [1, T, H, Dv]


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


# NOTE: the switch is reference-counted per config: the first block to enter saves a config's implementation
# and sets ATTN_IMPL, the last to leave gives it back, so blocks on one model may nest, and overlap in several
# threads (each reads its own thread's layout), in any order of exit.
_switched: dict[int, list] = {}  # id(config) -> [config, its own implementation, blocks inside]
_switch_lock = threading.Lock()


def refusal(model: nn.Module) -> str | None:
    """Why ``model``'s packs cannot take the batched attention before any forward (``None``: nothing)."""
    with _switch_lock:
        return _refusal(model)


def _refusal(model: nn.Module) -> str | None:
    # The implementations the model's configs have outside every batched block (the caller holds the lock).
    own = [_switched[id(c)][1] if id(c) in _switched else c._attn_implementation for c in _configs(model)]
    impls = sorted({str(impl) for impl in own} - set(REPLACES))
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
    """Run ``model``'s attention over a pack of sequences of ``lengths`` (end to end, in this order) as
    batched calls inside the block, one per bucket of :class:`PackLayout` (``ValueError`` if :func:`refusal`
    names a reason). Reference-counted: blocks on one model may nest or run in several threads at once, each
    thread's forwards over its own innermost pack; every config gets its implementation back when the last
    block leaves, error included. A forward of the model outside every block (another thread's) while one
    is open raises ``RuntimeError``."""
    register()
    layout = PackLayout.of(lengths, next(model.parameters()).device)
    configs = _configs(model)
    previous = getattr(_bound, "layout", None)
    with _switch_lock:  # the check and the switch at once: no other block's exit or entry between them
        reason = _refusal(model)
        if reason is not None:
            raise ValueError(f"pack_attention='batched': {reason}")
        for c in configs:
            _switched.setdefault(id(c), [c, c._attn_implementation_internal, 0])[2] += 1
            c._attn_implementation_internal = ATTN_IMPL
    try:
        _bound.layout = layout
        yield layout
    finally:
        _bound.layout = previous
        with _switch_lock:
            for c in configs:
                entry = _switched[id(c)]
                entry[2] -= 1
                if entry[2] == 0:
                    del _switched[id(c)]
                    c._attn_implementation_internal = entry[1]
