"""The one module that touches the compiled extension and the Triton kernels.

Everything else in oppo_engine calls ``ops.*``. Each function picks its implementation from the device of
its inputs: the C++ CPU ops on the CPU (the torch references are the tests' oracles), the CUDA ops and the
Triton kernels (or flash-attn, where selected and importable) on CUDA.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import torch

from oppo_engine import _C
from oppo_engine.kernels import cache_ops as _cache_fallback
from oppo_engine.kernels import flash_backend as _flash
from oppo_engine.kernels import paged_attention as _attn
from oppo_engine.kernels import sample as _sample

PageAllocator = _C.PageAllocator
AttentionPlan = _attn.AttentionPlan
plan_attention = _attn.plan_attention
attention_scratch_numel = _attn.scratch_numel  # a shared split-KV scratch's size (plan_forward(scratch=))
KV_PER_SPLIT = _attn.KV_PER_SPLIT  # keys per split-KV split (a sequence's plan reads its own context only)

ATTENTION_BACKENDS = ("triton", "flash_attn")

# Whether the CPU attention and sampler ops run on torch's intra-op threads (the extension was built with
# OpenMP); without it they run on the calling thread alone.
CPU_OPS_PARALLEL: bool = _C.intra_op_parallel

# Whether the extension was built with its CUDA cache kernels (nvcc at build time). Without them, CUDA
# tensors take the Triton/torch fallbacks of oppo_engine/kernels/cache_ops.py: the engine needs no nvcc.
CUDA_CACHE_OPS = torch._C._dispatch_has_kernel_for_dispatch_key("oppo::reshape_and_cache", "CUDA")


def cache_ops_backend(device: torch.device) -> str:
    """Which implementation runs the cache ops on ``device``: "cpu", "cuda" (compiled) or "triton"."""
    if device.type != "cuda":
        return "cpu"
    return "cuda" if CUDA_CACHE_OPS else "triton"


# Run the Triton kernels on CPU tensors too (only under TRITON_INTERPRET=1): lets the CPU test suite drive
# the real kernels through the whole engine, as they run on CUDA.
_triton_on_cpu = os.environ.get("OPPO_TRITON_ON_CPU") == "1"


@contextlib.contextmanager
def triton_on_cpu() -> Iterator[None]:
    """Within the block, CPU tensors go through the Triton kernels (interpreted) instead of the references."""
    global _triton_on_cpu
    saved, _triton_on_cpu = _triton_on_cpu, True
    try:
        yield
    finally:
        _triton_on_cpu = saved


def triton_on_cpu_active() -> bool:
    """Whether CPU tensors take the Triton kernels (under :func:`triton_on_cpu` or ``OPPO_TRITON_ON_CPU=1``)
    rather than the C++ ops."""
    return _triton_on_cpu


@torch.library.register_fake("oppo::reshape_and_cache")
def _reshape_and_cache_fake(key, value, kv_cache, slot_mapping, layer):  # noqa: ARG001
    return None


@torch.library.register_fake("oppo::copy_pages")
def _copy_pages_fake(src, dst, src_ids, dst_ids):  # noqa: ARG001
    return None


@torch.library.register_fake("oppo::paged_attention")
def _paged_attention_fake(
    q, kv_cache, layer, block_tables, context_lens, cu_seqlens_q, scale, sliding_window, softcap, out
):  # noqa: ARG001
    return None


@torch.library.register_fake("oppo::sample")
def _sample_fake(logits, temperature, seeds, positions):  # noqa: ARG001
    num_rows = logits.shape[0]
    return logits.new_empty(num_rows, dtype=torch.int64), logits.new_empty(num_rows, dtype=torch.float32)


@torch.library.register_fake("oppo::rms_norm")
def _rms_norm_fake(x, weight, eps):  # noqa: ARG001
    return torch.empty_like(x)


@torch.library.register_fake("oppo::silu_mul")
def _silu_mul_fake(gate, up):  # noqa: ARG001
    return torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)


@torch.library.register_fake("oppo::small_linear")
def _small_linear_fake(x, blocked, kblock):  # noqa: ARG001
    return torch.empty((x.shape[0], blocked.shape[0] * 16), dtype=x.dtype, device=x.device)


@torch.library.register_fake("oppo::llama_decode_layer")
def _llama_decode_layer_fake(hidden, *args):  # noqa: ARG001
    return torch.empty_like(hidden)


@torch.library.register_fake("oppo::llama_decode_layers")
def _llama_decode_layers_fake(hidden, *args):  # noqa: ARG001
    return torch.empty_like(hidden)


@torch.library.register_fake("oppo::rotary_and_cache")
def _rotary_and_cache_fake(q, k, v, cos, sin, kv_cache, slot_mapping, layer):  # noqa: ARG001
    return torch.empty_like(q)


def reshape_and_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor, layer: int
) -> None:
    """Write one layer's new K/V ``[T, H, D]`` into ``kv_cache`` at ``slot_mapping`` (``-1`` skips).

    ``kv_cache`` is one model's view ``[num_pages, L, 2, page_size, H, D]`` of the arena; the write happens on
    the caller's current stream.
    """
    if kv_cache.is_cuda and not CUDA_CACHE_OPS:
        _cache_fallback.reshape_and_cache(key, value, kv_cache, slot_mapping, layer)
        return
    torch.ops.oppo.reshape_and_cache(key, value, kv_cache, slot_mapping, layer)


def copy_pages(src: torch.Tensor, dst: torch.Tensor, src_ids: torch.Tensor, dst_ids: torch.Tensor) -> None:
    """Copy page ``src_ids[i]`` of ``src`` onto page ``dst_ids[i]`` of ``dst`` (``[P, page_bytes]`` uint8).

    ``src``/``dst`` may be the arena or a pinned host buffer; the ids are int64 CPU tensors.
    """
    if (src.is_cuda or dst.is_cuda) and not CUDA_CACHE_OPS:
        _cache_fallback.copy_pages(src, dst, src_ids, dst_ids)
        return
    torch.ops.oppo.copy_pages(src, dst, src_ids, dst_ids)


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
    backend: str = "triton",
    out: torch.Tensor | None = None,
    plan: AttentionPlan | None = None,
) -> torch.Tensor:
    """Varlen paged attention of packed queries ``q [T, Hq, D]`` over the cache; returns ``[T, Hq, D]``.

    ``context_lens`` counts the cached tokens including the new ones (already written); new token ``i`` of
    sequence ``n`` attends causally up to position ``context_lens[n] - q_len_n + i``, and with
    ``sliding_window = w`` only to keys after ``position - w`` (HF's window); ``softcap = c`` caps the scaled
    scores to ``c * tanh(s / c)`` before masking. ``plan`` (from :func:`plan_attention`, once per forward)
    spares the Triton path its per-layer checks and planning; the C++ CPU op checks in C++ and ignores it.
    """
    if not (q.is_cuda or _triton_on_cpu):
        _attn.check_window_softcap(sliding_window, softcap)  # the op reads <= 0 as "none": refuse 0 here
        if out is None:
            out = torch.empty_like(q)
        torch.ops.oppo.paged_attention(
            q,
            kv_cache,
            layer,
            block_tables,
            context_lens,
            cu_seqlens_q,
            scale,
            sliding_window or 0,
            softcap or 0.0,
            out,
        )
        return out
    if backend == "flash_attn":
        result = _flash.paged_attention(
            q,
            kv_cache,
            layer,
            block_tables,
            context_lens,
            cu_seqlens_q,
            scale,
            sliding_window=sliding_window,
            softcap=softcap,
            max_q_len=max_q_len,
            max_context_len=max_context_len,
            plan=plan,
        )
        return result if out is None else out.copy_(result)  # flash-attn allocates its own output
    return _attn.paged_attention(
        q,
        kv_cache,
        layer,
        block_tables,
        context_lens,
        cu_seqlens_q,
        scale,
        sliding_window=sliding_window,
        softcap=softcap,
        max_q_len=max_q_len,
        max_context_len=max_context_len,
        out=out,
        plan=plan,
    )


def plan_forward(
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    num_q_heads: int,
    *,
    max_q_len: int,
    max_context_len: int,
    q_lens: list[int] | None = None,
    scratch: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> AttentionPlan | None:
    """The once-per-forward plan of the attention path the tensors will take (checks included), or None
    where that path needs none (the C++ CPU op checks its inputs itself, cheaply, in every call).
    ``q_lens`` (host ints) builds the kernel's work list without reading the device; ``scratch`` (flat
    float32 buffers) holds the split-KV partials in place of new ones
    (``oppo_engine/kernels/paged_attention.py``)."""
    if not (kv_cache.is_cuda or _triton_on_cpu):
        return None
    return plan_attention(
        kv_cache,
        block_tables,
        context_lens,
        cu_seqlens_q,
        num_q_heads,
        max_q_len=max_q_len,
        max_context_len=max_context_len,
        q_lens=q_lens,
        scratch=scratch,
    )


def attention_backend_unavailable(backend: str, page_size: int, device: torch.device) -> str | None:
    """Why ``backend`` cannot run attention for a cache of ``page_size`` on ``device``; None if it can."""
    if backend == "triton":
        return None
    if backend == "flash_attn":
        return _flash.unavailable_reason(page_size, device)
    return f"unknown attention backend {backend!r}; choose one of {ATTENTION_BACKENDS}"


def packed_linear_supported(weight: torch.Tensor) -> bool:
    """Whether ``weight`` (an ``nn.Linear``'s) can be packed for :func:`packed_linear`: a 2-D CPU tensor,
    bf16 (where oneDNN has bf16) or fp32 while torch's fp32 matmuls run at full precision (a reduced
    ``float32_matmul_precision`` would let oneDNN use bf16 products)."""
    if weight.device.type != "cpu" or weight.dim() != 2 or weight.layout != torch.strided:
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    if weight.dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if weight.dtype == torch.float32:
        precision = getattr(torch.backends.mkldnn.matmul, "fp32_precision", "none")
        return torch.get_float32_matmul_precision() == "highest" and precision in ("none", "ieee")
    return False


def pack_linear_weight(weight: torch.Tensor, batch_hint: int) -> torch.Tensor:
    """``weight [N, K]`` in oneDNN's blocked layout, for :func:`packed_linear` (a copy; ``batch_hint``: the
    usual number of input rows, which picks the layout; any number works)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_hint)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with the weight packed by :func:`pack_linear_weight` (no autograd)."""
    if not x.is_contiguous():
        x = x.contiguous()
    return torch.ops.mkldnn._linear_pointwise(
        x, packed, None if bias is None else bias.detach(), "none", [], ""
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's Llama-form RMSNorm of ``x [..., H]`` (contiguous CPU float32 or bfloat16, ``weight [H]`` of the
    same dtype), bit for bit: ``weight * (x.float() * rsqrt(x.float().pow(2).mean(-1) + eps)).to(x.dtype)``
    in one op (``oppo_engine/model/fused.py``). No autograd."""
    return torch.ops.oppo.rms_norm(x, weight, eps)


def rotary_and_cache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    layer: int,
) -> torch.Tensor:
    """HF's rotary embedding of ``q [T, Hq, D]`` and ``k [T, Hkv, D]`` by ``cos``/``sin [T, D]``, bit for bit
    (``x * cos + rotate_half(x) * sin``, each op rounded to the dtype); the rotated ``k`` and ``v`` are
    written into ``kv_cache`` at ``slot_mapping`` as :func:`reshape_and_cache` writes them, and the rotated
    ``q`` is returned (contiguous). ``q``, ``k`` and ``v`` need only their last dim contiguous: views of a
    grouped q|k|v product are read in place. CPU float32 or bfloat16, one op
    (``oppo_engine/model/fused.py``)."""
    return torch.ops.oppo.rotary_and_cache(q, k, v, cos, sin, kv_cache, slot_mapping, layer)


# torch's elementwise loops (TensorIterator's for_each) run below this many elements on the calling thread,
# from it in chunks split evenly over the intra-op threads (at::internal::GRAIN_SIZE; ATen/ParallelOpenMP.h).
_TORCH_GRAIN = 32768
# Whether silu_mul runs here and its lanes are torch's: the extension's AVX-512 routine, and torch running
# its own AVX-512 kernels (its vector SiLU calls the same Sleef exp on 16 lanes).
SILU_MUL_AVAILABLE: bool = bool(torch.ops.oppo.silu_mul_available()) and (
    torch.backends.cpu.get_cpu_capability() == "AVX512"
)


def silu_mul_exact(rows: int, width: int, dtype: torch.dtype, threads: int | None = None) -> bool:
    """Whether :func:`silu_mul` over ``[rows, width]`` operands is bit for bit torch's
    ``F.silu(gate) * up`` on contiguous ones, at ``threads`` intra-op threads (default torch's).

    Two checks, the verdict kept per (rows, width, dtype, threads): the rule, that torch's SiLU loop over
    the ``rows * width`` elements takes its vector path for every element -- each of its chunks (one below
    ``_TORCH_GRAIN`` elements, else one per thread: checked for every team size up to ``threads``) a
    multiple of its two-vector step (64 bf16 or 32 float32 elements); a chunk's remainder goes through a
    scalar ``std::exp``, which rounds otherwise; and a probe, the op against torch's two ops on random
    operands of that shape, which would catch a torch whose kernels changed under the rule."""
    if not SILU_MUL_AVAILABLE or dtype not in (torch.float32, torch.bfloat16) or width % 16 or rows < 1:
        return False
    threads = torch.get_num_threads() if threads is None else threads
    key = (rows, width, dtype, threads)
    verdict = _silu_verdicts.get(key)
    if verdict is None:
        verdict = _silu_rule(rows, width, dtype, threads) and _silu_probe(rows, width, dtype)
        with _silu_lock:
            _silu_verdicts[key] = verdict
    return verdict


_silu_verdicts: dict[tuple, bool] = {}
_silu_lock = threading.Lock()


def _silu_rule(rows: int, width: int, dtype: torch.dtype, threads: int) -> bool:
    step = 64 if dtype == torch.bfloat16 else 32
    numel = rows * width
    if numel % step:
        return False
    if numel < _TORCH_GRAIN:
        return True
    for team in range(2, max(1, threads) + 1):
        tasks = min(team, -(-numel // _TORCH_GRAIN))
        chunk = -(-numel // tasks)
        if any(min(chunk, numel - t * chunk) % step for t in range(tasks) if t * chunk < numel):
            return False
    return True


def _mixed_scale(rows: int, cols: int, gen: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """A probe's random ``[rows, cols]`` operand: normal values at scales from 0.05 to 20, so that sums
    cancel and round at every magnitude (a last-bit difference of another order shows more often)."""
    scale = 10.0 ** (torch.rand(rows, cols, generator=gen) * 2.6 - 1.3)
    return (torch.randn(rows, cols, generator=gen) * scale).to(dtype)


def _silu_probe(rows: int, width: int, dtype: torch.dtype) -> bool:
    """The op against torch's two ops, bit for bit, on random halves of a ``[rows, 2 * width]`` product
    (values at scales from 0.05 to 20; several draws where the shape is small, so the few elements a loop's
    scalar tail would take are drawn often enough to show a last-bit difference). The operands are views of
    one random pool per dtype (``_silu_pool``), drawn once and grown as larger shapes ask: drawing them
    afresh took 17-44 ms of a 37-58 ms probe of a prefill's 913-1,760 rows, and a process probes every new
    row count."""
    as_int = torch.int16 if dtype == torch.bfloat16 else torch.int32
    draws = 1 if rows * width >= 4096 else 8
    numel = rows * 2 * width
    pool = _silu_pool(dtype, draws * numel)
    for d in range(draws):
        y = pool[d * numel : (d + 1) * numel].view(rows, 2 * width)
        gate, up = y.split(width, dim=-1)
        want = torch.nn.functional.silu(gate.contiguous()) * up.contiguous()
        got = torch.ops.oppo.silu_mul(gate, up)
        if not torch.equal(got.view(as_int), want.view(as_int)):
            return False
    return True


# The probes' random operands by dtype (``_silu_pool``), and the most elements kept (32 MB of float32; a
# prefill of 2,048 rows of SmolLM2's 2 x 1,536 is 6.3M): a larger probe draws its own.
_silu_pools: dict[torch.dtype, torch.Tensor] = {}
_SILU_POOL_MAX = 1 << 23


def _silu_pool(dtype: torch.dtype, numel: int) -> torch.Tensor:
    """At least ``numel`` random elements of ``dtype`` at mixed scales (``_mixed_scale``), flat: the kept pool
    where it is large enough, else a new one, kept where ``numel`` is at most ``_SILU_POOL_MAX`` (twice the
    old pool's size, up to that bound, so a run of growing prefills draws a few times, not at each)."""
    pool = _silu_pools.get(dtype)
    if pool is not None and pool.numel() >= numel:
        return pool
    keep = numel <= _SILU_POOL_MAX
    size = max(numel, min(_SILU_POOL_MAX, 2 * (0 if pool is None else pool.numel()))) if keep else numel
    gen = torch.Generator().manual_seed(size)
    pool = _mixed_scale(1, size, gen, dtype).view(-1)
    if keep:
        with _silu_lock:
            _silu_pools[dtype] = pool  # another thread's probe holds its own reference to an older one
    return pool


# Whether small_linear runs here (the extension's AVX-512 BF16 routine on a CPU that has it).
SMALL_LINEAR_AVAILABLE: bool = bool(torch.ops.oppo.small_linear_available())
# Up to this many rows a packed bf16 product may run as small_linear (model/packed.py). Measured on Zen 5 with
# two threads, SmolLM2-135M's five product shapes out of cache (passes of up to 16 rows, the weight
# prefetched; bench/results/small_linear_zen5_2026-12-06f.txt): 1.12-1.82x faster than oneDNN's at 1, 2, 8,
# 16, 17, 24 and 32 rows, 1.02-1.21x at 64 (oneDNN's kernels near the GEMM rate there). More rows: not
# measured.
SMALL_LINEAR_ROWS = 64
# The row counts probed together (ops.small_linear_kblock): a process whose batches stay at 8 rows or fewer
# pays only for the first band.
_SMALL_LINEAR_BANDS = ((1, 8), (9, 16), (17, 32), (33, 64))
# The runs of K over which oneDNN sums bf16 rows in float32 before adding the runs' sums (measured on
# torch 2.13's oneDNN: 512 inputs with one row and up to K = 1024; 1024 from two rows at K = 1536 and 2048);
# the probe picks among them.
_SMALL_LINEAR_RUNS = (512, 1024)
# Outputs compared per candidate run by the probe (a wrong order shows as a last-bit difference in ~3e-5 to
# 2e-4 of the outputs of mixed-scale rows: an even-first pair order, the least, 18 expected here), and the
# most draws it makes to get them: a product with fewer rows x columns is left to oneDNN.
_SMALL_LINEAR_PROBE_ELEMENTS = 1 << 19
_SMALL_LINEAR_PROBE_DRAWS = 8192


def small_linear_supported(weight: torch.Tensor) -> bool:
    """Whether ``weight [N, K]`` can be blocked for :func:`small_linear`: a CPU bfloat16 matrix with ``N`` a
    multiple of 16 and ``K`` even, on a CPU that runs the op."""
    return (
        SMALL_LINEAR_AVAILABLE
        and weight.dim() == 2
        and weight.dtype == torch.bfloat16
        and weight.device.type == "cpu"
        and weight.shape[0] % 16 == 0
        and weight.shape[1] % 2 == 0
        and weight.shape[1] > 0
    )


def block_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight [N, K]`` bf16 as :func:`small_linear` reads it: ``[N / 16, K / 2, 16, 2]``, each 16-column
    panel's input pairs interleaved (a copy, never a view of ``weight``)."""
    n, k = weight.shape
    if n % 16 or k % 2:
        raise ValueError(f"block_linear_weight: needs N % 16 == 0 and K even, got [{n}, {k}]")
    out = torch.empty((n // 16, k // 2, 16, 2), dtype=weight.dtype, device=weight.device)
    out.copy_(weight.detach().reshape(n // 16, 16, k // 2, 2).permute(0, 2, 1, 3))
    return out


def small_linear(x: torch.Tensor, blocked: torch.Tensor, kblock: int) -> torch.Tensor:
    """``x [M, K] @ weight.T`` for a few bf16 rows, from the weight blocked by :func:`block_linear_weight`:
    float32 sums over runs of ``kblock`` inputs (pairs in order, as ``vdpbf16ps`` adds them), the runs' sums
    added in order, rounded to bf16 once. That is oneDNN's order where :func:`small_linear_kblock` found it
    (the caller checks), so the result is bit for bit :func:`packed_linear`'s there. ``x`` contiguous. No
    autograd."""
    return torch.ops.oppo.small_linear(x, blocked, int(kblock))


def small_linear_kblock(rows: int, k: int, n: int, batch_hint: int) -> int | None:
    """The run of K for which :func:`small_linear` is bit for bit :func:`packed_linear` over a weight
    ``[n, k]`` packed at ``batch_hint``, for ``rows``-row inputs at torch's intra-op thread count, or ``None``
    where no candidate is, or where the probe cannot tell.

    oneDNN's order of summation depends on the shapes, the rows, the pack's layout and the threads, not on the
    weights' values: the verdict is kept per (rows, K, N, batch hint, threads) and probed once, on a random
    weight of that shape packed at that hint (not a model's: a zero weight would pass anything), with random
    rows at scales from 0.05 to 20 until ``_SMALL_LINEAR_PROBE_ELEMENTS`` outputs were compared. The
    candidates are the runs of ``_SMALL_LINEAR_RUNS`` shorter than K and one run over all of K; the verdict is
    the one candidate that matched every bit, where every other one differed somewhere (so the probe could
    tell them apart: not so where K is barely above a run's length, which is declined); a product too narrow
    to compare that many outputs within ``_SMALL_LINEAR_PROBE_DRAWS`` draws is left to oneDNN."""
    if not SMALL_LINEAR_AVAILABLE or rows < 1 or k < 2 or k % 2 or n < 16 or n % 16:
        return None
    threads = torch.get_num_threads()
    key = (rows, k, n, batch_hint, threads)
    verdict = _small_verdicts.get(key, _UNPROBED)  # a verdict never changes once set: read without the lock
    if verdict is _UNPROBED:
        # Every row count of the band at once: one random weight packed for them all.
        band = next(((lo, hi) for lo, hi in _SMALL_LINEAR_BANDS if lo <= rows <= hi), (rows, rows))
        found = _small_probe(list(range(band[0], band[1] + 1)), k, n, batch_hint)
        with _small_lock:
            for r, v in found.items():
                _small_verdicts.setdefault((r, k, n, batch_hint, threads), v)
            verdict = _small_verdicts[key]
    return verdict


_small_verdicts: dict[tuple, int | None] = {}
_UNPROBED = object()
_small_lock = threading.Lock()


def _small_probe(rows: list[int], k: int, n: int, batch_hint: int) -> dict[int, int | None]:
    # The ops themselves, not this module's names: a caller may have wrapped those (the twin's calibration
    # times the products through them), and the probe's calls are not a model's.
    gen = torch.Generator().manual_seed(k * 31 + n)
    weight = (torch.randn(n, k, generator=gen) * 0.05).to(torch.bfloat16)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint)
    blocked = block_linear_weight(weight)
    candidates = sorted({r for r in _SMALL_LINEAR_RUNS if r < k} | {k})  # k: one run over all of K
    verdicts: dict[int, int | None] = {}
    with torch.inference_mode():
        for m in rows:
            draws = -(-_SMALL_LINEAR_PROBE_ELEMENTS // (m * n))
            matches = set(candidates) if draws <= _SMALL_LINEAR_PROBE_DRAWS else set()
            for _ in range(draws if matches else 0):
                x = _mixed_scale(m, k, gen, torch.bfloat16)
                want = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "").view(torch.int16)
                matches = {
                    r
                    for r in matches
                    if torch.equal(torch.ops.oppo.small_linear(x, blocked, r).view(torch.int16), want)
                }
                if not matches:
                    break
            # One candidate left: every other one differed from oneDNN somewhere, so the probe could tell
            # them apart. Two left (K barely above a run's length: their sums differ too rarely to show):
            # neither. None left, or too narrow to probe: oneDNN's product.
            verdicts[m] = matches.pop() if len(matches) == 1 else None
    return verdicts


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``F.silu(gate) * up`` in one op, bit for bit where :func:`silu_mul_exact` says so (the caller checks):
    ``gate``/``up [..., W]`` CPU float32 or bfloat16 of one shape, each with its last dim contiguous and its
    rows evenly spaced (the two halves of a grouped gate|up product, without copying them), ``W % 16 == 0``.
    Returns a contiguous tensor. No autograd (``oppo_engine/model/fused.py``)."""
    return torch.ops.oppo.silu_mul(gate, up)


def sample(
    logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gumbel-max sampling with counter-based noise keyed by (seed, position); ``temperature == 0`` is greedy.

    Returns ``(tokens [N] int64, logprobs [N] float32)``, the log-prob under the distribution sampled from.
    """
    if logits.is_cuda or _triton_on_cpu:
        return _sample.sample(logits, temperature, seeds, positions)
    return torch.ops.oppo.sample(logits, temperature, seeds, positions)


def llama_decode_layer(
    hidden: torch.Tensor,
    input_norm: tuple[torch.Tensor, float],
    qkv: tuple[torch.Tensor, int, list[int]],
    head_dim: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    scale: float,
    o: tuple[torch.Tensor, int],
    post_norm: tuple[torch.Tensor, float],
    gate_up: tuple[torch.Tensor, int, list[int]],
    down: tuple[torch.Tensor, int],
) -> torch.Tensor:
    """One Llama-form decoder layer over ``hidden [1, T, H]`` (bf16, CPU) in one C++ op: :func:`rms_norm`
    (``input_norm``: weight, eps), the grouped q|k|v product as :func:`small_linear` (``qkv``: blocked weight,
    run, the three widths), :func:`rotary_and_cache` into ``kv_cache``, :func:`paged_attention` (no window,
    no softcap), the output projection (``o``: blocked weight, run), the residual add, :func:`rms_norm`
    (``post_norm``), the grouped gate|up product (``gate_up``), :func:`silu_mul`, the down projection
    (``down``) and the residual add. Bit for bit those calls made one by one; the caller checks that each is
    what the layer would run (``oppo_engine/model/fused.py``: each product's run probed, SiLU exact). No
    autograd."""
    return torch.ops.oppo.llama_decode_layer(
        hidden, input_norm[0], input_norm[1], qkv[0], int(qkv[1]), qkv[2], head_dim, cos, sin, kv_cache,
        slot_mapping, layer, block_tables, context_lens, cu_seqlens_q, scale, o[0], int(o[1]), post_norm[0],
        post_norm[1], gate_up[0], int(gate_up[1]), gate_up[2], down[0], int(down[1]),
    )  # fmt: skip


class DecodeLayer(NamedTuple):
    """One Llama-form decoder layer's operands for :func:`llama_decode_layers` (those of
    :func:`llama_decode_layer` that differ from layer to layer)."""

    input_norm: tuple[torch.Tensor, float]  # weight, eps
    qkv: tuple[torch.Tensor, int, list[int]]  # blocked weight, run, the three widths
    head_dim: int
    layer: int  # the layer's index in kv_cache
    scale: float
    o: tuple[torch.Tensor, int]
    post_norm: tuple[torch.Tensor, float]
    gate_up: tuple[torch.Tensor, int, list[int]]
    down: tuple[torch.Tensor, int]


def llama_decode_layers(
    hidden: torch.Tensor,
    layers: Sequence[DecodeLayer],
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
) -> torch.Tensor:
    """``layers`` one after the other over ``hidden [1, T, H]`` in one C++ op: each exactly
    :func:`llama_decode_layer` with its :class:`DecodeLayer` operands and the shared rotary tables and
    attention metadata, so bit for bit those calls made one by one. What it saves is a model's Python between
    its layers (``oppo_engine/model/fused.py``'s ``decode_logits``). No autograd."""
    weights: list[torch.Tensor] = []
    ints: list[int] = []
    floats: list[float] = []
    for d in layers:
        if len(d.qkv[2]) != 3 or len(d.gate_up[2]) != 2:
            raise ValueError(
                f"llama_decode_layers: three q|k|v widths and two gate|up widths a layer, got {d.qkv[2]} and "
                f"{d.gate_up[2]}"
            )
        weights += (d.input_norm[0], d.qkv[0], d.o[0], d.post_norm[0], d.gate_up[0], d.down[0])
        ints += (int(d.qkv[1]), *d.qkv[2], d.head_dim, d.layer, int(d.o[1]), int(d.gate_up[1]), *d.gate_up[2])
        ints.append(int(d.down[1]))
        floats += (d.input_norm[1], d.scale, d.post_norm[1])
    return torch.ops.oppo.llama_decode_layers(
        hidden,
        weights,
        ints,
        floats,
        cos,
        sin,
        kv_cache,
        slot_mapping,
        block_tables,
        context_lens,
        cu_seqlens_q,
    )
