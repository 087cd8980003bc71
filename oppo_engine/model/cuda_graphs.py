"""CUDA graphs of the actor's decode: one per batch-size bucket, over static buffers read in place.

Used by ``oppo_engine.model.graph.CapturedDecode`` on CUDA; unverified on a GPU until
``bench/device_check.sh`` has run ``tests/test_graph.py -m cuda``. What the attention op must guarantee
for capture: once its plan is built, no host sync and no allocation that depends on tensor contents
inside ``ops.paged_attention``, and a launch grid fixed by the plan (``plan_forward`` over the bucket's
static tensors, ``max_q_len=1``, ``max_context_len`` = the table width in tokens), each sequence's work
sized on the device from its own ``context_lens``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import torch

from oppo_engine import ops
from oppo_engine.model.attention import AttentionMetadata, bound_metadata

EXTRA_PER_ROW = 5  # int64 values per row that ride with a bucket's inputs (SampleBatch.packed())
# Priority of the stream a bucket is captured on when the caller runs on the device's default stream (which
# cannot capture): the actor lane's (sched/lanes.py ACTOR_PRIORITY). Torch hands out pool streams round
# robin per priority, and the scorer lane's stream is one of the priority-0 pool: a capture stream drawn from
# that pool would, after enough captures, be the scorer lane's own, and its kernels would join the graph.
_CAPTURE_PRIORITY = -5


class CaptureFailed(RuntimeError):
    """A decode forward that cannot be captured as a CUDA graph (the model then decodes eager)."""


def capture_sizes(max_num_seqs: int) -> list[int]:
    """CUDA-graph buckets: 1, 2, 4, then every multiple of 8, up to the first that holds ``max_num_seqs``."""
    sizes = [1, 2, 4]
    while sizes[-1] < max_num_seqs:
        sizes.append(8 * (sizes[-1] // 8 + 1))
    return [s for s in sizes if s < max_num_seqs] + [next(s for s in sizes if s >= max_num_seqs)]


class CudaBucket:
    """Static device buffers of one CUDA-graph bucket of ``rows`` sequences, and their pinned staging.

    Two device buffers, each filled by one non-blocking copy per replay: int64 ``ids | positions | slots |
    extra`` and int32 ``cu_seqlens_q | context_lens | block_tables``; the graph's tensors are views of them.
    ``extra`` (up to ``EXTRA_PER_ROW`` values per row, not read by the graph) carries the sampler's
    parameters in the same copy.
    """

    def __init__(self, rows: int, width: int, device: torch.device) -> None:
        self.rows, self.width = rows, width
        self.i64 = torch.empty((3 + EXTRA_PER_ROW) * rows, dtype=torch.int64, device=device)
        self.i32 = torch.empty(2 * rows + 1 + rows * width, dtype=torch.int32, device=device)
        self.host64 = torch.empty(self.i64.shape, dtype=torch.int64, pin_memory=True)
        self.host32 = torch.empty(self.i32.shape, dtype=torch.int32, pin_memory=True)
        self.host32.numpy()[: rows + 1] = np.arange(rows + 1)  # one token per row, always
        self.ids, self.positions = self.i64[:rows].view(1, rows), self.i64[rows : 2 * rows].view(1, rows)
        self.slots = self.i64[2 * rows : 3 * rows]
        self.cu_seqlens_q = self.i32[: rows + 1]
        self.context_lens = self.i32[rows + 1 : 2 * rows + 1]
        self.block_tables = self.i32[2 * rows + 1 :].view(rows, width)
        self._staged: torch.cuda.Event | None = None  # after the last fill's copies out of the staging
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None  # [rows, V] float32, written by every replay
        # NOTE: held for the graph's life: its plan's split-KV scratch (``partial``, ``lse``: views of the
        # buckets' shared one) is allocated outside the capture, and the graph writes it at the captured
        # address on every replay.
        self.meta: AttentionMetadata | None = None

    def fill(self, arrays: list[np.ndarray], extra: np.ndarray | None = None) -> torch.Tensor | None:
        """Copy a forward's host arrays (``CapturedDecode.decode_inputs``) and ``extra`` into the static
        buffers, on the current stream; returns ``extra``'s device view (valid until the next fill). The
        pinned staging is reused: a fill first waits for the previous fill's copies out of it (a forward
        whose results are never read back, say one that samples nothing, leaves them in flight)."""
        if self._staged is not None:
            self._staged.synchronize()
        ids, positions, slots, context_lens, tables = arrays
        h64, h32, r = self.host64.numpy(), self.host32.numpy(), self.rows
        h64[:r], h64[r : 2 * r], h64[2 * r : 3 * r] = ids[0], positions[0], slots
        h32[r + 1 : 2 * r + 1], h32[2 * r + 1 :] = context_lens, tables.ravel()
        n = 0 if extra is None else len(extra)
        if n > EXTRA_PER_ROW * r:
            raise ValueError(f"extra: {n} values, a bucket of {r} rows carries at most {EXTRA_PER_ROW * r}")
        h64[3 * r : 3 * r + n] = extra if extra is not None else ()
        self.i64[: 3 * r + n].copy_(self.host64[: 3 * r + n], non_blocking=True)
        self.i32.copy_(self.host32, non_blocking=True)
        self._staged = torch.cuda.Event()
        self._staged.record()
        return self.i64[3 * r : 3 * r + n] if extra is not None else None


class CudaGraphs:
    """A CUDA graph per bucket of ``capture_sizes(max_num_seqs)``, captured on first use.

    The graph reads the arena and the weights at the addresses it captured: both are checked at the first
    forward of every step (``data_ptr`` of the KV view and of every parameter and buffer; they change only
    between steps: ``resume()``, ``update_policy()``, a replica refilled after
    ``release_memory(weights=True)``), and a change drops every bucket, each re-captured on its next use
    (counted in ``recompiles``, its cost in ``compile_s``). The arena keeps its address across
    ``release_memory()``/``resume()`` where the driver allows (``cache/vmm.py``), so a PPO run that releases
    memory every step captures each bucket once. The attention plan is built once per bucket over the
    static tensors, for a fixed grid: ``max_context_len``
    is the bucket's table width in tokens.
    """

    def __init__(self, owner, forward: Callable) -> None:
        self.owner = owner
        self.forward = forward  # (model, input_ids, positions, keep) -> logits [N, V] float32
        runner = owner.runner
        self.sizes = capture_sizes(owner.max_num_seqs)
        self.width = -(-owner.max_model_len // runner.cache.page_size)
        self.buckets: dict[int, CudaBucket] = {}
        self.pool = None  # one memory pool shared by every bucket's graph
        self.addresses: tuple[int, ...] | None = None
        self.checked = False  # the addresses were compared in this step (``start_step`` clears it)
        self.invalidations = 0  # times a moved arena or weight dropped the buckets
        self._side: torch.cuda.Stream | None = None  # capture stream, only if the caller's is the default
        self._scratch: tuple[torch.Tensor, torch.Tensor] | None = None  # the buckets' shared split-KV scratch

    def drop(self) -> None:
        """Drop every bucket (each is captured again on its next use): their attention metadata holds views
        of the arena, which must not keep a released arena's memory alive."""
        self.buckets.clear()
        self.pool = None
        self.addresses = None
        self._scratch = None

    def start_step(self) -> None:
        """Compare the addresses again at the step's first forward."""
        self.checked = False

    def check_addresses(self) -> None:
        """Drop every bucket if the arena or a weight is no longer where the graphs read it."""
        runner = self.owner.runner
        addresses = graph_addresses(runner.cache.kv_cache, runner.model)
        if addresses != self.addresses:
            if self.addresses is not None:
                self.invalidations += 1
            self.buckets.clear()
            # A fresh pool: torch's allocator refuses (asserts) to share a pool whose graphs are all gone
            # while one of its blocks is still alive.
            self.pool = None
            self._scratch = None
            self.addresses = addresses
        self.checked = True

    def logits(
        self, chunks: Sequence, extra: np.ndarray | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits ``[N, V]`` of the decode forward over ``chunks`` (a view of the bucket's output), and
        ``extra`` on the device.

        NOTE: the logits are valid until the next replay of *any* bucket, not only this one: the buckets
        share one memory pool, and a bucket captured later may hold its output where an earlier one keeps
        intermediates. The caller samples them on this stream before the next decode forward.
        """
        if not self.checked:
            self.check_addresses()
        rows = next(s for s in self.sizes if s >= len(chunks))
        bucket = self.buckets.get(rows) or self._capture(rows)
        extra_t = bucket.fill(self.owner.decode_inputs(chunks, rows, self.width), extra)
        bucket.graph.replay()  # on the current stream: the actor lane's
        return bucket.logits[: len(chunks)], extra_t

    def _capture(self, rows: int) -> CudaBucket:
        t0 = time.perf_counter()
        runner = self.owner.runner
        cache = runner.cache
        bucket = CudaBucket(rows, self.width, runner.device)
        # Capture over padding rows only (slot -1, a context of one token): neither the warm-up nor the
        # capture writes a page.
        zeros = np.zeros((1, rows), np.int64)
        padding = [zeros, zeros, np.full(rows, -1, np.int64), np.ones(rows, np.int32)]
        bucket.fill([*padding, np.zeros((rows, self.width), np.int32)])
        max_context_len = self.width * cache.page_size
        plan_args = (cache.kv_cache, bucket.block_tables, bucket.context_lens, bucket.cu_seqlens_q)
        plan_kw = dict(max_q_len=1, max_context_len=max_context_len, scratch=self._scratch)
        plan = ops.plan_forward(*plan_args, runner.num_q_heads, **plan_kw)
        if plan is not None and plan.partial is not None and self._scratch is None:
            # One split-KV scratch for every bucket, sized for the largest: the buckets replay one at a time
            # on one stream, and every replay writes its partials before it reads them. (Every bucket has
            # the same splits: its context is the table width.)
            numel = ops.attention_scratch_numel(plan, self.sizes[-1])
            self._scratch = tuple(torch.empty(n, dtype=torch.float32, device=runner.device) for n in numel)
            plan = ops.plan_forward(*plan_args, runner.num_q_heads, **{**plan_kw, "scratch": self._scratch})
        meta = AttentionMetadata(
            kv_cache=cache.kv_cache,
            slot_mapping=bucket.slots,
            block_tables=bucket.block_tables,
            context_lens=bucket.context_lens,
            cu_seqlens_q=bucket.cu_seqlens_q,
            max_q_len=1,
            max_context_len=max_context_len,
            backend=runner.backend,
            plan=plan,
        )
        args = (runner.model, bucket.ids, bucket.positions, runner.keeps_logits)
        # Captured on the caller's stream (the actor lane's: only this thread issues work on it), or, when
        # that is the default stream, on a side stream of the actor lane's priority.
        caller = torch.cuda.current_stream(runner.device)
        stream = caller
        if caller == torch.cuda.default_stream(runner.device):
            if self._side is None:
                self._side = torch.cuda.Stream(runner.device, priority=_CAPTURE_PRIORITY)
            stream = self._side
            stream.wait_stream(caller)
        graph = torch.cuda.CUDAGraph()
        # An explicit pool id, known before the capture begins: a capture that fails at its end (an op synced
        # with the host) leaves torch's allocator routed to the pool, and only the id lets us undo it.
        pool = self.pool if self.pool is not None else torch.cuda.graph_pool_handle()
        began = False
        try:
            # NOTE: the outer stream context restores the caller's stream even when a failed capture leaves
            # torch.cuda.graph's own (its __exit__ ends the capture before it restores the stream).
            with torch.cuda.stream(stream):
                with bound_metadata(meta):
                    for _ in range(2):  # warm-up: Triton compiles, cuBLAS picks its kernels, uncaptured
                        self.forward(*args)
                # thread_local: the scorer lane's thread goes on meanwhile (its allocations, event queries
                # and syncs are not this capture's); under "global" each of them would fail it, and the lane.
                with (
                    bound_metadata(meta),
                    torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"),
                ):
                    began = True
                    bucket.logits = self.forward(*args)
        except RuntimeError as e:  # an op that syncs with the host, or another that cannot be captured
            if began:
                self._abandon_capture(runner.device, graph, pool)
            if isinstance(e, torch.OutOfMemoryError):
                raise  # the device is out of memory: the caller must hear it, not a silent eager fallback
            raise CaptureFailed(f"the decode forward cannot be captured as a CUDA graph ({e})"[:300]) from e
        finally:
            if stream is not caller:
                caller.wait_stream(stream)
        self.pool = pool
        bucket.graph, bucket.meta = graph, meta
        self.buckets[rows] = bucket
        self.owner.recompiles += 1
        self.owner.compile_s += time.perf_counter() - t0
        return bucket

    def _abandon_capture(self, device: torch.device, graph: torch.cuda.CUDAGraph, pool) -> None:
        """Undo what a capture that began and did not end left behind. Its end raised (cudaStreamEndCapture
        of an invalidated capture) before torch stopped routing this thread's allocations to ``pool``, and
        the next ``torch.cuda.empty_cache()`` -- every ``release_memory()``, every later capture -- would
        then fail an internal assert; and the graph still holds its reference to the pool, which it drops
        only after a capture that ended. A capture that did end (``graph.pool()`` answers) needs nothing."""
        try:
            graph.pool()
            return
        except RuntimeError:
            pass
        index = device.index if device.index is not None else torch.cuda.current_device()
        with contextlib.suppress(RuntimeError):  # already stopped, where torch's order of the two differs
            torch._C._cuda_endAllocateToPool(index, pool)
        with contextlib.suppress(RuntimeError):  # cleanup: the capture's own failure is what is raised
            torch._C._cuda_releasePool(index, pool)


def graph_addresses(kv_cache: torch.Tensor, model: torch.nn.Module) -> tuple[int, ...]:
    """Where a captured decode graph reads its memory: the KV view, then every parameter and buffer."""
    return (kv_cache.data_ptr(), *(t.data_ptr() for t in _weights(model)))


def _weights(model: torch.nn.Module) -> Iterator[torch.Tensor]:
    yield from model.parameters()
    yield from model.buffers()
