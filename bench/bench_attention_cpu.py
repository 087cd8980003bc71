"""CPU paged attention: the C++ op (through ``ops.paged_attention``) beside ``paged_attention_ref``.

    python -m bench.bench_attention_cpu [--threads N] [--cpu] [--only NAME]
    python -m bench.bench_attention_cpu --arena [--threads N]

``--arena``: SmolLM2's decode (9 q heads, 3 KV heads, head_dim 64, contexts 40-79) in an engine-sized arena
of 30 layers (1,024 pages), one layer's call at a time: "out of cache" walks the 30 layers in turn, as a
decode step does (each layer's K/V read from memory), "in cache" repeats one layer. Fastest of 7 rounds.

The reference is what the CPU engine ran before the op existed (gather pages, SDPA in fp32). Shapes: the
``tiny`` preset's attention (4 q heads, 2 KV heads, head_dim 16, 2 layers) decoding 16 and 64 sequences at
~100 tokens of context, and Qwen2-0.5B's (14 q heads, 2 KV heads, head_dim 64) at 16 x 512 tokens, plus a
prefill chunk and a sliding window on the latter, and SmolLM2-135M's decode (fp32 and bf16, B = 16 and 64).
Contexts vary by sequence and pages are scattered, as after a few steps of allocation. Times are medians of
``torch.utils.benchmark`` runs of one forward's attention (every layer once); ``speedup`` = reference time /
op time.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass

import torch
from torch.utils import benchmark

from oppo_engine import ops
from oppo_engine.kernels.paged_attention import paged_attention_ref

PAGE_SIZE = 16


@dataclass(frozen=True)
class Shape:
    name: str
    batch: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    context: int
    q_len: int = 1
    layers: int = 2
    window: int | None = None
    dtype: torch.dtype = torch.float32


SHAPES = [
    Shape("tiny decode", 16, 4, 2, 16, 100),
    Shape("tiny decode", 64, 4, 2, 16, 100),
    Shape("0.5b decode", 16, 14, 2, 64, 512),
    Shape("0.5b decode bf16", 16, 14, 2, 64, 512, dtype=torch.bfloat16),
    Shape("0.5b decode window 128", 16, 14, 2, 64, 512, window=128),
    Shape("0.5b prefill chunk 64", 4, 14, 2, 64, 512, q_len=64),
    # SmolLM2-135M's attention (9 q heads, 3 KV heads, head_dim 64) as bench_decode --model smollm2 decodes
    # it: a 32-token prompt and 48 new tokens, ~56 tokens of context on average.
    *(
        Shape("smollm2 decode", batch, 9, 3, 64, 56, dtype=dtype)
        for dtype in (torch.float32, torch.bfloat16)
        for batch in (16, 64)
    ),
]


def build(shape: Shape, gen: torch.Generator) -> tuple:
    """Inputs of one forward: contexts within +-10% of ``shape.context``, pages in shuffled order."""
    spread = max(1, shape.context // 10)
    ctx = torch.randint(shape.context - spread, shape.context + spread + 1, (shape.batch,), generator=gen)
    pages_per_seq = (ctx + PAGE_SIZE - 1) // PAGE_SIZE
    num_pages = int(pages_per_seq.sum())
    kv_cache = torch.randn(
        (num_pages, shape.layers, 2, PAGE_SIZE, shape.num_kv_heads, shape.head_dim), generator=gen
    ).to(shape.dtype)
    ids = torch.randperm(num_pages, generator=gen).to(torch.int32)
    block_tables = torch.zeros((shape.batch, int(pages_per_seq.max())), dtype=torch.int32)
    start = 0
    for n, count in enumerate(pages_per_seq.tolist()):
        block_tables[n, :count] = ids[start : start + count]
        start += count
    q = torch.randn((shape.batch * shape.q_len, shape.num_q_heads, shape.head_dim), generator=gen)
    cu_seqlens_q = torch.arange(0, (shape.batch + 1) * shape.q_len, shape.q_len, dtype=torch.int32)
    return q.to(shape.dtype), kv_cache, block_tables, ctx.to(torch.int32), cu_seqlens_q


def median_us(fn, min_run_time: float) -> float:
    # NOTE: Timer runs its statement on num_threads threads, 1 unless told: pass torch's (--threads).
    timer = benchmark.Timer("fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
    return timer.blocked_autorange(min_run_time=min_run_time).median * 1e6


def cpu_us(fn, min_run_time: float) -> float:
    """Thread CPU time per call, fastest of 7 rounds: on a loaded machine the work done, which wall time
    (the other processes' share of the cores) is not. One thread only (``--cpu`` sets it)."""
    fn()
    calls = max(1, int(min_run_time / 7 / max(1e-6, _thread_seconds(fn, 1))))
    return min(_thread_seconds(fn, calls) for _ in range(7)) * 1e6


def _thread_seconds(fn, calls: int) -> float:
    start = time.thread_time()
    for _ in range(calls):
        fn()
    return (time.thread_time() - start) / calls


def measure(shape: Shape, min_run_time: float, timer=median_us) -> dict:
    q, kv_cache, block_tables, context_lens, cu_seqlens_q = build(shape, torch.Generator().manual_seed(0))
    scale = shape.head_dim**-0.5
    out = torch.empty_like(q)

    def op():
        for layer in range(shape.layers):
            ops.paged_attention(
                q,
                kv_cache,
                layer,
                block_tables,
                context_lens,
                cu_seqlens_q,
                scale,
                sliding_window=shape.window,
                out=out,
            )
        return out

    def ref():
        for layer in range(shape.layers):
            o = paged_attention_ref(
                q,
                kv_cache,
                layer,
                block_tables,
                context_lens,
                cu_seqlens_q,
                scale,
                sliding_window=shape.window,
            )
        return o

    diff = (op().float() - ref().float()).abs().max().item()
    op_us, ref_us = timer(op, min_run_time), timer(ref, min_run_time)
    # K/V bytes one forward must read (each key once per KV head), for the op's effective bandwidth.
    keys = context_lens.clamp(max=shape.window) if shape.window and shape.q_len == 1 else context_lens
    kv_bytes = (
        int(keys.sum()) * 2 * shape.num_kv_heads * shape.head_dim * kv_cache.element_size() * shape.layers
    )
    return dict(
        shape=shape.name,
        dtype=str(shape.dtype).removeprefix("torch."),
        B=shape.batch,
        heads=f"{shape.num_q_heads}/{shape.num_kv_heads}",
        D=shape.head_dim,
        ctx=f"~{shape.context}",
        q_len=shape.q_len,
        layers=shape.layers,
        ref_us=f"{ref_us:.0f}",
        op_us=f"{op_us:.1f}",
        speedup=f"{ref_us / op_us:.1f}x",
        op_kv_GB_s=f"{kv_bytes / op_us / 1e3:.2f}",
        max_abs_diff=f"{diff:.1e}",
    )


def arena_decode(dtype: torch.dtype, batch: int, layers: int = 30, pages: int = 1024) -> tuple[float, float]:
    """``--arena``: microseconds a call (out of cache, in cache) of SmolLM2's decode attention."""
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, dim = 9, 3, 64
    arena = torch.randn(pages, layers, 2, PAGE_SIZE, kv_heads, dim, generator=gen).to(dtype)
    ctx = torch.randint(40, 80, (batch,), generator=gen, dtype=torch.int32)
    per_seq = (int(ctx.max()) + PAGE_SIZE - 1) // PAGE_SIZE
    tables = torch.randperm(pages, generator=gen)[: batch * per_seq].view(batch, per_seq).to(torch.int32)
    cu = torch.arange(batch + 1, dtype=torch.int32)
    q = torch.randn(batch, heads, dim, generator=gen).to(dtype)
    out = torch.empty_like(q)

    def call(layer: int) -> None:
        ops.paged_attention(q, arena, layer, tables, ctx, cu, dim**-0.5, out=out)

    for layer in range(layers):
        call(layer)
    best = {}
    for name, pick in (("out", lambda i: i), ("in", lambda i: 0)):
        times = []
        for _ in range(7):
            t0 = time.perf_counter()
            for i in range(layers):
                call(pick(i))
            times.append((time.perf_counter() - t0) / layers)
        best[name] = min(times) * 1e6
    return best["out"], best["in"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--min-run-time", type=float, default=0.5, help="seconds per measurement")
    parser.add_argument(
        "--cpu",
        action="store_true",
        help="thread CPU time, min of 7 rounds, one thread (loaded machines)",
    )
    parser.add_argument("--only", default=None, help="only the shapes whose name contains this")
    parser.add_argument(
        "--arena", action="store_true", help="SmolLM2's decode in a 30-layer arena, in/out of cache"
    )
    args = parser.parse_args(argv)
    if args.arena:
        if args.threads:
            torch.set_num_threads(args.threads)
        print(
            f"SmolLM2 decode attention, 30-layer arena, {torch.get_num_threads()} threads, "
            "us a call (fastest of 7)"
        )
        for dtype in (torch.bfloat16, torch.float32):
            for batch in (16, 64):
                out_us, in_us = arena_decode(dtype, batch)
                print(
                    f"  {str(dtype).removeprefix('torch.'):>8} B={batch:<3} out of cache {out_us:6.0f}  "
                    f"in cache {in_us:6.0f}  load {os.getloadavg()[0]:.1f}"
                )
        return 0
    if args.cpu:
        args.threads = 1
    if args.threads:
        torch.set_num_threads(args.threads)
    kind = "thread CPU time, fastest of 7 rounds" if args.cpu else "wall time, median"
    print(
        f"CPU, {torch.get_num_threads()} threads, {PAGE_SIZE}-token pages; {kind} per forward (all layers); "
        f"load {os.getloadavg()[0]:.1f}"
    )
    shapes = [s for s in SHAPES if args.only is None or args.only in s.name]
    rows = [measure(shape, args.min_run_time, cpu_us if args.cpu else median_us) for shape in shapes]
    widths = {k: max(len(k), *(len(str(r[k])) for r in rows)) for k in rows[0]}
    print("  ".join(k.rjust(w) for k, w in widths.items()))
    for r in rows:
        print("  ".join(str(r[k]).rjust(w) for k, w in widths.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
