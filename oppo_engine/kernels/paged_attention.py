"""Varlen attention of packed queries over the paged KV cache: decode and chunked prefill in one launch.

Layout (DESIGN.md, "The paged KV cache"): ``kv_cache`` is one model's view of the byte arena,
``[num_pages, L, 2, page_size, Hkv, D]``; index 0 of dim 2 is K, 1 is V; the page stride may exceed
``L * 2 * page_size * Hkv * D`` because pages are a fixed number of bytes shared between models. Token
``t`` of sequence ``n`` lives in page ``block_tables[n, t // page_size]`` at offset ``t % page_size``.

Queries are packed ``[T, Hq, D]``; sequence ``n`` owns rows ``cu_seqlens_q[n]:cu_seqlens_q[n + 1]``
(``q_len_n`` new tokens, whose K/V are already in the cache) and ``context_lens[n]`` cached tokens
including the new ones. New token ``i`` sits at position ``context_lens[n] - q_len_n + i`` and attends to
cache positions ``0..`` that position inclusive.

Per call (per layer), as Hugging Face's eager attention and masks define them:

- ``sliding_window = w``: a query at position ``p`` sees key ``k`` iff ``p - w < k <= p`` (the window counts
  the query itself; ``masking_utils.sliding_window_overlay``). Pages wholly before every window of a
  sequence are never read, nor are their block-table entries.
- ``softcap = c``: scores become ``c * tanh(q.k * scale / c)`` before masking and softmax (Gemma 2's
  ``attn_logit_softcapping``).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._jit import jit as _jit

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_HEAD_DIM = 256
# Split-KV (flash-decoding): every sequence's keys are cut into splits of this many tokens, counted from
# its own first key, so how a token's attention is split -- and so its bits -- follow from its own context
# alone, never from the batch it shares a launch with. A multiple of every BLOCK_N.
KV_PER_SPLIT = 512
_MAX_GRID_YZ = 65535  # CUDA's limit on the 2nd and 3rd grid dimensions
_LOG2E = math.log2(math.e)


# NOTE: arguments whose value (or 16-byte alignment) changes from forward to forward with the batch are not
# specialised on, so one compiled variant serves every batch of a launch shape: the build-time warm-up then
# compiles everything a run launches, and a captured graph never meets a cold variant. The metadata
# pointers are slices of one packed buffer, aligned or not depending on N; their loads are scalar.
_BATCH_VARYING_POINTERS = ["block_tables_ptr", "context_lens_ptr", "cu_seqlens_q_ptr", "work_ptr"]


@triton.jit
def _tanh(x):
    # libdevice's tanh does not run under the interpreter. Stable form: exp2 of -2|x| never overflows; for
    # small |x| the cancellation in 1 - e costs ~1e-7 absolute, i.e. ~softcap * 1e-7 on a score.
    e = tl.exp2(-2.885390081777927 * tl.abs(x))  # 2 * log2(e)
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@_jit(
    do_not_specialize=["item_offset", "window", "stride_bt_seq", "stride_lse_split"],
    do_not_specialize_on_alignment=_BATCH_VARYING_POINTERS,
)
def _paged_attention_kernel(
    q_ptr,  # [T, Hq, D]
    kv_ptr,  # [num_pages, L, 2, page_size, Hkv, D], already offset to `layer`
    block_tables_ptr,  # [N, max_pages] int32
    context_lens_ptr,  # [N] int32
    cu_seqlens_q_ptr,  # [N + 1] int32
    work_ptr,  # [num_items, 2] int32 work list (sequence, q block); unread when DECODE
    out_ptr,  # [T, Hq, D] in q.dtype, or [num_splits, T, Hq, D] fp32 partials when SPLIT_KV
    lse_ptr,  # [num_splits, T, Hq] fp32 (SPLIT_KV only), log2-sum-exp of the scaled scores
    qk_scale,  # softmax scale * log2(e) (the kernel works in base 2); scale / softcap when SOFTCAP
    softcap_log2e,  # softcap * log2(e) (SOFTCAP only)
    window,  # sliding window in tokens (HAS_WINDOW only)
    item_offset,  # this launch's first entry of the work list
    kv_per_split,  # tokens per split, a multiple of BLOCK_N
    stride_q_tok,
    stride_q_head,
    stride_kv_page,
    stride_kv_kv,
    stride_kv_tok,
    stride_kv_head,
    stride_bt_seq,
    stride_bt_page,
    stride_o_split,
    stride_o_tok,
    stride_o_head,
    stride_lse_split,
    stride_lse_tok,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    GROUP: tl.constexpr,  # q heads per KV head
    BLOCK_M: tl.constexpr,  # rows of the dot: BLOCK_Q tokens x GROUP heads (padded to a power of two)
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    SPLIT_KV: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    DECODE: tl.constexpr,  # every item is a whole sequence of <= 1 new token: item i is sequence i
    DOT_FP32: tl.constexpr,  # upcast operands before tl.dot (bf16 under the interpreter is wrong)
    DOT_PRECISION: tl.constexpr,
):
    # One program: one work item (a sequence's block of BLOCK_Q query tokens), one KV head, one split.
    item = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if DECODE:
        seq = item
        q_block = 0
    else:
        entry = work_ptr + (item_offset + item).to(tl.int64) * 2
        seq = tl.load(entry)
        q_block = tl.load(entry + 1)

    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    # Only a decode launch over a padded bucket has such programs (a sequence with no new token).
    if q_block * BLOCK_Q >= q_len:
        return
    ctx_len = tl.load(context_lens_ptr + seq)

    # All GROUP heads of one KV head share the K/V tiles, so they ride in the M dimension together:
    # row r is query token r // GROUP, head r % GROUP of this KV group.
    rows = tl.arange(0, BLOCK_M)
    tok = q_block * BLOCK_Q + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_valid = (rows < BLOCK_Q * GROUP) & (tok < q_len)
    pos = ctx_len - q_len + tok
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    q_row = (q_start + tok).to(tl.int64)
    row_mask = row_valid[:, None] & d_mask[None, :]

    # Causal bound of the block's last token: no row of this block needs keys at or past it.
    kv_end = ctx_len - q_len + tl.minimum(q_len, (q_block + 1) * BLOCK_Q)
    if SPLIT_KV:
        kv_lo = split * kv_per_split
        kv_hi = tl.minimum(kv_end, kv_lo + kv_per_split)
    else:
        kv_lo = 0
        kv_hi = kv_end
    if HAS_WINDOW:
        # The block's first token has the earliest window: no row needs a key before its start. Loads are
        # masked from there (the pages before it may already be recycled); the loop starts at the tile
        # boundary below so tiles stay aligned with pages.
        kv_lo = tl.maximum(kv_lo, ctx_len - q_len + q_block * BLOCK_Q - window + 1)
    kv_first = (kv_lo // BLOCK_N) * BLOCK_N
    if SPLIT_KV:
        # A split past the block's causal end (or before its window): its log-sum-exp says "no key" and
        # the reduce reads nothing else of it, so its output rows are never written (a split count follows
        # max_model_len in a captured bucket: most splits of a short context are empty).
        if kv_lo >= kv_hi:
            lse_empty = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
            lse_at = lse_ptr + split.to(tl.int64) * stride_lse_split + q_row * stride_lse_tok + head
            tl.store(lse_at, lse_empty, mask=row_valid)
            return

    q = tl.load(
        q_ptr + q_row[:, None] * stride_q_tok + head[:, None] * stride_q_head + offs_d[None, :],
        mask=row_mask,
        other=0.0,
    )
    if DOT_FP32:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
    k_head_ptr = kv_ptr + kv_head * stride_kv_head

    for start in range(kv_first, kv_hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_mask = (offs_n >= kv_lo) & (offs_n < kv_hi)
        # A KV block may span several pages (or part of one): resolve the page of every token.
        page = tl.load(bt_row + (offs_n // PAGE_SIZE) * stride_bt_page, mask=n_mask, other=0)
        # NOTE: the arena can exceed 2**31 elements, so page offsets are computed in int64.
        tok_off = page.to(tl.int64) * stride_kv_page + (offs_n % PAGE_SIZE) * stride_kv_tok
        kv_off = tok_off[:, None] + offs_d[None, :]
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_head_ptr + kv_off, mask=kv_mask, other=0.0)
        v = tl.load(k_head_ptr + stride_kv_kv + kv_off, mask=kv_mask, other=0.0)
        if DOT_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)

        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        if SOFTCAP:
            s = _tanh(s) * softcap_log2e
        visible = n_mask[None, :] & (offs_n[None, :] <= pos[:, None])
        if HAS_WINDOW:
            visible = visible & (offs_n[None, :] > pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row may see no key yet (padding rows, or a split past its causal end): keep exp2 away from
        # (-inf) - (-inf).
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    has_keys = l_i > 0.0
    l_safe = tl.where(has_keys, l_i, 1.0)
    o = acc / l_safe[:, None]
    o_ptrs = out_ptr + q_row[:, None] * stride_o_tok + head[:, None] * stride_o_head + offs_d[None, :]
    if SPLIT_KV:
        split64 = split.to(tl.int64)
        tl.store(o_ptrs + split64 * stride_o_split, o, mask=row_mask)
        lse = tl.where(has_keys, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(lse_ptr + split64 * stride_lse_split + q_row * stride_lse_tok + head, lse, mask=row_valid)
    else:
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=row_mask)


@_jit(do_not_specialize=["num_splits", "stride_l_split"])
def _split_kv_reduce_kernel(
    part_ptr,  # [num_splits, T, Hq, D] fp32, each split's output normalised by its own sum (0: no key)
    lse_ptr,  # [num_splits, T, Hq] fp32, base 2; -inf for a split that saw no key
    out_ptr,  # [T, Hq, D]
    num_splits,
    stride_p_split,
    stride_p_tok,
    stride_p_head,
    stride_l_split,
    stride_l_tok,
    stride_o_tok,
    stride_o_head,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # NOTE: splits are combined one by one in split order, so a token's sum has the same operations in
    # the same order whatever the launch's split count: a split that saw no key (log-sum-exp -inf) adds
    # exactly 0 * 0, its output rows not read (an empty split does not write them).
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    # NOTE: int64 split strides: (num_splits - 1) * T * Hq * D passes 2**31 at 32k+ contexts over thousands
    # of tokens (the split loop variable is int32).
    split_l = stride_l_split.to(tl.int64)
    split_p = stride_p_split.to(tl.int64)
    lse_row = lse_ptr + tok * stride_l_tok + head
    part_row = part_ptr + tok * stride_p_tok + head * stride_p_head + offs_d
    # Loop-carried values start as tensors (split 0 always exists: the reduce runs for >= 2 splits).
    lse_first = tl.load(lse_row)
    lse_max = lse_first
    for s in range(1, num_splits):
        lse_max = tl.maximum(lse_max, tl.load(lse_row + s * split_l))
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    total = tl.exp2(lse_first - lse_max)
    no_d = tl.zeros([BLOCK_D], dtype=tl.float32)  # a split's lse over the row's lanes (a vector mask)
    acc = total * tl.load(part_row, mask=d_mask & (lse_first + no_d > float("-inf")), other=0.0)
    for s in range(1, num_splits):
        lse_s = tl.load(lse_row + s * split_l)
        w = tl.exp2(lse_s - lse_max)
        acc += w * tl.load(part_row + s * split_p, mask=d_mask & (lse_s + no_d > float("-inf")), other=0.0)
        total += w
    total = tl.where(total > 0.0, total, 1.0)
    tl.store(
        out_ptr + tok * stride_o_tok + head * stride_o_head + offs_d,
        (acc / total).to(out_ptr.dtype.element_ty),
        mask=d_mask,
    )


# Host-side twins of triton.cdiv / triton.next_power_of_2, which are constexpr functions costing ~0.1 ms
# per call outside a kernel: too much on the decode launch path.
def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@dataclass(frozen=True, slots=True)
class _Config:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def _launch_config(max_q_len: int, block_d: int, group: int, dtype: torch.dtype) -> _Config:
    """Tile sizes by a fixed heuristic (no autotune: it needs a GPU, and CPU tests must run the same code).

    Decode packs one token's GROUP heads into the minimum 16-row dot; prefill uses taller tiles so each
    K/V tile is reused by more query rows. Head dim 256 halves BLOCK_N to stay within registers, and so
    does fp32 (tests only: its exact "ieee" dot runs on FMA units and spills at the bf16 tile sizes).
    """
    block_n = 64 if block_d <= 128 and dtype != torch.float32 else 32
    if max_q_len == 1:
        block_m, num_warps, num_stages = 16, 4, 3
    elif block_d <= 128 and dtype != torch.float32:
        block_m, num_warps, num_stages = 128, 8, 2
    else:
        block_m, num_warps, num_stages = 64, 8, 2
    return _Config(max(block_m, _next_pow2(group)), block_n, num_warps, num_stages)


def _decode_config(block_d: int, group: int, dtype: torch.dtype) -> _Config:
    return _launch_config(1, block_d, group, dtype)


def _prefill_config(block_d: int, group: int, dtype: torch.dtype) -> _Config:
    return _launch_config(2, block_d, group, dtype)


@dataclass(frozen=True, slots=True)
class _Launch:
    """One kernel launch: ``num_items`` work items from ``item_offset`` of the plan's work list (or, for a
    decode-only forward, sequence ``i`` as item ``i``), all with one tile configuration."""

    config: _Config
    block_q: int  # query tokens per program
    item_offset: int
    num_items: int
    decode: bool  # items are whole sequences (no work list read)


@dataclass(frozen=True, slots=True)
class _Plan:
    """Everything about a forward's launches that follows from host-known sizes (the benchmark reports it)."""

    block_d: int
    kv_per_split: int
    num_splits: int  # split slots per (item, KV head): ceil(max_context_len / kv_per_split)
    launches: tuple[_Launch, ...]


def _plan(
    q_lens: list[int] | None,
    num_seqs: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    max_context_len: int,
    dtype: torch.dtype,
    kv_per_split: int = KV_PER_SPLIT,
) -> tuple[_Plan, list[tuple[int, int]]]:
    """The launches of one forward and its work list ``[(sequence, q block)]``.

    ``q_lens is None`` means a decode-only forward of ``num_seqs`` sequences (<= 1 new token each): one
    launch, item ``i`` = sequence ``i``, no work list -- sizes a captured graph knows for its bucket.
    Otherwise decodes (one new token) and prefill chunks go to two launches, each with its own fixed tile
    configuration, so a decode token's numbers never depend on whether a prefill shares its forward;
    the prefill launch walks a flat list of (sequence, q block) pairs, so no program idles on a short one.
    """
    group = num_q_heads // num_kv_heads
    block_d = max(16, _next_pow2(head_dim))
    decode_cfg = _decode_config(block_d, group, dtype)
    decode_q = decode_cfg.block_m // group
    num_splits = max(1, _cdiv(max_context_len, kv_per_split))
    if q_lens is None:
        only = _Launch(decode_cfg, decode_q, 0, num_seqs, True)
        return _Plan(block_d, kv_per_split, num_splits, (only,)), []
    decodes = [(n, 0) for n, q in enumerate(q_lens) if q == 1]
    prefill_cfg = _prefill_config(block_d, group, dtype)
    prefill_q = prefill_cfg.block_m // group
    chunks = [(n, b) for n, q in enumerate(q_lens) if q > 1 for b in range(_cdiv(q, prefill_q))]
    launches = []
    if decodes:
        launches.append(_Launch(decode_cfg, decode_q, 0, len(decodes), False))
    if chunks:
        launches.append(_Launch(prefill_cfg, prefill_q, len(decodes), len(chunks), False))
    return _Plan(block_d, kv_per_split, num_splits, tuple(launches)), decodes + chunks


def _check_q(q: torch.Tensor) -> None:
    if q.dim() != 3:
        raise ValueError(f"q must be [T, Hq, D], got shape {tuple(q.shape)}")
    if q.dtype not in _DTYPES:
        raise ValueError(f"q must be float16, bfloat16 or float32, got {q.dtype}")
    if q.stride(-1) != 1:
        raise ValueError(f"q must be contiguous in head_dim, got strides {q.stride()}")
    if not 1 <= q.shape[2] <= _MAX_HEAD_DIM:
        raise ValueError(f"q head_dim must be in [1, {_MAX_HEAD_DIM}], got {q.shape[2]}")


def _check_batch(
    kv_cache: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor, cu_seqlens_q: torch.Tensor
) -> None:
    """The checks that hold for every layer of a forward (done once by :func:`plan_attention`)."""
    if kv_cache.dim() != 6 or kv_cache.shape[2] != 2:
        raise ValueError(
            f"kv_cache must be [num_pages, L, 2, page_size, Hkv, D], got shape {tuple(kv_cache.shape)}"
        )
    if kv_cache.dtype not in _DTYPES:
        raise ValueError(f"kv_cache must be float16, bfloat16 or float32, got {kv_cache.dtype}")
    if kv_cache.stride(5) != 1:
        raise ValueError(f"kv_cache must be contiguous in head_dim, got strides {kv_cache.stride()}")
    if context_lens.dim() != 1 or context_lens.dtype != torch.int32:
        raise ValueError(
            f"context_lens must be a 1-D int32 tensor, got {context_lens.dtype} {tuple(context_lens.shape)}"
        )
    num_seqs = context_lens.shape[0]
    if cu_seqlens_q.dim() != 1 or cu_seqlens_q.dtype != torch.int32 or cu_seqlens_q.shape[0] != num_seqs + 1:
        raise ValueError(
            f"cu_seqlens_q must be int32 [N + 1] = [{num_seqs + 1}], "
            f"got {cu_seqlens_q.dtype} {tuple(cu_seqlens_q.shape)}"
        )
    if block_tables.dim() != 2 or block_tables.dtype != torch.int32 or block_tables.shape[0] != num_seqs:
        raise ValueError(
            f"block_tables must be int32 [N, max_pages] with N = {num_seqs}, "
            f"got {block_tables.dtype} {tuple(block_tables.shape)}"
        )
    for name, t in (
        ("block_tables", block_tables),
        ("context_lens", context_lens),
        ("cu_seqlens_q", cu_seqlens_q),
    ):
        if t.device != kv_cache.device:
            raise ValueError(f"{name} is on {t.device} but kv_cache is on {kv_cache.device}")


def check_window_softcap(sliding_window: int | None, softcap: float | None) -> None:
    """Raise ``ValueError`` unless ``sliding_window`` is None or an int >= 1 and ``softcap`` None or > 0."""
    if sliding_window is not None and (
        isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1
    ):
        raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window!r}")
    if softcap is not None and (
        isinstance(softcap, bool) or not isinstance(softcap, int | float) or not 0 < softcap < math.inf
    ):
        raise ValueError(f"softcap must be a positive finite float or None, got {softcap!r}")


def _check_call(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    out: torch.Tensor | None,
    sliding_window: int | None,
    softcap: float | None,
) -> None:
    """Per-layer checks: q against the cache, the layer, the output, this layer's window and softcap."""
    if kv_cache.dtype != q.dtype:
        raise ValueError(f"kv_cache dtype {kv_cache.dtype} must equal q dtype {q.dtype}")
    if kv_cache.shape[5] != q.shape[2]:
        raise ValueError(f"kv_cache head_dim {kv_cache.shape[5]} must equal q head_dim {q.shape[2]}")
    if q.shape[1] % kv_cache.shape[4] != 0:
        raise ValueError(f"q heads ({q.shape[1]}) must be a multiple of kv_cache heads ({kv_cache.shape[4]})")
    if kv_cache.device != q.device:
        raise ValueError(f"kv_cache is on {kv_cache.device} but q is on {q.device}")
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < kv_cache.shape[1]:
        raise ValueError(f"layer must be an int in [0, {kv_cache.shape[1]}), got {layer!r}")
    check_window_softcap(sliding_window, softcap)
    if out is not None:
        if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
            raise ValueError(
                f"out must match q ({q.dtype} {tuple(q.shape)} on {q.device}), "
                f"got {out.dtype} {tuple(out.shape)} on {out.device}"
            )
        if out.stride(-1) != 1:
            raise ValueError(f"out must be contiguous in head_dim, got strides {out.stride()}")


@dataclass(frozen=True, slots=True)
class AttentionPlan:
    """One forward's batch description, checked once, and the Triton kernel's launch plan for it.

    Build it with :func:`plan_attention` when the forward's metadata is built and pass it to every layer's
    ``paged_attention(..., plan=plan)`` with the *same* ``kv_cache``, ``block_tables``, ``context_lens`` and
    ``cu_seqlens_q`` objects (checked by identity). A call with a plan re-checks only what changes per
    layer: q's shape, dtype and strides, ``layer``, ``out``, ``sliding_window`` and ``softcap``. The plan
    does not depend on the window or softcap, so sliding and global layers share it.

    Capture contract (CUDA graphs of a decode bucket): a plan made with ``decode_only=True``,
    ``max_q_len=1`` and ``max_context_len=max_model_len`` reads nothing from the device, and its launch
    grids and split count follow from the bucket size ``N`` and ``max_model_len`` alone; it holds no
    work list, and its split-KV scratch (``partial``, ``lse``) is allocated once, here. Made once per
    bucket over static ``block_tables``/``context_lens``/``cu_seqlens_q`` buffers (rewritten in place
    between replays), every layer's launches are the same from replay to replay. Padding rows of a
    bucket may have ``q_len`` 0 (no rows, nothing written) or ``q_len`` 1 with ``context_len`` 0 (output 0).
    """

    kv_cache: torch.Tensor  # [num_pages, L, 2, page_size, Hkv, D]
    block_tables: torch.Tensor  # [N, max_pages] int32
    context_lens: torch.Tensor  # [N] int32
    cu_seqlens_q: torch.Tensor  # [N + 1] int32
    num_q_heads: int
    max_q_len: int
    max_context_len: int
    launch: _Plan | None  # None when there is nothing to attend (no new token or no cached key)
    work: torch.Tensor | None = None  # [num_items, 2] int32 (sequence, q block) on the device
    partial: torch.Tensor | None = None  # [num_splits, T, Hq, D] fp32 split outputs, shared by the layers
    lse: torch.Tensor | None = None  # [num_splits, T, Hq] fp32


def plan_attention(
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    num_q_heads: int,
    *,
    max_q_len: int | None = None,
    max_context_len: int | None = None,
    q_lens: Sequence[int] | None = None,
    num_tokens: int | None = None,
    decode_only: bool = False,
    kv_per_split: int | None = None,
    scratch: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> AttentionPlan:
    """Check one forward's attention inputs and plan the kernel launches, once for all layers.

    Args are those of :func:`paged_attention`; ``num_q_heads`` is the model's ``Hq``. ``q_lens`` (host
    ints, one per sequence) gives the work list where the caller knows the query lengths (the runner
    does); without them, and without ``decode_only``, this reads them (and the maxima) from the device
    once. ``num_tokens`` is ``T`` (from ``q_lens`` or ``cu_seqlens_q`` otherwise). ``decode_only``: every
    sequence has at most one new token (see the capture contract in :class:`AttentionPlan`).
    ``kv_per_split`` overrides :data:`KV_PER_SPLIT` (tests: splits on short contexts). ``scratch``: flat
    float32 buffers on the cache's device whose prefixes hold the split-KV partials and log-sum-exps in
    place of new ones (CUDA graphs of several buckets that replay one at a time share one:
    :func:`scratch_numel` sizes it). Raises ``ValueError`` on malformed inputs, naming the argument.
    """
    _check_batch(kv_cache, block_tables, context_lens, cu_seqlens_q)
    num_kv_heads = kv_cache.shape[4]
    if num_q_heads < 1 or num_q_heads % num_kv_heads != 0:
        raise ValueError(f"q heads ({num_q_heads}) must be a multiple of kv_cache heads ({num_kv_heads})")
    if kv_per_split is None:
        kv_per_split = KV_PER_SPLIT
    elif (
        isinstance(kv_per_split, bool)
        or not isinstance(kv_per_split, int)
        or kv_per_split < 1
        or (kv_per_split % 64)
    ):
        raise ValueError(f"kv_per_split must be a positive multiple of 64 tokens, got {kv_per_split!r}")
    num_seqs = context_lens.shape[0]
    if q_lens is not None:
        q_lens = list(q_lens)
        if len(q_lens) != num_seqs:
            raise ValueError(f"q_lens has {len(q_lens)} entries for {num_seqs} sequences")
    elif max_q_len == 1:
        decode_only = True  # the host maximum says so: nothing to read
    elif not decode_only:
        q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).tolist()
    if decode_only:
        if q_lens is not None and max(q_lens, default=0) > 1:
            raise ValueError("decode_only: a sequence has more than one new token")
        max_q_len = 1 if max_q_len is None else max_q_len
        q_lens = None
    elif max_q_len is None:
        max_q_len = max(q_lens, default=0)
    if max_context_len is None:
        max_context_len = int(context_lens.max().item()) if num_seqs else 0
    if num_tokens is None:  # a decode-only plan sizes its scratch for one token per sequence
        num_tokens = sum(q_lens) if q_lens is not None else num_seqs
    if max_q_len <= 0 or max_context_len <= 0 or num_tokens == 0:
        return AttentionPlan(
            kv_cache, block_tables, context_lens, cu_seqlens_q, num_q_heads, max_q_len, max_context_len, None
        )
    head_dim = kv_cache.shape[5]
    launch, items = _plan(
        q_lens, num_seqs, num_q_heads, num_kv_heads, head_dim, max_context_len, kv_cache.dtype, kv_per_split
    )
    if launch.num_splits > _MAX_GRID_YZ:
        raise ValueError(
            f"max_context_len: {launch.num_splits} KV splits of {kv_per_split} tokens exceed the grid "
            f"limit {_MAX_GRID_YZ}"
        )
    device = kv_cache.device
    work = None
    if items:
        host = torch.tensor(items, dtype=torch.int32)
        work = host if device.type == "cpu" else host.pin_memory().to(device, non_blocking=True)
    partial = lse = None
    if launch.num_splits > 1:
        shape = (launch.num_splits, num_tokens, num_q_heads)
        if scratch is None:
            partial = torch.empty((*shape, head_dim), dtype=torch.float32, device=device)
            lse = torch.empty(shape, dtype=torch.float32, device=device)
        else:
            partial, lse = _scratch_views(scratch, (*shape, head_dim), shape, device)
    return AttentionPlan(
        kv_cache,
        block_tables,
        context_lens,
        cu_seqlens_q,
        num_q_heads,
        max_q_len,
        max_context_len,
        launch,
        work,
        partial,
        lse,
    )


def scratch_numel(plan: AttentionPlan, num_tokens: int) -> tuple[int, int]:
    """Elements of the two ``scratch`` buffers that hold ``plan``'s split-KV partials and log-sum-exps for
    ``num_tokens`` tokens (its splits, heads and head_dim); (0, 0) where the plan does not split."""
    if plan.partial is None:
        return 0, 0
    splits, _, heads, head_dim = plan.partial.shape
    return splits * num_tokens * heads * head_dim, splits * num_tokens * heads


def _scratch_views(
    scratch: tuple[torch.Tensor, torch.Tensor], partial_shape: tuple, lse_shape: tuple, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    views = []
    for name, buffer, shape in (("partial", scratch[0], partial_shape), ("lse", scratch[1], lse_shape)):
        need = math.prod(shape)
        if buffer.dtype != torch.float32 or buffer.dim() != 1 or buffer.device != device:
            raise ValueError(
                f"scratch: its {name} buffer must be flat float32 on {device}, got {buffer.dtype} "
                f"{tuple(buffer.shape)} on {buffer.device}"
            )
        if buffer.numel() < need:
            raise ValueError(
                f"scratch: its {name} buffer holds {buffer.numel()} elements, this plan needs {need}"
            )
        views.append(buffer[:need].view(shape))
    return views[0], views[1]


def _checked_plan(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    out: torch.Tensor | None,
    sliding_window: int | None,
    softcap: float | None,
    max_q_len: int | None,
    max_context_len: int | None,
    kv_per_split: int | None,
    plan: AttentionPlan | None,
) -> AttentionPlan:
    """The plan for this call: the given one after the per-layer checks, or a fresh one after all checks."""
    _check_q(q)
    if plan is None:
        _check_batch(kv_cache, block_tables, context_lens, cu_seqlens_q)
    elif not (
        plan.kv_cache is kv_cache
        and plan.block_tables is block_tables
        and plan.context_lens is context_lens
        and plan.cu_seqlens_q is cu_seqlens_q
    ):
        raise ValueError("plan was made for other kv_cache/block_tables/context_lens/cu_seqlens_q tensors")
    elif q.shape[1] != plan.num_q_heads:
        raise ValueError(f"q heads ({q.shape[1]}) differ from the plan's ({plan.num_q_heads})")
    _check_call(q, kv_cache, layer, out, sliding_window, softcap)
    if plan is None:
        plan = plan_attention(
            kv_cache,
            block_tables,
            context_lens,
            cu_seqlens_q,
            q.shape[1],
            max_q_len=max_q_len,
            max_context_len=max_context_len,
            kv_per_split=kv_per_split,
        )
    return plan


def paged_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    scale: float,
    *,
    sliding_window: int | None = None,
    softcap: float | None = None,
    max_q_len: int | None = None,
    max_context_len: int | None = None,
    out: torch.Tensor | None = None,
    kv_per_split: int | None = None,
    plan: AttentionPlan | None = None,
) -> torch.Tensor:
    """Attention of packed new tokens over their sequences' cached K/V (Triton).

    Args:
        q: ``[T, Hq, D]`` fp16/bf16/fp32, the queries of N sequences packed back to back.
        kv_cache: ``[num_pages, L, 2, page_size, Hkv, D]`` view of the arena, same dtype as q; any page
            stride, contiguous in D.
        layer: which layer of the cache to read.
        block_tables: ``[N, max_pages]`` int32 page ids; entries past a sequence's pages, and those of
            pages wholly before every window of the sequence, are never read.
        context_lens: ``[N]`` int32 cached tokens per sequence, including the new ones.
        cu_seqlens_q: ``[N + 1]`` int32 offsets of each sequence's rows in q.
        scale: softmax scale (usually ``D ** -0.5``).
        sliding_window: this layer's window ``w`` (position ``p`` sees keys ``p - w < k <= p``); None = all.
        softcap: this layer's attention logit softcap ``c`` (scores ``c * tanh(s / c)``); None = none.
        max_q_len, max_context_len: host-side maxima of the query and context lengths; pass them to
            avoid a device sync.
        out: optional ``[T, Hq, D]`` output buffer (same dtype as q).
        kv_per_split: keys per split-KV partition (a multiple of 64); ``None`` is :data:`KV_PER_SPLIT`.
            A sequence's keys are split from its own first key, so its output does not depend on the
            other sequences of the launch (bit for bit).
        plan: from :func:`plan_attention` for this forward; skips the batch checks and the launch
            planning, and supersedes ``max_q_len``, ``max_context_len`` and ``kv_per_split``.

    Returns:
        ``out``, ``[T, Hq, D]`` in q.dtype.
    """
    plan = _checked_plan(
        q,
        kv_cache,
        layer,
        block_tables,
        context_lens,
        cu_seqlens_q,
        out,
        sliding_window,
        softcap,
        max_q_len,
        max_context_len,
        kv_per_split,
        plan,
    )
    interpreted = q.device.type != "cuda"
    if interpreted and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"paged_attention runs on CUDA tensors (q is on {q.device}); use paged_attention_ref on CPU "
            "or set TRITON_INTERPRET=1 before importing triton"
        )
    if out is None:
        out = torch.empty_like(q)
    num_tokens, num_q_heads, head_dim = q.shape
    launch = plan.launch
    if num_tokens == 0 or launch is None:
        return out

    num_kv_heads = kv_cache.shape[4]
    num_splits = launch.num_splits
    split_kv = num_splits > 1
    if split_kv:
        partial, lse = plan.partial, plan.lse
        if partial.shape[1] < num_tokens:
            raise ValueError(f"q has {num_tokens} rows, the plan's split-KV scratch {partial.shape[1]}")
        o_buf, o_split_stride, lse_strides = partial, partial.stride(0), lse.stride()[:2]
    else:
        lse = out  # unused by the kernel when SPLIT_KV is off
        o_buf, o_split_stride, lse_strides = out, 0, (0, 0)
    work = plan.work if plan.work is not None else context_lens  # unread by a decode-only launch

    # With a softcap the kernel needs s = q.k * scale / c for tanh, then c * log2(e) for base 2.
    qk_scale = scale / softcap if softcap is not None else scale * _LOG2E
    layer_cache = kv_cache[:, layer]
    for item in launch.launches:
        cfg = item.config
        _paged_attention_kernel[(item.num_items, num_kv_heads, num_splits)](
            q,
            layer_cache,
            block_tables,
            context_lens,
            cu_seqlens_q,
            work,
            o_buf,
            lse,
            qk_scale,
            (softcap or 1.0) * _LOG2E,
            sliding_window or 0,
            item.item_offset,
            launch.kv_per_split,
            q.stride(0),
            q.stride(1),
            kv_cache.stride(0),
            kv_cache.stride(2),
            kv_cache.stride(3),
            kv_cache.stride(4),
            block_tables.stride(0),
            block_tables.stride(1),
            o_split_stride,
            o_buf.stride(-3),
            o_buf.stride(-2),
            *lse_strides,
            HEAD_DIM=head_dim,
            BLOCK_D=launch.block_d,
            GROUP=num_q_heads // num_kv_heads,
            BLOCK_M=cfg.block_m,
            BLOCK_Q=item.block_q,
            BLOCK_N=cfg.block_n,
            PAGE_SIZE=kv_cache.shape[3],
            SPLIT_KV=split_kv,
            HAS_WINDOW=sliding_window is not None,
            SOFTCAP=softcap is not None,
            DECODE=item.decode,
            DOT_FP32=interpreted and q.dtype == torch.bfloat16,
            DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )
    if split_kv:
        _split_kv_reduce_kernel[(num_tokens, num_q_heads)](
            partial,
            lse,
            out,
            num_splits,
            partial.stride(0),
            partial.stride(1),
            partial.stride(2),
            lse.stride(0),
            lse.stride(1),
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            BLOCK_D=launch.block_d,
            num_warps=4,
        )
    return out


def paged_attention_ref(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    scale: float,
    *,
    sliding_window: int | None = None,
    softcap: float | None = None,
    max_q_len: int | None = None,
    max_context_len: int | None = None,
    out: torch.Tensor | None = None,
    kv_per_split: int | None = None,
    plan: AttentionPlan | None = None,
) -> torch.Tensor:
    """Pure-torch paged attention (same signature and checks as :func:`paged_attention`; the test oracle).

    Gathers each sequence's pages (from the first one its window reaches) with one indexing op and
    attends in float32 with the causal offset of the new tokens: ``scaled_dot_product_attention`` without
    a softcap, explicit softmax with one (SDPA has none). Loops over sequences only. ``max_q_len``,
    ``max_context_len``, ``kv_per_split`` and ``plan`` serve the checks only.
    """
    _checked_plan(
        q,
        kv_cache,
        layer,
        block_tables,
        context_lens,
        cu_seqlens_q,
        out,
        sliding_window,
        softcap,
        max_q_len,
        max_context_len,
        kv_per_split,
        plan,
    )
    if out is None:
        out = torch.empty_like(q)
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    page_size, num_kv_heads = kv_cache.shape[3], kv_cache.shape[4]
    group = num_q_heads // num_kv_heads
    layer_cache = kv_cache[:, layer]  # [num_pages, 2, page_size, Hkv, D]
    cu = cu_seqlens_q.tolist()
    ctx = context_lens.tolist()
    tables = block_tables.to(device=kv_cache.device, dtype=torch.long)
    if (
        q.shape[0] == len(ctx)
        and cu[-1] == len(ctx)
        and all(b - a == 1 for a, b in zip(cu, cu[1:], strict=False))
    ):
        o = _decode_ref_batched(q, layer_cache, tables, context_lens, ctx, scale, sliding_window, softcap)
        out.copy_(o)
        return out
    for n, ctx_len in enumerate(ctx):
        q_lo, q_hi = cu[n], cu[n + 1]
        q_len = q_hi - q_lo
        if q_len == 0:
            continue
        # Keys before the first new token's window are never read (their pages may be recycled).
        lo = 0 if sliding_window is None else max(0, ctx_len - q_len - sliding_window + 1)
        first_page = lo // page_size
        pages = tables[n, first_page : _cdiv(ctx_len, page_size)]
        kv = layer_cache.index_select(0, pages).float()  # [pages, 2, page_size, Hkv, D]
        keys = slice(lo - first_page * page_size, ctx_len - first_page * page_size)
        k = kv[:, 0].reshape(-1, num_kv_heads, head_dim)[keys].transpose(0, 1)  # [Hkv, ctx - lo, D]
        v = kv[:, 1].reshape(-1, num_kv_heads, head_dim)[keys].transpose(0, 1)
        # GQA without copying K/V per q head: a group's heads become extra query rows ([Hkv, G * q_len, D]),
        # several times faster on CPU than repeat_interleave or enable_gqa.
        qn = q[q_lo:q_hi].float().transpose(0, 1).reshape(num_kv_heads, group * q_len, head_dim)
        mask = None
        if q_len > 1 or sliding_window is not None:
            q_pos = torch.arange(ctx_len - q_len, ctx_len, device=q.device)[:, None]
            k_pos = torch.arange(lo, ctx_len, device=q.device)[None, :]
            mask = k_pos <= q_pos
            if sliding_window is not None:
                mask &= k_pos > q_pos - sliding_window
            mask = mask.repeat(group, 1)
        o = _attend(qn, k, v, mask, scale, softcap)
        out[q_lo:q_hi] = o.view(num_q_heads, q_len, head_dim).transpose(0, 1).to(q.dtype)
    return out


def _attend(
    q: torch.Tensor,  # [..., M, D] float32
    k: torch.Tensor,  # [..., S, D]
    v: torch.Tensor,  # [..., S, D]
    mask: torch.Tensor | None,  # [..., M, S] bool, True = visible
    scale: float,
    softcap: float | None,
) -> torch.Tensor:
    """``softmax(mask(cap(q k^T * scale))) v`` with Gemma 2's eager order of operations for the softcap."""
    if softcap is None:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    scores = torch.tanh(q @ k.transpose(-1, -2) * scale / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def _decode_ref_batched(
    q: torch.Tensor,  # [N, Hq, D], one new token per sequence
    layer_cache: torch.Tensor,  # [num_pages, 2, page_size, Hkv, D]
    tables: torch.Tensor,  # [N, max_pages] int64
    context_lens: torch.Tensor,  # [N]
    ctx: list[int],
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """All-decode batches in one attention call over contexts padded to the longest (and widest window).

    Positions not read from a sequence's own pages (past its context, or in pages before its window) are
    zeroed before the matmuls: that memory is arbitrary, and a NaN there would survive a -inf mask
    (``0 * NaN``).
    """
    num_seqs, num_q_heads, head_dim = q.shape
    page_size, num_kv_heads = layer_cache.shape[2], layer_cache.shape[3]
    group = num_q_heads // num_kv_heads
    lens = context_lens.to(device=tables.device, dtype=torch.long)[:, None]  # [N, 1]
    if sliding_window is None:
        first_page = torch.zeros_like(lens)
    else:
        # The first page the new token's window reaches.
        first_page = (lens - sliding_window).clamp_min(0) // page_size
    lo_page = int(first_page.min())
    cols = torch.arange(lo_page, _cdiv(max(ctx), page_size), device=tables.device)[None, :]
    width = cols.shape[1] * page_size
    read = (cols >= first_page) & (cols * page_size < lens)  # [N, pages]: the entries this sequence owns
    # Table entries outside them are arbitrary (or recycled): point them at page 0, zeroed below.
    pages = torch.where(read, tables[:, lo_page : lo_page + cols.shape[1]], 0)
    k_pos = lo_page * page_size + torch.arange(width, device=tables.device)[None, :]  # [1, width]
    readable = read.repeat_interleave(page_size, dim=1) & (k_pos < lens)  # [N, width]
    visible = readable if sliding_window is None else readable & (k_pos > lens - 1 - sliding_window)
    unread = ~readable.to(q.device)[:, :, None, None]
    flat_pages = pages.reshape(-1).to(layer_cache.device)
    # K and V gathered separately: each lands as [N, width, Hkv, D] with no further copy.
    k, v = (
        layer_cache[:, i].index_select(0, flat_pages).view(num_seqs, width, num_kv_heads, head_dim).float()
        for i in (0, 1)
    )
    k = k.masked_fill_(unread, 0.0).permute(0, 2, 1, 3)  # [N, Hkv, width, D]
    v = v.masked_fill_(unread, 0.0).permute(0, 2, 1, 3)
    qn = q.float().view(num_seqs, num_kv_heads, group, head_dim)  # a group's heads as query rows
    mask = visible.to(q.device)[:, None, None, :]  # [N, 1, 1, width]
    o = _attend(qn, k, v, mask, scale, softcap)
    return o.reshape(num_seqs, num_q_heads, head_dim).to(q.dtype)
