"""Microbenchmarks of the page allocator and the cache ops, each beside the baseline a user would write.

    make bench        # or: python -m pytest bench --benchmark-only

The cache ops use a 7B-shaped layer (H=8 KV heads, D=128, bf16, 16 tokens per page); the op writes one
layer, so the model's depth only sets the page stride (L=4 here keeps the arena at 40 MiB). Page tables are
scattered, as they are after a few steps of allocation and preemption.
"""

from __future__ import annotations

import threading

import pytest
import torch

from oppo_engine import ops

NUM_PAGES = 4096
LAYERS, HEADS, HEAD_DIM, PAGE_SIZE, DTYPE = 4, 8, 128, 16, torch.bfloat16
CACHE_PAGES = 160  # room for the 2048-token case (128 pages) in a scattered page table
PAGE_BYTES = LAYERS * 2 * PAGE_SIZE * HEADS * HEAD_DIM * DTYPE.itemsize

DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda", marks=pytest.mark.cuda),
]


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


# --- allocator ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 64])
def test_allocator_alloc_free(benchmark, n):
    alloc = ops.PageAllocator(NUM_PAGES)
    benchmark(lambda: alloc.free(alloc.alloc(n)))
    assert alloc.num_free() == NUM_PAGES


def _alloc_free_loop(alloc: ops.PageAllocator, n: int, iters: int) -> None:
    for _ in range(iters):
        alloc.free(alloc.alloc(n))


@pytest.mark.parametrize("threads", [1, 2], ids=["one_thread", "two_threads_contending"])
def test_allocator_alloc_free_threads(benchmark, threads):
    """Equal work per thread (2000 alloc/free pairs of one page) on one thread and on two sharing a lock."""
    alloc, iters = ops.PageAllocator(NUM_PAGES), 2000
    benchmark.extra_info["calls"] = 2 * iters * threads

    def run() -> None:
        workers = [threading.Thread(target=_alloc_free_loop, args=(alloc, 1, iters)) for _ in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()

    benchmark(run)
    assert alloc.num_free() == NUM_PAGES


# --- reshape_and_cache ------------------------------------------------------------------------------------


def _cache_inputs(num_tokens: int, device: str):
    gen = torch.Generator().manual_seed(num_tokens)
    kv_cache = torch.empty(CACHE_PAGES, LAYERS, 2, PAGE_SIZE, HEADS, HEAD_DIM, dtype=DTYPE, device=device)
    key = torch.randn(num_tokens, HEADS, HEAD_DIM, generator=gen).to(device=device, dtype=DTYPE)
    value = torch.randn(num_tokens, HEADS, HEAD_DIM, generator=gen).to(device=device, dtype=DTYPE)
    page_table = torch.randperm(CACHE_PAGES, generator=gen)
    positions = torch.arange(num_tokens) + 5  # a chunk that starts inside a page
    pages, offsets = page_table[positions // PAGE_SIZE], positions % PAGE_SIZE
    slots = (pages * PAGE_SIZE + offsets).to(device)
    return kv_cache, key, value, slots, pages.to(device), offsets.to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_tokens", [1, 64, 2048])
def test_reshape_and_cache(benchmark, device, num_tokens):
    kv_cache, key, value, slots, _, _ = _cache_inputs(num_tokens, device)
    benchmark.extra_info["bytes"] = 2 * key.numel() * key.element_size()

    def run() -> None:
        ops.reshape_and_cache(key, value, kv_cache, slots, 1)
        _sync(device)

    benchmark(run)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_tokens", [1, 64, 2048])
def test_reshape_and_cache_baseline_index_put(benchmark, device, num_tokens):
    """What one would write without the op: two advanced-index assignments (no -1 padding support)."""
    kv_cache, key, value, _, pages, offsets = _cache_inputs(num_tokens, device)

    def run() -> None:
        kv_cache[pages, 1, 0, offsets] = key
        kv_cache[pages, 1, 1, offsets] = value
        _sync(device)

    benchmark(run)


# --- copy_pages -------------------------------------------------------------------------------------------

COPY_CASES = [
    pytest.param("cpu", "cpu", id="cpu_to_cpu"),
    pytest.param("cuda", "cuda", id="cuda_to_cuda", marks=pytest.mark.cuda),
    pytest.param("cuda", "pinned", id="cuda_to_pinned_host", marks=pytest.mark.cuda),
]


def _copy_inputs(src_device: str, dst_kind: str, num_pages: int = 64):
    gen = torch.Generator().manual_seed(0)
    src = torch.randint(0, 256, (CACHE_PAGES, PAGE_BYTES), dtype=torch.uint8, generator=gen).to(src_device)
    if dst_kind == "pinned":
        dst = torch.empty(num_pages, PAGE_BYTES, dtype=torch.uint8, pin_memory=True)
    else:
        dst = torch.empty(CACHE_PAGES, PAGE_BYTES, dtype=torch.uint8, device=dst_kind)
    src_ids = torch.randperm(CACHE_PAGES, generator=gen)[:num_pages]
    dst_ids = torch.randperm(dst.shape[0], generator=gen)[:num_pages]
    return src, dst, src_ids, dst_ids


@pytest.mark.parametrize("src_device,dst_kind", COPY_CASES)
def test_copy_pages_64(benchmark, src_device, dst_kind):
    src, dst, src_ids, dst_ids = _copy_inputs(src_device, dst_kind)
    benchmark.extra_info["bytes"] = 64 * PAGE_BYTES

    def run() -> None:
        ops.copy_pages(src, dst, src_ids, dst_ids)
        _sync(src_device)

    benchmark(run)


@pytest.mark.parametrize("src_device,dst_kind", COPY_CASES)
def test_copy_pages_64_baseline_index_copy(benchmark, src_device, dst_kind):
    """What one would write without the op: gather the pages, then scatter them (one extra buffer)."""
    src, dst, src_ids, dst_ids = _copy_inputs(src_device, dst_kind)
    src_index, dst_index = src_ids.to(src.device), dst_ids.to(dst.device)

    def run() -> None:
        dst.index_copy_(0, dst_index, src.index_select(0, src_index).to(dst.device, non_blocking=True))
        _sync(src_device)

    benchmark(run)
