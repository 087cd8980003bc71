"""CUDA graphs of the actor's decode: one per batch-size bucket, over static buffers read in place.

Used by ``oppo_engine.model.graph.CapturedDecode`` on CUDA; unverified on a GPU until
``bench/device_check.sh`` has run ``tests/test_graph.py -m cuda``. What the attention op must guarantee
for capture: once its plan is built, no host sync and no allocation that depends on tensor contents
inside ``ops.paged_attention``, and a launch grid fixed by the plan (``plan_forward`` over the bucket's
static tensors, ``max_q_len=1``, ``max_context_len`` = the table width in tokens), each sequence's work
sized on the device from its own ``context_lens``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import torch

from oppo_engine import ops
from oppo_engine.model.attention import AttentionMetadata, bound_metadata


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

    Two device buffers, each filled by one non-blocking copy per replay: int64 ``ids | positions | slots``
    and int32 ``cu_seqlens_q | context_lens | block_tables``; the graph's tensors are views of them.
    """

    def __init__(self, rows: int, width: int, device: torch.device) -> None:
        self.rows, self.width = rows, width
        self.i64 = torch.empty(3 * rows, dtype=torch.int64, device=device)
        self.i32 = torch.empty(2 * rows + 1 + rows * width, dtype=torch.int32, device=device)
        self.host64 = torch.empty(self.i64.shape, dtype=torch.int64, pin_memory=True)
        self.host32 = torch.empty(self.i32.shape, dtype=torch.int32, pin_memory=True)
        self.host32.numpy()[: rows + 1] = np.arange(rows + 1)  # one token per row, always
        self.ids, self.positions = self.i64[:rows].view(1, rows), self.i64[rows : 2 * rows].view(1, rows)
        self.slots = self.i64[2 * rows :]
        self.cu_seqlens_q = self.i32[: rows + 1]
        self.context_lens = self.i32[rows + 1 : 2 * rows + 1]
        self.block_tables = self.i32[2 * rows + 1 :].view(rows, width)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None  # [rows, V] float32, written by every replay

    def fill(self, arrays: list[np.ndarray]) -> None:
        """Copy a forward's host arrays (``CapturedDecode.decode_inputs``) into the static buffers, on the
        current stream. NOTE: the staging is reused by the next fill; the caller reads the logits back (a
        sync) between two fills, so the previous copy has completed by then."""
        ids, positions, slots, context_lens, tables = arrays
        h64, h32, r = self.host64.numpy(), self.host32.numpy(), self.rows
        h64[:r], h64[r : 2 * r], h64[2 * r :] = ids[0], positions[0], slots
        h32[r + 1 : 2 * r + 1], h32[2 * r + 1 :] = context_lens, tables.ravel()
        self.i64.copy_(self.host64, non_blocking=True)
        self.i32.copy_(self.host32, non_blocking=True)


class CudaGraphs:
    """A CUDA graph per bucket of ``capture_sizes(max_num_seqs)``, captured on first use.

    The graph reads the arena and the weights at the addresses it captured: both are checked before every
    replay (``data_ptr`` of the KV view and of every parameter and buffer), and a change drops every bucket
    (re-captured on next use, counted). The attention plan is built once per bucket over the static
    tensors, for a fixed grid: ``max_context_len`` is the bucket's table width in tokens.
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

    def logits(self, chunks: Sequence) -> torch.Tensor:
        runner = self.owner.runner
        addresses = (runner.cache.kv_cache.data_ptr(), *(t.data_ptr() for t in _weights(runner.model)))
        if addresses != self.addresses:
            self.buckets.clear()
            self.addresses = addresses
        rows = next(s for s in self.sizes if s >= len(chunks))
        bucket = self.buckets.get(rows) or self._capture(rows)
        bucket.fill(self.owner.decode_inputs(chunks, rows, self.width))
        bucket.graph.replay()  # on the current stream: the actor lane's
        return bucket.logits[: len(chunks)]

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
        meta = AttentionMetadata(
            kv_cache=cache.kv_cache,
            slot_mapping=bucket.slots,
            block_tables=bucket.block_tables,
            context_lens=bucket.context_lens,
            cu_seqlens_q=bucket.cu_seqlens_q,
            max_q_len=1,
            max_context_len=max_context_len,
            backend=runner.backend,
            plan=ops.plan_forward(
                cache.kv_cache,
                bucket.block_tables,
                bucket.context_lens,
                bucket.cu_seqlens_q,
                runner.num_q_heads,
                max_q_len=1,
                max_context_len=max_context_len,
            ),
        )
        args = (runner.model, bucket.ids, bucket.positions, runner.keeps_logits)
        stream = torch.cuda.current_stream()
        side = torch.cuda.Stream(device=runner.device)
        side.wait_stream(stream)
        with torch.cuda.stream(side), bound_metadata(meta):
            for _ in range(2):  # warm-up: Triton compiles, cuBLAS picks its kernels, outside the capture
                self.forward(*args)
        graph = torch.cuda.CUDAGraph()
        try:
            with bound_metadata(meta), torch.cuda.graph(graph, pool=self.pool, stream=side):
                bucket.logits = self.forward(*args)
        except RuntimeError as e:  # an op that syncs with the host, or another that cannot be captured
            raise CaptureFailed(f"the decode forward cannot be captured as a CUDA graph ({e})"[:300]) from e
        stream.wait_stream(side)
        self.pool = graph.pool()
        bucket.graph = graph
        self.buckets[rows] = bucket
        self.owner.recompiles += 1
        self.owner.compile_s += time.perf_counter() - t0
        return bucket


def _weights(model: torch.nn.Module) -> Iterator[torch.Tensor]:
    yield from model.parameters()
    yield from model.buffers()
