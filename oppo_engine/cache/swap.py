"""Retained pages to host memory and back: the arena is released for training between steps, and the KV of
the sequences carried over (every model's) must survive it byte for byte."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

import torch

from oppo_engine import ops
from oppo_engine.cache.arena import KVArena
from oppo_engine.cache.manager import KVCacheManager


@dataclass(slots=True)
class HostPages:
    """Pages copied out of the arena: ``buffer`` is ``[P, page_bytes]`` uint8 (pinned where a device
    copies from it), and ``entries[model][seq_id] = (rows of buffer, num_tokens)`` in token order. A page
    several sequences shared is one row, listed by each of them (and shared again when swapped in)."""

    buffer: torch.Tensor
    entries: dict[str, dict[Hashable, tuple[list[int], int]]] = field(default_factory=dict)
    whole: torch.Tensor | None = None  # the allocation ``buffer`` is a prefix of: the next swap-out reuses it

    def drop(self, model: str, seq_id: Hashable) -> int:
        """Forget ``seq_id``'s pages of ``model`` (its KV will be recomputed); returns the tokens dropped."""
        rows_tokens = self.entries.get(model, {}).pop(seq_id, None)
        return 0 if rows_tokens is None else rows_tokens[1]

    def num_pages(self, seq_ids: set[Hashable] | None = None) -> int:
        """Pages held on host (of ``seq_ids`` only, when given), a shared one once."""
        return len({
            (m, row)
            for m, per_seq in self.entries.items()
            for s, (rows, _) in per_seq.items()
            if seq_ids is None or s in seq_ids
            for row in rows
        })  # fmt: skip

    def num_tokens(self) -> dict[str, int]:
        """Tokens held on host, per model."""
        return {m: sum(n for _, n in per_seq.values()) for m, per_seq in self.entries.items()}


def swap_out(
    arena: KVArena, caches: dict[str, KVCacheManager], reuse: list[torch.Tensor] | None = None
) -> HostPages:
    """Copy every page the managers hold to host memory and detach it from them (one ``copy_pages``).

    ``reuse``: a list holding the previous swap-out's ``whole`` buffer (or empty); the buffer is taken out of
    it, so that this function holds its last reference (the caller keeps none: a variable of the caller's
    would keep it alive through the call). Where it holds the pages it is written again; otherwise it is
    dropped and, on CUDA, unpinned before a larger one is pinned: torch's caching host allocator rounds a
    pinned block up to a power of two and keeps every freed one pinned, so a fresh buffer per release would
    pin one block per size class a run ever retained.

    NOTE: the managers forget their sequences and the arena's pages are not freed one by one: the caller
    releases the whole arena next. They forget them only once the copy is done: a failed host allocation
    or copy raises with every manager as it was (nothing detached, nothing leaked), and the engine stays
    usable with its arena in place.
    """
    arena.synchronize()
    held = {
        name: {s: (cache.pages(s), cache.num_tokens(s)) for s in cache.seq_ids}
        for name, cache in caches.items()
    }
    src: list[int] = []
    entries: dict[str, dict[Hashable, tuple[list[int], int]]] = {}
    for name, per_seq in held.items():
        entries[name] = {}
        row_of: dict[int, int] = {}  # page -> its row: a shared page is copied once
        for seq_id, (pages, num_tokens) in per_seq.items():
            for page in pages:
                if page not in row_of:
                    row_of[page] = len(src)
                    src.append(page)
            entries[name][seq_id] = ([row_of[p] for p in pages], num_tokens)
    pin = arena.device.type == "cuda"
    rows = max(1, len(src))
    whole = reuse.pop() if reuse else None
    if whole is not None and (whole.shape[0] < rows or whole.shape[1] != arena.page_bytes):
        whole = None  # the last reference: its block goes back to the host allocator
        if pin:
            torch._C._host_emptyCache()  # and is unpinned now (blocks still in flight are kept)
    if whole is None:
        whole = torch.empty((rows, arena.page_bytes), dtype=torch.uint8, pin_memory=pin)
    buffer = whole[:rows]
    if src:
        ops.copy_pages(arena.page_view(), buffer, torch.tensor(src), torch.arange(len(src)))
        if pin:
            torch.cuda.synchronize(arena.device)
    for cache in caches.values():
        cache.detach_all()
    return HostPages(buffer, entries, whole)


def swap_in(host: HostPages, arena: KVArena, caches: dict[str, KVCacheManager]) -> dict[str, int]:
    """Bring ``host``'s pages back into a rebuilt ``arena`` (new page ids, block tables rewritten); returns
    the tokens brought back per model."""
    src: list[int] = []
    dst: list[int] = []
    tokens: dict[str, int] = {}
    for name, per_seq in host.entries.items():
        cache = caches[name]
        uses: dict[int, int] = {}  # row -> sequences listing it
        for rows, _ in per_seq.values():
            for row in rows:
                uses[row] = uses.get(row, 0) + 1
        page_of: dict[int, int] = {}  # row -> its page in the rebuilt arena
        for seq_id, (rows, num_tokens) in per_seq.items():
            new_rows = [r for r in dict.fromkeys(rows) if r not in page_of]
            pages = arena.alloc(name, len(new_rows), keep_reserves=False)
            if pages is None:  # cannot happen: these pages were all held together before the release
                raise RuntimeError(f"swap-in: the rebuilt arena cannot hold {len(new_rows)} pages of {name}")
            page_of.update(zip(new_rows, pages, strict=True))
            src.extend(new_rows)
            dst.extend(pages)
            fresh = set(new_rows)
            again = [page_of[r] for r in rows if r not in fresh]
            arena.incref(name, again)  # shared with a sequence brought back before
            cache.replace_pages(
                seq_id, [page_of[r] for r in rows], num_tokens, shared=any(uses[r] > 1 for r in rows)
            )
            tokens[name] = tokens.get(name, 0) + num_tokens
    if src:
        ops.copy_pages(host.buffer, arena.page_view(), torch.tensor(src), torch.tensor(dst))
        # NOTE: the custom op records no use of the pinned buffer with the caching host allocator, so the
        # arena holds it until the copy is done: dropped earlier, it could be handed out mid-copy.
        arena.hold_for_copy(host.buffer)
    return tokens


def swap_out_seq(cache: KVCacheManager, seq_id: Hashable) -> HostPages | None:
    """Copy ``seq_id``'s pages of ``cache`` to host memory and free them (a preempted sequence whose KV is
    cheaper to copy back than to prefill again); None if it holds none.

    NOTE: on CUDA the copy and the later copy back run on the caller's (the lane's) stream, in order; the
    freed pages return to the pool only after the lane's event, and the arena holds the pinned buffer
    until each copy is done (nothing waits on the host).
    """
    pages = cache.pages(seq_id)
    if not pages:
        return None
    arena = cache.arena
    pin = arena.device.type == "cuda"
    buffer = torch.empty((len(pages), arena.page_bytes), dtype=torch.uint8, pin_memory=pin)
    ops.copy_pages(arena.page_view(), buffer, torch.tensor(pages), torch.arange(len(pages)))
    arena.hold_for_copy(buffer)  # the HostPages may be dropped (KV recomputed instead) mid-copy
    host = HostPages(buffer, {cache.name: {seq_id: (list(range(len(pages))), cache.num_tokens(seq_id))}})
    cache.free(seq_id)
    return host


def release_arena(arena: KVArena, caches: dict[str, KVCacheManager], buffer: list, captured) -> HostPages:
    """``RolloutEngine.release_memory``'s core: every retained page to host (into ``buffer``, the last
    release's, taken out and reused), then the arena freed (captured graphs told: their addresses go)."""
    host = swap_out(arena, caches, buffer)
    arena.release()
    if captured is not None:
        captured.arena_released(arena.fixed_address)
    return host


def restore_arena(host: HostPages, arena: KVArena, caches: dict[str, KVCacheManager], swapped: dict) -> list:
    """``RolloutEngine.resume``'s core: the arena rebuilt and ``host``'s pages brought back (new page ids, the
    same bytes), the tokens brought back counted into ``swapped`` per model; returns the buffer the next
    release reuses (its copy is ordered first)."""
    arena.rebuild()
    for name, n in swap_in(host, arena, caches).items():
        swapped[name] = swapped.get(name, 0) + n
    return [host.whole]


def swap_in_seq(cache: KVCacheManager, seq_id: Hashable, host: HostPages) -> int | None:
    """Bring ``seq_id``'s pages back from ``host`` into new pages of ``cache``; the tokens brought back, or
    None (nothing changed) when the pool is short."""
    rows, num_tokens = host.entries[cache.name][seq_id]
    pages = cache.arena.alloc(cache.name, len(rows))
    if pages is None:
        return None
    ops.copy_pages(host.buffer, cache.arena.page_view(), torch.tensor(rows), torch.tensor(pages))
    cache.arena.hold_for_copy(host.buffer)
    cache.replace_pages(seq_id, pages, num_tokens)
    return num_tokens
