"""Per-model bookkeeping of which pages hold which sequence's tokens."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

import numpy as np
import torch

from oppo_engine import ops
from oppo_engine.cache.arena import CompletionEvent, KVArena


class KVCacheManager:
    """Sequence -> page list and cached-token count for one model over a shared ``KVArena``.

    Token ``t`` of a sequence lives in slot ``pages[t // page_size] * page_size + t % page_size`` of the
    model's view. The scheduler asks ``can_append`` and then calls ``append_slots``; because other managers
    draw from the same arena concurrently (and it keeps other models' reserves), ``append_slots`` can still
    come back ``None`` (nothing taken), never raise, when the pool ran short in between.

    NOTE: the manager owns one reference to each page in ``pages(seq)``; ``free(seq)`` drops them all.
    Only one thread mutates a given manager (its lane); the arena is the shared, locked part.

    Prefix sharing: ``fork(src, dst, n)`` gives ``dst`` the pages of ``src``'s first ``n`` tokens, one
    more reference each (a group's prompt, prefilled once). Full pages stay shared; the page a sequence
    next writes into is copied on write (``copy_pages``) while another sequence still references it, so
    no sequence ever writes into a page another reads. Only this manager's sequences share its pages,
    so only its lane changes their reference counts.

    Block tables are persistent (as in vLLM v1): each sequence holding pages owns a row of a host int32
    table, written when a page is appended or replaced, so a forward gathers its rows in one indexing op
    instead of rebuilding a table from Python lists. Entries past a sequence's pages are stale and never
    read (kernels read only ``ceil(context_len / page_size)`` entries).
    """

    def __init__(self, arena: KVArena, name: str) -> None:
        self.arena = arena
        self.name = name
        self.page_size = arena.page_size(name)
        # Makes an event after this lane's last kernel on freed pages; None frees at once (CPU, tests).
        self.free_event: Callable[[], CompletionEvent] | None = None
        self._pages: dict[Hashable, list[int]] = {}
        self._num_tokens: dict[Hashable, int] = {}
        self._rows: dict[Hashable, int] = {}  # seq -> row of self._table
        self._free_rows: list[int] = []
        self._table = np.zeros((16, 16), dtype=np.int32)  # [rows, max pages], grown by doubling
        # seq -> how many of its leading pages may be shared (forked from or to): a write into one of them
        # checks its reference count first (copy on write). Absent: every page is the sequence's own.
        self._shared_upto: dict[Hashable, int] = {}
        self.shared_tokens = 0  # tokens given to a sequence by fork, not prefilled

    @property
    def kv_cache(self) -> torch.Tensor:
        """This model's view ``[num_pages, L, 2, page_size, H, D]`` of the arena (new after a rebuild)."""
        return self.arena.view(self.name)

    @property
    def seq_ids(self) -> list[Hashable]:
        """Sequences holding pages, in the order they first got one."""
        return list(self._pages)

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._pages

    def num_tokens(self, seq_id: Hashable) -> int:
        """Tokens of ``seq_id`` with a slot (0 for an unknown sequence)."""
        return self._num_tokens.get(seq_id, 0)

    def token_counts(self, seq_ids: Sequence[Hashable]) -> list[int]:
        """``num_tokens`` of each of ``seq_ids`` (one call per forward, not one per sequence)."""
        get = self._num_tokens.get
        return [get(s, 0) for s in seq_ids]

    def pages(self, seq_id: Hashable) -> list[int]:
        """A copy of ``seq_id``'s page ids, in token order (empty for an unknown sequence)."""
        return list(self._pages.get(seq_id, ()))

    def pages_needed(self, seq_id: Hashable, num_new_tokens: int) -> int:
        """New pages that appending ``num_new_tokens`` to ``seq_id`` would take."""
        pages = self._pages.get(seq_id, ())
        start = self.num_tokens(seq_id)
        need = -(-(start + num_new_tokens) // self.page_size) - len(pages)
        copy = num_new_tokens > 0 and self._shared_write(seq_id, pages, start) is not None
        return max(0, need) + copy

    def pages_needed_forked(self, num_shared: int, num_tokens: int) -> int:
        """New pages a sequence forked at ``num_shared`` tokens would take to hold ``num_tokens``: the shared
        full pages are free; a partly filled last one is copied on write."""
        return -(-num_tokens // self.page_size) - num_shared // self.page_size

    def can_append(self, seq_id: Hashable, num_new_tokens: int) -> bool:
        """Whether the pool has the pages ``append_slots`` would take (another lane may take them first)."""
        return self.pages_needed(seq_id, num_new_tokens) <= self.arena.available_pages(self.name)

    def num_available_pages(self) -> int:
        """Pages this model may take now (the arena keeps other models' reserves)."""
        return self.arena.available_pages(self.name)

    def append_slots(self, seq_id: Hashable, num_new_tokens: int) -> list[int] | None:
        """Slots for the next ``num_new_tokens`` tokens of ``seq_id``, allocating pages as needed.

        Returns ``None`` and changes nothing when the pool is short.
        """
        ps = self.page_size
        start = self._num_tokens.get(seq_id, 0)
        end = start + num_new_tokens
        pages = self._pages.get(seq_id)
        needed = -(-end // ps) - (len(pages) if pages else 0)
        # NOTE: without a fork in the cache (``_shared_upto`` empty) no page is shared: no call per decode.
        shared = None
        if pages and num_new_tokens and self._shared_upto:
            shared = self._shared_write(seq_id, pages, start)
        if needed > 0 or shared is not None:
            new = self.arena.alloc(self.name, max(0, needed) + (shared is not None))
            if new is None:
                return None
            if shared is not None:
                self._copy_on_write(seq_id, pages, shared, new.pop())
            if pages is None:
                pages = self._pages[seq_id] = []
            if new:
                self._write_row(seq_id, len(pages), new)
                pages.extend(new)
        elif pages is None:  # zero tokens for an unknown sequence
            pages = self._pages[seq_id] = []
        self._num_tokens[seq_id] = end
        if num_new_tokens == 1:  # decode: one slot, no list comprehension
            return [pages[start // ps] * ps + start % ps]
        return [pages[t // ps] * ps + t % ps for t in range(start, end)]

    def _shared_write(self, seq_id: Hashable, pages: Sequence[int] | None, start: int) -> int | None:
        """Index of the page a write at token ``start`` lands in when another sequence references it too
        (it must be copied first), else None. A write at a page boundary goes to a new page."""
        if not pages or start % self.page_size == 0:
            return None
        upto = self._shared_upto.get(seq_id)
        i = start // self.page_size
        if upto is None or i >= upto or self.arena.refcount(pages[i]) == 1:
            return None
        return i

    def _copy_on_write(self, seq_id: Hashable, pages: list[int], index: int, fresh: int) -> None:
        """Give ``seq_id`` its own copy ``fresh`` of its shared page ``pages[index]``."""
        view = self.arena.page_view()
        ops.copy_pages(view, view, torch.tensor([pages[index]]), torch.tensor([fresh]))
        old = pages[index]
        pages[index] = fresh
        self._write_row(seq_id, index, [fresh])
        self.arena.free(self.name, [old])  # another sequence still references it: only a reference goes

    def fork(self, src: Hashable, dst: Hashable, num_tokens: int) -> None:
        """Make ``dst`` (holding nothing) share ``src``'s first ``num_tokens`` tokens: the pages holding
        them get one more reference each, and ``dst`` continues from token ``num_tokens``.

        The caller guarantees the KV of those tokens is written (or ordered before every later read:
        on CUDA, by the lane's stream). The last page, when partly filled, is copied by whichever of the
        two writes into it first.
        """
        if dst in self._pages:
            raise ValueError(f"fork: sequence {dst!r} already holds pages of {self.name}")
        if not 0 < num_tokens <= self.num_tokens(src):
            raise ValueError(
                f"fork: {self.name} holds {self.num_tokens(src)} tokens of {src!r}, cannot share {num_tokens}"
            )
        pages = self._pages[src][: -(-num_tokens // self.page_size)]
        self.arena.incref(self.name, pages)
        self.replace_pages(dst, pages, num_tokens)
        self._shared_upto[dst] = len(pages)
        self._shared_upto[src] = max(self._shared_upto.get(src, 0), len(pages))
        self.shared_tokens += num_tokens

    def free(self, seq_id: Hashable) -> None:
        """Return all of ``seq_id``'s pages; unknown ids are ignored (freeing twice is harmless)."""
        pages = self._pages.pop(seq_id, None)
        self._num_tokens.pop(seq_id, None)
        self._shared_upto.pop(seq_id, None)
        row = self._rows.pop(seq_id, None)
        if row is not None:
            self._free_rows.append(row)
        if pages:
            self.arena.free(self.name, pages, after=self.free_event() if self.free_event else None)

    def truncate(self, seq_id: Hashable, num_tokens: int) -> None:
        """Keep only ``seq_id``'s first ``num_tokens`` tokens: the pages past them go back to the arena.

        Rolls back what a failed step appended; the KV of the kept tokens is untouched (appends only wrote
        later slots). ``num_tokens`` at or above the cached count changes nothing; 0 frees everything.
        """
        have = self.num_tokens(seq_id)
        if num_tokens >= have:
            return
        if num_tokens <= 0:
            self.free(seq_id)
            return
        pages = self._pages[seq_id]
        keep = -(-num_tokens // self.page_size)
        dropped = pages[keep:]
        del pages[keep:]
        self._num_tokens[seq_id] = num_tokens
        if dropped:
            self.arena.free(self.name, dropped, after=self.free_event() if self.free_event else None)

    def detach_all(self) -> dict[Hashable, tuple[list[int], int]]:
        """Forget every sequence without returning its pages (they are about to be copied out and the
        arena released): ``seq_id -> (pages, num_tokens)``, in first-page order."""
        held = {s: (pages, self._num_tokens[s]) for s, pages in self._pages.items()}
        self._free_rows.extend(self._rows.values())
        self._shared_upto.clear()
        self._pages.clear()
        self._num_tokens.clear()
        self._rows.clear()
        return held

    def replace_pages(
        self, seq_id: Hashable, pages: Sequence[int], num_tokens: int, *, shared: bool = False
    ) -> None:
        """Make ``pages`` (already referenced for this manager) hold ``seq_id``'s first ``num_tokens`` tokens.

        For KV that moved (swapped back in to other page ids) or was forked from shared pages; the manager
        takes over one reference per page and drops none (the caller freed any old pages). ``shared``:
        other sequences may reference some of them (they are copied before a write).
        """
        if len(pages) != -(-num_tokens // self.page_size):
            raise ValueError(
                f"replace_pages: {num_tokens} tokens need {-(-num_tokens // self.page_size)} pages of "
                f"{self.page_size}, got {len(pages)}"
            )
        self._pages[seq_id] = list(pages)
        self._num_tokens[seq_id] = num_tokens
        self._write_row(seq_id, 0, pages)
        if shared:
            self._shared_upto[seq_id] = len(pages)
        else:
            self._shared_upto.pop(seq_id, None)

    def block_table_rows(self, seq_ids: Sequence[Hashable], width: int) -> np.ndarray:
        """``[N, width]`` int32 host copy of the first ``width`` table entries of ``seq_ids``' rows."""
        if width > self._table.shape[1]:
            self._grow(self._table.shape[0], width)
        return self._table[[self._rows[s] for s in seq_ids], :width]

    def block_tables(self, seq_ids: Sequence[Hashable], device: torch.device | None = None) -> torch.Tensor:
        """``[N, max_pages]`` int32 page ids of ``seq_ids``, zero-padded (tests, tools; forwards use
        ``block_table_rows``)."""
        rows = [self._pages.get(s, ()) for s in seq_ids]
        width = max((len(r) for r in rows), default=0) or 1
        table = np.zeros((len(rows), width), dtype=np.int32)
        for i, r in enumerate(rows):
            table[i, : len(r)] = r
        return torch.from_numpy(table).to(device or self.kv_cache.device)

    def _write_row(self, seq_id: Hashable, start: int, pages: Sequence[int]) -> None:
        row = self._rows.get(seq_id)
        if row is None:
            if not self._free_rows:
                self._grow(2 * self._table.shape[0], self._table.shape[1])
            row = self._rows[seq_id] = self._free_rows.pop()
        end = start + len(pages)
        if end > self._table.shape[1]:
            self._grow(self._table.shape[0], max(end, 2 * self._table.shape[1]))
        self._table[row, start:end] = pages

    def _grow(self, rows: int, width: int) -> None:
        old = self._table
        self._table = np.zeros((rows, width), dtype=np.int32)
        self._table[: old.shape[0], : old.shape[1]] = old
        # Hand out low rows first (pop from the end).
        self._free_rows.extend(range(rows - 1, old.shape[0] - 1, -1))

    @property
    def num_sequences(self) -> int:
        """Sequences holding pages in this model."""
        return len(self._pages)

    @property
    def num_pages_used(self) -> int:
        """Pages this model holds, over all its sequences (a shared page once)."""
        if not self._shared_upto:
            return sum(len(p) for p in self._pages.values())
        return len({p for pages in self._pages.values() for p in pages})

    @property
    def num_shared_pages(self) -> int:
        """Pages referenced by more than one of this model's sequences."""
        if not self._shared_upto:
            return 0
        seen: set[int] = set()
        shared: set[int] = set()
        for pages in self._pages.values():
            for p in pages:
                (shared if p in seen else seen).add(p)
        return len(shared)
