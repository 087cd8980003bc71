"""Paged-attention test cases shared by the Triton kernel's and the C++ CPU op's tests.

Every cache is built the way the arena builds it: a uint8 byte buffer viewed through ``as_strided`` as
``[num_pages, L, 2, page_size, Hkv, D]``. Everything a correct implementation must not read is NaN --
padding bytes between pages, pages no sequence owns, slots past a sequence's context, the other layer, and
block-table entries past a sequence's pages (or wholly before its windows) point at NaN pages.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NUM_LAYERS, LAYER = 2, 1


@dataclass
class Case:
    q: torch.Tensor  # [T, Hq, D]
    kv_cache: torch.Tensor  # [num_pages, L, 2, page_size, Hkv, D] strided view of a byte arena
    block_tables: torch.Tensor  # [N, max_pages] int32
    context_lens: torch.Tensor  # [N] int32
    cu_seqlens_q: torch.Tensor  # [N + 1] int32
    scale: float

    def args(self) -> tuple:
        return (
            self.q,
            self.kv_cache,
            LAYER,
            self.block_tables,
            self.context_lens,
            self.cu_seqlens_q,
            self.scale,
        )


def make_case(
    seqs: list[tuple[int, int]],
    num_q_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    dtype: torch.dtype = torch.float32,
    page_size: int = 16,
    page_pad_bytes: int = 0,
    seed: int = 0,
    window: int | None = None,
) -> Case:
    """Random case for sequences given as (q_len, context_len), pages scattered in shuffled order.

    With ``window``, the block-table entries of pages wholly before every window of a sequence point at
    NaN pages: an implementation that reads them fails.
    """
    gen = torch.Generator().manual_seed(seed)
    itemsize = torch.empty((), dtype=dtype).element_size()
    pages_per_seq = [math.ceil(ctx / page_size) for _, ctx in seqs]
    num_pages = sum(pages_per_seq) + 3  # spare pages stay NaN
    layer_elems = 2 * page_size * num_kv_heads * head_dim
    page_bytes = NUM_LAYERS * layer_elems * itemsize + page_pad_bytes
    assert page_bytes % itemsize == 0
    arena = torch.empty(num_pages * page_bytes, dtype=torch.uint8, device=DEVICE)
    arena.view(dtype).fill_(float("nan"))
    kv_cache = arena.view(dtype).as_strided(
        (num_pages, NUM_LAYERS, 2, page_size, num_kv_heads, head_dim),
        (page_bytes // itemsize, layer_elems, layer_elems // 2, num_kv_heads * head_dim, head_dim, 1),
    )

    page_ids = torch.randperm(num_pages, generator=gen)
    spare = page_ids[sum(pages_per_seq) :]
    max_pages = max(pages_per_seq) + 2
    # Entries past a sequence's pages are arbitrary: make them NaN pages so reading one shows.
    block_tables = spare[torch.randint(len(spare), (len(seqs), max_pages), generator=gen)].to(torch.int32)
    next_page = 0
    for n, (_, ctx) in enumerate(seqs):
        ids = page_ids[next_page : next_page + pages_per_seq[n]]
        next_page += pages_per_seq[n]
        block_tables[n, : len(ids)] = ids.to(torch.int32)
        values = torch.randn((len(ids), 2, page_size, num_kv_heads, head_dim), generator=gen).to(dtype)
        values[-1, :, ctx - (len(ids) - 1) * page_size :] = float("nan")  # slots past the context
        kv_cache[ids.to(DEVICE), LAYER] = values.to(DEVICE)
        if window is not None:
            q_len = seqs[n][0]
            skipped = max(0, ctx - q_len - window + 1) // page_size
            block_tables[n, :skipped] = spare[torch.randint(len(spare), (skipped,), generator=gen)].to(
                torch.int32
            )

    q_lens = torch.tensor([q_len for q_len, _ in seqs])
    cu_seqlens_q = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    cu_seqlens_q[1:] = torch.cumsum(q_lens, 0)
    q = torch.randn((int(cu_seqlens_q[-1]), num_q_heads, head_dim), generator=gen).to(dtype)
    return Case(
        q=q.to(DEVICE),
        kv_cache=kv_cache,
        block_tables=block_tables.to(DEVICE),
        context_lens=torch.tensor([ctx for _, ctx in seqs], dtype=torch.int32, device=DEVICE),
        cu_seqlens_q=cu_seqlens_q.to(DEVICE),
        scale=head_dim**-0.5,
    )


def dense_causal_attention_f64(
    case: Case, window: int | None = None, softcap: float | None = None
) -> torch.Tensor:
    """Independent oracle: token-by-token page walk, explicit softmax in float64, HF's window and softcap."""
    q = case.q.double().cpu()
    kv = case.kv_cache[:, LAYER].double().cpu()
    page_size = kv.shape[2]
    group = q.shape[1] // kv.shape[3]
    out = torch.empty_like(q)
    cu = case.cu_seqlens_q.tolist()
    for n, ctx in enumerate(case.context_lens.tolist()):
        q_len = cu[n + 1] - cu[n]
        for i in range(q_len):
            pos = ctx - q_len + i
            # transformers' sliding_window_overlay: key k is visible iff k > pos - window (and k <= pos).
            keys = [t for t in range(pos + 1) if window is None or t > pos - window]
            slots = [(int(case.block_tables[n, t // page_size]), t % page_size) for t in keys]
            k = torch.stack([kv[p, 0, o] for p, o in slots]).repeat_interleave(group, dim=1)  # [keys, Hq, D]
            v = torch.stack([kv[p, 1, o] for p, o in slots]).repeat_interleave(group, dim=1)
            scores = torch.einsum("hd,thd->ht", q[cu[n] + i], k) * case.scale
            if softcap is not None:  # gemma2's eager_attention_forward, before the mask
                scores = torch.tanh(scores / softcap) * softcap
            out[cu[n] + i] = torch.einsum("ht,thd->hd", torch.softmax(scores, dim=-1), v)
    return out
