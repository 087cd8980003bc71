"""Fallbacks of the two cache ops for a CUDA torch without the compiled CUDA kernels (built without nvcc):
``reshape_and_cache`` as a Triton kernel, ``copy_pages`` as torch copies. Same contracts, same bytes as
``torch.ops.oppo.*`` (csrc/); both run on the caller's current stream. Tested on the CPU against the C++ op
(Triton under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,  # [T, H, D]
    value_ptr,  # [T, H, D]
    cache_ptr,  # [num_pages, 2, page_size, H, D] (one layer of a model's view)
    slot_ptr,  # [T] int64, -1 = skip
    num_heads,
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_c_page,
    stride_c_kv,
    stride_c_slot,
    stride_c_head,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    tok = tl.program_id(0)
    slot = tl.load(slot_ptr + tok)
    if slot < 0:
        return
    page = slot // PAGE_SIZE
    heads = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (heads < num_heads)[:, None] & (offs_d < HEAD_DIM)[None, :]
    tok64 = tok.to(tl.int64)
    src = heads[:, None] * stride_k_head + offs_d[None, :]
    k = tl.load(key_ptr + tok64 * stride_k_tok + src, mask=mask)
    v = tl.load(
        value_ptr + tok64 * stride_v_tok + heads[:, None] * stride_v_head + offs_d[None, :], mask=mask
    )
    # NOTE: the arena can exceed 2**31 elements: page offsets in int64.
    dst = cache_ptr + page * stride_c_page + (slot % PAGE_SIZE) * stride_c_slot
    dst = dst + heads[:, None] * stride_c_head + offs_d[None, :]
    tl.store(dst, k, mask=mask)
    tl.store(dst + stride_c_kv, v, mask=mask)


def _check_reshape_and_cache(key, value, kv_cache, slot_mapping, layer) -> None:
    """The C++ op's argument checks (``csrc/cache_ops_cpu.cpp``), with its messages."""
    if kv_cache.dim() != 6 or kv_cache.shape[2] != 2:
        raise ValueError(
            f"reshape_and_cache: kv_cache must be [num_pages, L, 2, page_size, H, D], got {kv_cache.shape}"
        )
    if key.dim() != 3 or key.shape != value.shape:
        raise ValueError(
            f"reshape_and_cache: key and value must both be [T, H, D], got {key.shape} and {value.shape}"
        )
    if key.shape[1:] != kv_cache.shape[4:]:
        raise ValueError(
            f"reshape_and_cache: key heads/head_dim {key.shape} do not match kv_cache {kv_cache.shape}"
        )
    if key.dtype != kv_cache.dtype or value.dtype != kv_cache.dtype:
        raise ValueError(f"reshape_and_cache: key/value dtype must equal kv_cache dtype {kv_cache.dtype}")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(
            f"reshape_and_cache: slot_mapping must be [T] with T = {key.shape[0]}, got {slot_mapping.shape}"
        )
    if slot_mapping.dtype != torch.int64:
        raise ValueError("reshape_and_cache: slot_mapping must be int64")
    if isinstance(layer, bool) or not 0 <= layer < kv_cache.shape[1]:
        raise ValueError(f"reshape_and_cache: layer {layer} outside [0, {kv_cache.shape[1]})")
    if key.stride(2) != 1 or value.stride(2) != 1:
        raise ValueError("reshape_and_cache: key/value last dim must be contiguous")
    if kv_cache.stride(5) != 1:
        raise ValueError("reshape_and_cache: kv_cache last dim must be contiguous")
    for t in (key, value, slot_mapping):
        if t.device != kv_cache.device:
            raise ValueError(
                f"reshape_and_cache: all tensors must be on {kv_cache.device}, got one on {t.device}"
            )


def reshape_and_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor, layer: int
) -> None:
    """``torch.ops.oppo.reshape_and_cache`` in Triton: K/V ``[T, H, D]`` into ``kv_cache`` at ``slot_mapping``
    (``-1`` skips). Slots are not range-checked on the device (as in the CUDA op: a check would sync)."""
    _check_reshape_and_cache(key, value, kv_cache, slot_mapping, layer)
    num_tokens, num_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    cache = kv_cache[:, layer]
    _reshape_and_cache_kernel[(num_tokens,)](
        key,
        value,
        cache,
        slot_mapping,
        num_heads,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        cache.stride(0),
        cache.stride(1),
        cache.stride(2),
        cache.stride(3),
        PAGE_SIZE=kv_cache.shape[3],
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )


def _check_copy_pages(src, dst, src_ids, dst_ids) -> tuple[list[int], list[int]]:
    if src.dim() != 2 or dst.dim() != 2 or src.shape[1] != dst.shape[1]:
        raise ValueError(
            "copy_pages: src and dst must be [P, page_bytes] with equal page_bytes, "
            f"got {src.shape} and {dst.shape}"
        )
    if src.dtype != torch.uint8 or dst.dtype != torch.uint8:
        raise ValueError("copy_pages: src and dst must be uint8 page views")
    if src.stride(1) != 1 or dst.stride(1) != 1:
        raise ValueError("copy_pages: a page's bytes must be contiguous")
    if src_ids.dim() != 1 or dst_ids.dim() != 1 or src_ids.shape[0] != dst_ids.shape[0]:
        raise ValueError(
            "copy_pages: src_ids and dst_ids must be [n] of equal length, "
            f"got {src_ids.shape} and {dst_ids.shape}"
        )
    if src_ids.dtype != torch.int64 or dst_ids.dtype != torch.int64:
        raise ValueError("copy_pages: page ids must be int64")
    if src_ids.device.type != "cpu" or dst_ids.device.type != "cpu":
        raise ValueError("copy_pages: page ids must be on the CPU")
    s, d = src_ids.tolist(), dst_ids.tolist()
    for name, ids, limit in (("src_ids", s, src.shape[0]), ("dst_ids", d, dst.shape[0])):
        for i, p in enumerate(ids):
            if not 0 <= p < limit:
                raise ValueError(f"copy_pages: {name}[{i}] = {p} outside [0, {limit})")
    return s, d


def copy_pages(src: torch.Tensor, dst: torch.Tensor, src_ids: torch.Tensor, dst_ids: torch.Tensor) -> None:
    """``torch.ops.oppo.copy_pages`` with torch copies: page ``src_ids[i]`` of ``src`` onto page
    ``dst_ids[i]`` of ``dst``, in order (as the C++ op's per-page copies). Asynchronous on the current
    stream where one side is pinned host memory or both are on the device. Runs of consecutive ids
    between two different buffers go as one copy each."""
    s, d = _check_copy_pages(src, dst, src_ids, dst_ids)
    same = src.untyped_storage().data_ptr() == dst.untyped_storage().data_ptr()
    i, n = 0, len(s)
    while i < n:
        j = i + 1
        while not same and j < n and s[j] == s[j - 1] + 1 and d[j] == d[j - 1] + 1:
            j += 1
        dst[d[i] : d[i] + j - i].copy_(src[s[i] : s[i] + j - i], non_blocking=True)
        i = j
