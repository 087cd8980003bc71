"""``RolloutEngine.cache_stats()``: what the shared arena holds, per model, and for carried-over sequences."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

from oppo_engine.cache.arena import KVArena
from oppo_engine.cache.manager import KVCacheManager
from oppo_engine.cache.swap import HostPages


@dataclass(slots=True)
class CacheStats:
    """Pages of the shared arena: total, free, held per model (a shared page once), retained across steps,
    and shared by several samples of a group (per model)."""

    total_pages: int
    free_pages: int
    pages_per_model: dict[str, int] = field(default_factory=dict)
    retained_pages: int = 0  # held for carried-over sequences, in the arena or (released) on host
    page_bytes: int = 0
    shared_pages: dict[str, int] = field(default_factory=dict)


def cache_stats(
    arena: KVArena,
    caches: dict[str, KVCacheManager],
    host: HostPages | None,
    carried: set[Hashable],
    preempted_pages: int,
) -> CacheStats:
    """The arena's pages; ``carried`` are the ids of carried-over sequences, whose pages are retained (in the
    arena, or in ``host`` while the memory is released: the arena then holds nothing), and
    ``preempted_pages`` the pages of their preempted scorer KV on host, which count as retained too."""
    if host is not None:
        return CacheStats(
            total_pages=arena.num_pages,
            free_pages=arena.num_pages,
            pages_per_model=dict.fromkeys(caches, 0),
            retained_pages=host.num_pages(carried) + preempted_pages,
            page_bytes=arena.page_bytes,
            shared_pages=dict.fromkeys(caches, 0),
        )
    arena.reclaim(wait=True)  # deferred frees whose lane's kernels are done count as free
    return CacheStats(
        total_pages=arena.num_pages,
        free_pages=arena.num_free_pages(),
        pages_per_model={name: cache.num_pages_used for name, cache in caches.items()},
        retained_pages=sum(len({p for s in carried for p in c.pages(s)}) for c in caches.values())
        + preempted_pages,
        page_bytes=arena.page_bytes,
        shared_pages={name: cache.num_shared_pages for name, cache in caches.items()},
    )
