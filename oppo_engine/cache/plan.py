"""How many pages the shared arena gets, and the arena itself with every model's reserve.

The engine plans once when it is built: the bytes of a page follow from the largest model's KV per token
(``arena.page_bytes_for``), the number of pages from ``kv_cache_bytes`` or, by default, from what B + Δ_max
sequences of ``max_model_len`` tokens hold in every model, capped to a share of the device's memory.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from oppo_engine import ops
from oppo_engine.cache.arena import KVArena, KVSpec, fit_page_size, page_bytes_for

# Share of memory the arena may take when kv_cache_bytes is not given: of the free device memory on
# CUDA, of the physical memory on the CPU.
DEFAULT_CUDA_MEMORY_FRACTION = 0.4
DEFAULT_HOST_MEMORY_FRACTION = 0.25


@dataclass(frozen=True, slots=True)
class PagePlan:
    """The arena's shape: ``num_pages`` pages of ``page_bytes`` bytes each."""

    num_pages: int
    page_bytes: int


def plan_pages(
    specs: dict[str, KVSpec],
    *,
    page_size: int,
    kv_cache_bytes: int | None,
    max_model_len: int,
    batch_size: int,
    in_flight: int,
    device: torch.device,
    ranks_sharing_memory: int = 1,
    replica_bytes: int = 0,
) -> PagePlan:
    """The pages of an arena for the models of ``specs``, validated against what one step needs at least.

    ``kv_cache_bytes=None`` sizes it for ``in_flight`` sequences (B + Δ_max) of ``max_model_len`` tokens in
    every model, capped to ``DEFAULT_CUDA_MEMORY_FRACTION`` of the free memory of a CUDA device or
    ``DEFAULT_HOST_MEMORY_FRACTION`` of the host's RAM, split between ``ranks_sharing_memory`` ranks; on the
    CPU the rank's rollout replicas (``replica_bytes``) come out of its share (on CUDA they are allocated
    already, so the free memory excludes them). ``ValueError`` when one sequence, or one page per sequence
    of the batch, does not fit.
    """
    page_bytes = page_bytes_for(specs, page_size)
    pages_per_seq = {
        name: -(-max_model_len // fit_page_size(spec, page_bytes)) for name, spec in specs.items()
    }
    one_sequence = sum(pages_per_seq.values())
    if kv_cache_bytes is not None:
        num_pages = kv_cache_bytes // page_bytes
    else:
        num_pages = in_flight * one_sequence
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            budget = int(free * DEFAULT_CUDA_MEMORY_FRACTION)
        else:
            budget = int(
                os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * DEFAULT_HOST_MEMORY_FRACTION
            )
        budget //= ranks_sharing_memory  # ranks on one host (one GPU) share its memory
        if device.type != "cuda":
            budget = max(0, budget - replica_bytes)
        num_pages = min(num_pages, budget // page_bytes)
    if num_pages < one_sequence:
        raise ValueError(
            f"kv_cache_bytes={kv_cache_bytes} gives {num_pages} pages of {page_bytes} bytes, but one "
            f"sequence of max_model_len={max_model_len} tokens needs {one_sequence} pages "
            f"in the caches of {', '.join(specs)} together; raise kv_cache_bytes or lower max_model_len"
        )
    if num_pages < batch_size:
        raise ValueError(
            f"batch_size={batch_size} exceeds what the cache can ever hold: {num_pages} pages, at least one "
            "page per in-flight sequence; lower batch_size or raise kv_cache_bytes"
        )
    return PagePlan(num_pages, page_bytes)


def check_attention_backend(specs: dict[str, KVSpec], plan: PagePlan, backend: str, device: torch.device):
    """``ValueError`` unless ``backend`` can attend over every model's pages on ``device``."""
    for spec in specs.values():
        reason = ops.attention_backend_unavailable(backend, fit_page_size(spec, plan.page_bytes), device)
        if reason is not None:
            raise ValueError(f"attention_backend={backend!r} cannot be used: {reason}")


def build_arena(
    specs: dict[str, KVSpec], plan: PagePlan, *, page_size: int, max_model_len: int, device: torch.device
) -> KVArena:
    """The arena of ``plan`` on ``device``. Arbitration between lanes: every model can always hold one
    ``max_model_len`` sequence (its reserve), so no lane can starve another of its last sequence."""
    arena = KVArena(specs, page_size=page_size, num_pages=plan.num_pages, device=device)
    for name in specs:
        arena.set_reserve(name, -(-max_model_len // arena.page_size(name)))
    return arena


def build_cache(
    specs: dict[str, KVSpec], config, *, max_model_len: int, in_flight: int, device: torch.device,
    ranks_sharing_memory: int = 1, replica_bytes: int = 0,
) -> tuple[PagePlan, KVArena]:  # fmt: skip
    """The plan (``plan_pages``) and the arena (``build_arena``) of an ``EngineConfig``, after checking that
    its attention backend can read every model's pages."""
    plan = plan_pages(
        specs, page_size=config.page_size, kv_cache_bytes=config.kv_cache_bytes, max_model_len=max_model_len,
        batch_size=config.batch_size, in_flight=in_flight, device=device,
        ranks_sharing_memory=ranks_sharing_memory, replica_bytes=replica_bytes,
    )  # fmt: skip
    check_attention_backend(specs, plan, config.attention_backend, device)
    arena = build_arena(specs, plan, page_size=config.page_size, max_model_len=max_model_len, device=device)
    return plan, arena
