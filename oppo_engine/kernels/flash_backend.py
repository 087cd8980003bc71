"""Optional attention backend: flash-attn's paged varlen path over the same cache layout.

Selected with ``EngineConfig(attention_backend="flash_attn")``. Used only where ``flash_attn`` imports, on
CUDA, and where the page size suits it (flash-attn 2 needs paged blocks of a multiple of 256 tokens).
The cache view's K and V of one layer are ``[num_pages, page_size, Hkv, D]`` with a page stride larger
than the page, which flash-attn takes as given (it needs only the head dim contiguous).
"""

from __future__ import annotations

import torch

from .paged_attention import AttentionPlan

FLASH_PAGE_MULTIPLE = 256


def unavailable_reason(page_size: int, device: torch.device) -> str | None:
    """Why the backend cannot serve this cache, or None when it can."""
    if device.type != "cuda":
        return f"flash_attn needs a CUDA device, the models are on {device}"
    try:
        import flash_attn  # noqa: F401
    except ImportError as e:
        return f"flash_attn does not import ({e})"
    if page_size % FLASH_PAGE_MULTIPLE:
        return (
            f"flash_attn's paged path needs page_size to be a multiple of {FLASH_PAGE_MULTIPLE}, "
            f"got {page_size}"
        )
    return None


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
    plan: AttentionPlan | None = None,
) -> torch.Tensor:
    """Same contract as ``oppo_engine.kernels.paged_attention.paged_attention``.

    flash-attn aligns the causal mask bottom-right when ``q_len < context_len``, which is exactly the
    engine's rule (new token ``i`` sits at ``context_len - q_len + i``). Its ``window_size=(left, right)``
    lets query ``p`` see keys ``p - left .. p + right``, so HF's window ``w`` (keys ``p - w < k <= p``)
    is ``(w - 1, 0)``; ``(-1, -1)`` is no window. Its ``softcap`` is Gemma 2's (``c * tanh(s / c)`` on the
    scaled scores, before the mask); ``0.0`` is none. ``plan`` only supplies the host maxima.
    """
    from flash_attn import flash_attn_varlen_func

    if plan is not None:
        max_q_len, max_context_len = plan.max_q_len, plan.max_context_len
    if max_q_len is None:
        max_q_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    if max_context_len is None:
        max_context_len = int(context_lens.max())
    cu_seqlens_k = torch.nn.functional.pad(context_lens.cumsum(0, dtype=torch.int32), (1, 0))
    return flash_attn_varlen_func(
        q,
        kv_cache[:, layer, 0],
        kv_cache[:, layer, 1],
        cu_seqlens_q,
        cu_seqlens_k,
        max_q_len,
        max_context_len,
        softmax_scale=scale,
        causal=True,
        window_size=(sliding_window - 1, 0) if sliding_window is not None else (-1, -1),
        softcap=softcap if softcap is not None else 0.0,
        block_table=block_tables,
    )
