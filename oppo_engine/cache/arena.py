"""One byte arena for the KV caches of every model, seen by each model through its own strided view."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from oppo_engine import ops
from oppo_engine.cache.vmm import FixedAddressBuffer

# Page sizes are byte counts rounded to this, so every dtype's view of a page starts on an element boundary
# and pages stay aligned for vectorised loads.
PAGE_ALIGN_BYTES = 256


@dataclass(frozen=True, slots=True)
class KVSpec:
    """The shape of one model's KV cache per token: layers ``L``, KV heads ``H``, head dim ``D``, dtype."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def token_bytes(self) -> int:
        """Bytes of K and V of one token over all layers."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    @classmethod
    def from_hf_config(cls, config, dtype: torch.dtype) -> KVSpec:
        """The spec of an HF decoder config (``num_key_value_heads`` and ``head_dim`` where given)."""
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        num_heads = text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // num_heads
        num_kv_heads = getattr(text, "num_key_value_heads", None) or num_heads
        return cls(text.num_hidden_layers, num_kv_heads, head_dim, dtype)


def page_bytes_for(specs: dict[str, KVSpec], page_size: int) -> int:
    """Bytes of one page: ``page_size`` tokens of the model with the most bytes per token, aligned."""
    largest = max(spec.token_bytes for spec in specs.values())
    return -(-page_size * largest // PAGE_ALIGN_BYTES) * PAGE_ALIGN_BYTES


def fit_page_size(spec: KVSpec, page_bytes: int) -> int:
    """Tokens per page for ``spec``: the largest power of two whose KV fits in ``page_bytes``."""
    tokens = page_bytes // spec.token_bytes
    return 1 << (tokens.bit_length() - 1)


class CompletionEvent(Protocol):
    """What a freeing lane records after the last kernel that touched the pages (``torch.cuda.Event``)."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class KVArena:
    """``num_pages`` pages of ``page_bytes`` bytes on one device, shared by several models.

    A page is a number of bytes, not of tokens: model ``m`` stores ``page_size(m)`` tokens of all its layers
    in one page (the largest power of two that fits), so a page freed by one model can next hold another's
    KV. Each model sees the arena as ``[num_pages, L, 2, page_size_m, H, D]`` (``view(name)``), with a page
    stride of ``page_bytes / itemsize`` elements. Pages are handed out by one thread-safe allocator.

    Arbitration between lanes (they allocate concurrently): each model may be guaranteed a reserve
    (``set_reserve``, the engine's is one ``max_model_len`` sequence). A model allocates freely, except
    that it may not take pages another model needs to reach its reserve. So every model can always hold
    one whole sequence, each lane's oldest sequence always completes (lanes preempt only their own), and
    no lane waits on another for pages: the rule cannot deadlock.

    Frees may be deferred (``free(..., after=event)``): on CUDA a page freed by one lane must not be reused
    by another before the freeing lane's kernels on it are done, so it returns to the pool only once the
    event recorded after them has completed. Pending frees are kept per lane (``set_lane``: the models
    whose kernels run on one stream share a lane), in the order they were recorded, so one lane's slow
    event never holds another lane's completed frees behind it; every completed one is reclaimed at each
    allocation and whenever the counts are read (``reclaim``). A lane takes its *own* pending pages back
    at once, with no event: its stream orders its later kernels after the earlier ones on those pages.

    Host buffers a device copy still reads or writes (pinned swap buffers) are held by ``hold`` until the
    event recorded after the copy completes: the caching host allocator would otherwise hand a dropped
    buffer out again while the copy is in flight.

    A page may be shared by several sequences of one model (a group's prompt, ``incref``): it is held once
    however many reference it, and returns to the pool when its last reference is dropped.

    NOTE: invariant, checked by tests: ``num_free_pages() + pages held by every model + pending frees ==
    num_pages``, a shared page counted once. A pending page keeps its allocator reference (count 1) until it
    is reclaimed or taken back by its own lane.
    """

    def __init__(
        self,
        specs: dict[str, KVSpec],
        *,
        page_size: int = 16,
        num_pages: int | None = None,
        kv_cache_bytes: int | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        if not specs:
            raise ValueError("KVArena: specs must name at least one model")
        if page_size < 1 or page_size & (page_size - 1):
            raise ValueError(f"KVArena: page_size must be a power of two, got {page_size}")
        self.specs = dict(specs)
        self.page_bytes = page_bytes_for(self.specs, page_size)
        if num_pages is None:
            if kv_cache_bytes is None:
                raise ValueError("KVArena: give num_pages or kv_cache_bytes")
            num_pages = kv_cache_bytes // self.page_bytes
        if num_pages < 1:
            raise ValueError(
                f"KVArena: kv_cache_bytes={kv_cache_bytes} holds no page of {self.page_bytes} bytes"
            )
        self.num_pages = int(num_pages)
        self.device = torch.device(device)
        self._page_sizes = {name: fit_page_size(spec, self.page_bytes) for name, spec in self.specs.items()}
        self._lock = threading.Lock()
        self._reserve = dict.fromkeys(self.specs, 0)
        self._lane = {name: name for name in self.specs}  # model -> the lane (stream) its kernels run on
        # On CUDA the buffer keeps its address across release/rebuild (CUDA graphs read it there): None
        # where the driver has no virtual memory management (the buffer is then a new torch.empty).
        self._fixed = FixedAddressBuffer.create(self.device, self.num_pages * self.page_bytes)
        self.rebuild()

    def rebuild(self) -> None:
        """(Re)allocate the buffer with every page free: at construction, and after ``release``; on CUDA at
        the address it had before (``cache/vmm.py``), where the driver allows."""
        if self._fixed is not None:
            self.buffer = self._fixed.map()
        else:
            self.buffer = torch.empty(self.num_pages * self.page_bytes, dtype=torch.uint8, device=self.device)
        self.allocator = ops.PageAllocator(self.num_pages)
        self._views = {name: self._make_view(name) for name in self.specs}
        self._held = dict.fromkeys(self.specs, 0)
        # lane -> its deferred frees, oldest first: (event, pages); events of one lane complete in order.
        self._pending: dict[Hashable, deque[tuple[CompletionEvent, list[int]]]] = {}
        self._num_pending: dict[Hashable, int] = {}
        self._held_buffers: list[tuple[CompletionEvent, object]] = []
        self._extra_refs = 0  # references beyond the first, over all pages (0: nothing is shared)

    def release(self) -> None:
        """Drop the buffer (its memory goes back to the device) and every page with it; ``rebuild`` restores
        an empty arena of the same shape. The caller has copied out whatever it keeps."""
        self.synchronize()
        self.buffer = None
        self._views = {}
        self.allocator = None
        if self._fixed is not None:
            self._fixed.unmap()  # NOTE: after the sync; no tensor over the range may be used until rebuild

    @property
    def fixed_address(self) -> bool:
        """The buffer keeps its address across ``release``/``rebuild`` (CUDA VMM, ``cache/vmm.py``)."""
        return self._fixed is not None

    @property
    def released(self) -> bool:
        """The buffer is dropped (between ``release`` and ``rebuild``)."""
        return self.buffer is None

    def synchronize(self) -> None:
        """Wait for every deferred free (used before the pages are copied or dropped wholesale)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.reclaim()

    def set_lane(self, name: str, lane: Hashable) -> None:
        """Model ``name``'s kernels run on ``lane`` (one stream): its frees pend on that lane's queue, and
        the lane's models take back each other's pending pages without waiting (stream order)."""
        if name not in self.specs:
            raise ValueError(f"KVArena: unknown model {name!r}; models are {list(self.specs)}")
        with self._lock:
            if self._pending.get(self._lane[name]):
                raise RuntimeError(f"KVArena: {name!r} has pending frees on its lane; set lanes before use")
            self._lane[name] = lane

    def hold(self, buffer: object, until: CompletionEvent | None) -> None:
        """Keep ``buffer`` (a host tensor a device copy uses) alive until ``until`` completes; None: no-op."""
        if until is None or until.query():
            return
        with self._lock:
            self._held_buffers.append((until, buffer))

    def hold_for_copy(self, buffer: torch.Tensor) -> None:
        """Keep ``buffer`` alive until the copies issued on the current stream so far are done (CUDA; the
        CPU copies synchronously). Replaces a stream sync after a copy from or to a pinned host buffer."""
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            self.hold(buffer, event)

    @property
    def num_held_buffers(self) -> int:
        """Host buffers still held for a device copy in flight."""
        return len(self._held_buffers)

    def _make_view(self, name: str) -> torch.Tensor:
        spec, ps = self.specs[name], self._page_sizes[name]
        L, H, D = spec.num_layers, spec.num_kv_heads, spec.head_dim
        flat = self.buffer.view(spec.dtype)
        return flat.as_strided(
            (self.num_pages, L, 2, ps, H, D),
            (self.page_bytes // spec.dtype.itemsize, 2 * ps * H * D, ps * H * D, H * D, D, 1),
        )

    def page_size(self, name: str) -> int:
        """Tokens per page for model ``name``."""
        return self._page_sizes[name]

    def view(self, name: str) -> torch.Tensor:
        """Model ``name``'s view ``[num_pages, L, 2, page_size, H, D]`` of the arena."""
        return self._views[name]

    def page_view(self) -> torch.Tensor:
        """The arena as ``[num_pages, page_bytes]`` uint8, for page copies (swap, fork)."""
        return self.buffer.view(self.num_pages, self.page_bytes)

    def num_free_pages(self) -> int:
        """Pages no model holds right now (pending frees not counted: ``reclaim`` first to count them)."""
        return self.allocator.num_free()

    @property
    def num_pending_pages(self) -> int:
        """Freed pages still waiting for their freeing lane's kernels."""
        return sum(self._num_pending.values())

    def pending_pages_for(self, name: str) -> int:
        """Freed pages that only another lane's kernels keep from model ``name`` (its own lane's it may
        already reuse: stream order protects them)."""
        own = self._lane[name]
        return sum(n for lane, n in self._num_pending.items() if lane != own)

    def pages_held(self, name: str) -> int:
        """Pages model ``name`` holds."""
        return self._held[name]

    def set_reserve(self, name: str, pages: int) -> None:
        """Guarantee model ``name`` can always hold ``pages`` pages (other models never take them)."""
        if sum(self._reserve.values()) - self._reserve[name] + pages > self.num_pages:
            raise ValueError(
                f"KVArena: reserves {self._reserve} plus {pages} for {name!r} exceed {self.num_pages} pages"
            )
        self._reserve[name] = pages

    def available_pages(self, name: str) -> int:
        """Pages model ``name`` may take now: the free ones and its lane's own pending ones, less what others
        need to reach their reserves."""
        self.reclaim()
        with self._lock:
            return self._available(name)

    def _available(self, name: str) -> int:
        owed = sum(max(0, r - self._held[m]) for m, r in self._reserve.items() if m != name)
        own_pending = self._num_pending.get(self._lane[name], 0)
        return max(0, self.allocator.num_free() + own_pending - owed)

    def alloc(self, name: str, n: int, *, keep_reserves: bool = True) -> list[int] | None:
        """``n`` fresh pages for model ``name`` (reference count 1), or None (nothing taken) if it may not.

        ``keep_reserves=False`` ignores other models' reserves: only for bringing back pages that were all
        held together before (swap-in), where the order of the models must not matter.
        """
        self.reclaim()
        with self._lock:
            lane = self._lane[name]
            own_pending = self._num_pending.get(lane, 0)
            limit = self._available(name) if keep_reserves else self.allocator.num_free() + own_pending
            if n > limit:
                return None
            # The lane's own pending pages first: they need no event, and leave the free pool to the others.
            pages = self._take_pending(lane, min(n, own_pending))
            if len(pages) < n:
                fresh = self.allocator.alloc(n - len(pages))
                if fresh is None:  # every allocator call is under this lock, and n <= limit
                    raise RuntimeError(f"KVArena: the allocator refused {n - len(pages)} free pages")
                pages += fresh
            self._held[name] += n
            return pages

    def _take_pending(self, lane: Hashable, n: int) -> list[int]:
        """Up to ``n`` of ``lane``'s pending pages, newest first (each keeps its allocator reference)."""
        taken: list[int] = []
        queue = self._pending.get(lane)
        while queue and len(taken) < n:
            event, pages = queue[-1]
            k = min(n - len(taken), len(pages))
            taken.extend(pages[len(pages) - k :])
            if k == len(pages):
                queue.pop()
            else:
                queue[-1] = (event, pages[: len(pages) - k])
        self._num_pending[lane] = self._num_pending.get(lane, 0) - len(taken)
        return taken

    def incref(self, name: str, pages: Sequence[int]) -> None:
        """One more reference to model ``name``'s ``pages`` (another sequence shares them); a shared page is
        still held once."""
        if pages:
            with self._lock:
                self.allocator.incref(list(pages))
                self._extra_refs += len(pages)

    def refcount(self, page: int) -> int:
        """References to ``page`` (0 when free)."""
        return self.allocator.refcount(page)

    def free(self, name: str, pages: Sequence[int], after: CompletionEvent | None = None) -> None:
        """Drop model ``name``'s reference to ``pages``: a page whose last reference this is returns to the
        pool -- with ``after``, only once that event completes; a shared page just loses a reference."""
        if not pages:
            return
        pages = list(pages)
        with self._lock:
            if self._extra_refs:  # some page is shared: those of ``pages`` just lose a reference
                refcount = self.allocator.refcount
                shared = {p for p in pages if refcount(p) > 1}
                if shared:
                    self.allocator.free(list(shared))  # still referenced elsewhere: never deferred
                    self._extra_refs -= len(shared)
                    pages = [p for p in pages if p not in shared]
                    if not pages:
                        return
            self._held[name] -= len(pages)
            if after is None or after.query():
                self.allocator.free(pages)
            else:
                lane = self._lane[name]
                self._pending.setdefault(lane, deque()).append((after, pages))
                self._num_pending[lane] = self._num_pending.get(lane, 0) + len(pages)

    def reclaim(self, *, wait: bool = False) -> None:
        """Return the pages of every completed deferred free to the pool (each lane's, oldest first, up to
        its first incomplete event), and drop the held host buffers whose copies are done. ``wait`` first
        waits for every pending event (exact counts for a stats read; never on the hot path)."""
        if not (self._num_pending_any() or self._held_buffers):
            return
        if wait:
            with self._lock:
                events = [e for queue in self._pending.values() for e, _ in queue]
            for event in events:  # outside the lock: a lane may free meanwhile (its event joins next time)
                event.synchronize()
        with self._lock:
            for lane, queue in self._pending.items():
                while queue and queue[0][0].query():
                    _, pages = queue.popleft()
                    self._num_pending[lane] -= len(pages)
                    self.allocator.free(pages)
            if self._held_buffers:
                self._held_buffers = [(e, b) for e, b in self._held_buffers if not e.query()]

    def _num_pending_any(self) -> bool:
        return any(self._num_pending.values())
