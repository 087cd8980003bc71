"""Paged attention on 7B-class shapes: 32 q heads, 8 KV heads, head_dim 128, bf16, 16-token pages.

    python bench/bench_attention.py [--quick] [--out bench_attention.csv]

Per row: median time (``triton.testing.do_bench``, which flushes L2 between runs); achieved GB/s for
decode (bytes of K/V read + q + out) or TFLOP/s for prefill (the causal FLOPs the chunk needs); those as a
fraction of the device-to-device copy bandwidth (read + write bytes of a 1 GiB copy) and of the bf16
8192^3 matmul rate, both measured at the start of the same run; and the speed ratio (baseline time / ours,
> 1 means ours is faster) against SDPA on pre-gathered contiguous KV -- the baseline a user would
otherwise write; its gather time is excluded from the ratio and reported in its own column -- and against
flash-attn's paged kernel when ``flash_attn`` imports (its paged path needs pages of 256 tokens, so it
gets its own cache with that page size). Rows where the launcher chose split-KV also time the unsplit
kernel. Pages are handed out in a random order, as after a few steps of allocation and preemption; the
cache holds one layer (the page stride does not change what a layer's attention reads).
"""

from __future__ import annotations

import argparse
import csv
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import triton
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel

from oppo_engine.kernels.paged_attention import _plan, paged_attention, plan_attention

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, PAGE_SIZE, DTYPE = 32, 8, 128, 16, torch.bfloat16
FLASH_PAGE_SIZE = 256
# The math backend would make a slow strawman: the baseline may use only the fused ones.
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]

FULL_DECODE = [(batch, ctx) for batch in (1, 8, 64) for ctx in (512, 4096, 16384)]
FULL_PREFILL = [(batch, chunk, 4096) for chunk in (128, 512) for batch in (1, 4)]
QUICK_DECODE = [(1, 4096), (64, 4096), (1, 16384)]
QUICK_PREFILL = [(1, 512, 4096)]


@dataclass
class Row:
    kind: str
    batch: int
    q_len: int
    context: int
    splits: int
    time_us: float
    gb_s: float | None = None
    tflop_s: float | None = None
    frac_of_copy_bw: float | None = None
    frac_of_matmul: float | None = None
    unsplit_us: float | None = None
    sdpa_us: float | None = None
    sdpa_gather_us: float | None = None  # excluded from vs_sdpa
    vs_sdpa: float | None = None
    max_abs_diff_vs_sdpa: float | None = None  # sanity: both compute the same attention
    flash_attn_us: float | None = None
    vs_flash_attn: float | None = None
    note: str = ""


def _bench_us(fn: Callable[[], object]) -> float:
    return 1e3 * triton.testing.do_bench(fn, return_mode="median")


def measure_copy_gb_s() -> float:
    src = torch.ones(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = _bench_us(lambda: dst.copy_(src))
    return 2 * src.numel() / us / 1e3


def measure_matmul_tflop_s() -> float:
    n = 8192
    a, b = (torch.randn((n, n), dtype=DTYPE, device="cuda") for _ in range(2))
    c = torch.empty_like(a)
    us = _bench_us(lambda: torch.matmul(a, b, out=c))
    return 2 * n**3 / us / 1e6


def decode_bytes(batch: int, ctx: int) -> int:
    itemsize = DTYPE.itemsize
    kv = batch * ctx * NUM_KV_HEADS * HEAD_DIM * 2 * itemsize
    return kv + 2 * batch * NUM_Q_HEADS * HEAD_DIM * itemsize  # + q + out


def prefill_flops(batch: int, chunk: int, ctx: int) -> int:
    """QK^T and PV over the keys each new token sees (token i of the chunk sees ctx - chunk + i + 1)."""
    keys_seen = chunk * (ctx - chunk) + chunk * (chunk + 1) // 2
    return batch * 4 * NUM_Q_HEADS * HEAD_DIM * keys_seen


def build_paged(batch: int, q_len: int, ctx: int, page_size: int) -> dict[str, torch.Tensor]:
    pages_per_seq = triton.cdiv(ctx, page_size)
    num_pages = batch * pages_per_seq
    kv_cache = torch.randn((num_pages, 1, 2, page_size, NUM_KV_HEADS, HEAD_DIM), dtype=DTYPE, device="cuda")
    block_tables = torch.randperm(num_pages, device="cuda").view(batch, pages_per_seq).to(torch.int32)
    return dict(
        q=torch.randn((batch * q_len, NUM_Q_HEADS, HEAD_DIM), dtype=DTYPE, device="cuda"),
        kv_cache=kv_cache,
        block_tables=block_tables,
        context_lens=torch.full((batch,), ctx, dtype=torch.int32, device="cuda"),
        cu_seqlens_q=torch.arange(0, (batch + 1) * q_len, q_len, dtype=torch.int32, device="cuda"),
    )


def gather_contiguous(t: dict[str, torch.Tensor], batch: int, ctx: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V as [B, Hkv, ctx, D]: what a user copies out of the pages before calling SDPA."""
    pages = t["kv_cache"][t["block_tables"].long(), 0]  # [B, pages, 2, page, Hkv, D]
    kv = pages.transpose(1, 2).reshape(batch, 2, -1, NUM_KV_HEADS, HEAD_DIM)[:, :, :ctx]
    return kv[:, 0].transpose(1, 2).contiguous(), kv[:, 1].transpose(1, 2).contiguous()


def sdpa_fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_len: int, ctx: int) -> tuple[Callable, str]:
    """SDPA on [B, H, S, D]; GQA natively where a fused backend takes it, else on KV expanded to all heads.

    Call the returned function under ``sdpa_kernel(SDPA_BACKENDS)``.
    """
    mask = None
    if q_len > 1:
        from torch.nn.attention.bias import causal_lower_right

        mask = causal_lower_right(q_len, ctx)
    scale = HEAD_DIM**-0.5

    def native():
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale, enable_gqa=True
        )

    try:
        native()
        return native, ""
    except Exception:
        group = NUM_Q_HEADS // NUM_KV_HEADS
        k_rep, v_rep = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)

        def expanded():
            return torch.nn.functional.scaled_dot_product_attention(
                q, k_rep, v_rep, attn_mask=mask, scale=scale
            )

        return expanded, "sdpa on KV expanded to 32 heads (no fused GQA for this shape)"


def flash_attn_us(batch: int, q_len: int, ctx: int) -> float | None:
    try:
        from flash_attn import flash_attn_with_kvcache
    except Exception:
        return None
    t = build_paged(batch, q_len, ctx, FLASH_PAGE_SIZE)
    k_cache = t["kv_cache"][:, 0, 0].contiguous()  # [blocks, 256, Hkv, D]
    v_cache = t["kv_cache"][:, 0, 1].contiguous()
    q = t["q"].view(batch, q_len, NUM_Q_HEADS, HEAD_DIM)
    return _bench_us(
        lambda: flash_attn_with_kvcache(
            q,
            k_cache,
            v_cache,
            cache_seqlens=t["context_lens"],
            block_table=t["block_tables"],
            softmax_scale=HEAD_DIM**-0.5,
            causal=True,
        )
    )


def bench_paged_and_sdpa(row: Row, copy_gb_s: float, matmul_tflop_s: float) -> None:
    """Fill ``row`` with our kernel's numbers and SDPA's on the same data (frees it all on return)."""
    batch, q_len, ctx = row.batch, row.q_len, row.context
    t = build_paged(batch, q_len, ctx, PAGE_SIZE)
    out = torch.empty_like(t["q"])
    args = (t["q"], t["kv_cache"], 0, t["block_tables"], t["context_lens"], t["cu_seqlens_q"], HEAD_DIM**-0.5)

    # Planned once, as the engine plans once per forward for all layers.
    plans = {
        per_split: plan_attention(
            *args[1:2],
            *args[3:6],
            NUM_Q_HEADS,
            max_q_len=q_len,
            max_context_len=ctx,
            q_lens=[q_len] * batch,
            kv_per_split=per_split,
        )  # fmt: skip
        for per_split in (None, -(-ctx // 64) * 64)
    }

    def ours(kv_per_split: int | None = None):
        return paged_attention(*args, out=out, plan=plans[kv_per_split])

    row.time_us = _bench_us(ours)
    if row.kind == "decode":
        row.gb_s = decode_bytes(batch, ctx) / row.time_us / 1e3
        row.frac_of_copy_bw = row.gb_s / copy_gb_s
    else:
        row.tflop_s = prefill_flops(batch, q_len, ctx) / row.time_us / 1e6
        row.frac_of_matmul = row.tflop_s / matmul_tflop_s
    if row.splits > 1:
        row.unsplit_us = _bench_us(lambda: ours(kv_per_split=-(-ctx // 64) * 64))

    try:
        row.sdpa_gather_us = _bench_us(lambda: gather_contiguous(t, batch, ctx))
        k, v = gather_contiguous(t, batch, ctx)
        q = t["q"].view(batch, q_len, NUM_Q_HEADS, HEAD_DIM).transpose(1, 2)
        with sdpa_kernel(SDPA_BACKENDS):
            fn, row.note = sdpa_fn(q, k, v, q_len, ctx)
            row.sdpa_us = _bench_us(fn)
            expected = fn().transpose(1, 2).reshape(out.shape)
        row.vs_sdpa = row.sdpa_us / row.time_us
        row.max_abs_diff_vs_sdpa = (ours().float() - expected.float()).abs().max().item()
    except Exception as exc:  # a missing backend must not hide our own numbers
        row.note = f"sdpa failed: {type(exc).__name__}: {exc}"[:120]


def bench_row(kind: str, batch: int, q_len: int, ctx: int, copy_gb_s: float, matmul_tflop_s: float) -> Row:
    q_lens = None if q_len == 1 else [q_len] * batch
    plan, _ = _plan(q_lens, batch, NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, ctx, DTYPE)
    row = Row(kind, batch, q_len, ctx, plan.num_splits, time_us=float("nan"))
    bench_paged_and_sdpa(row, copy_gb_s, matmul_tflop_s)
    torch.cuda.empty_cache()
    row.flash_attn_us = flash_attn_us(batch, q_len, ctx)
    if row.flash_attn_us is not None:
        row.vs_flash_attn = row.flash_attn_us / row.time_us
    torch.cuda.empty_cache()
    return row


def _fmt(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)


def print_table(rows: list[Row]) -> None:
    fields = [f for f in asdict(rows[0]) if f != "note"]
    cells = [[_fmt(getattr(r, f)) for f in fields] for r in rows]
    widths = [max(len(f), *(len(c[i]) for c in cells)) for i, f in enumerate(fields)]
    print("  ".join(f.rjust(w) for f, w in zip(fields, widths, strict=True)))
    for row, c in zip(rows, cells, strict=True):
        print(
            "  ".join(x.rjust(w) for x, w in zip(c, widths, strict=True))
            + (f"  {row.note}" if row.note else "")
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="reduced grid (< 2 minutes)")
    parser.add_argument("--out", default="bench_attention.csv", help="CSV output path")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_attention: CUDA not available, nothing to measure")
        return 0

    torch.manual_seed(0)
    copy_gb_s, matmul_tflop_s = measure_copy_gb_s(), measure_matmul_tflop_s()
    print(
        f"{torch.cuda.get_device_name()}: copy {copy_gb_s:.0f} GB/s (read + write), "
        f"bf16 matmul 8192^3 {matmul_tflop_s:.0f} TFLOP/s; vs_* = baseline time / ours (> 1: ours faster); "
        "SDPA gather time excluded from vs_sdpa"
    )
    decode, prefill = (QUICK_DECODE, QUICK_PREFILL) if args.quick else (FULL_DECODE, FULL_PREFILL)
    rows = []
    shapes = [("decode", batch, 1, ctx) for batch, ctx in decode]
    shapes += [("prefill", batch, chunk, ctx) for batch, chunk, ctx in prefill]
    for kind, batch, q_len, ctx in shapes:
        rows.append(bench_row(kind, batch, q_len, ctx, copy_gb_s, matmul_tflop_s))
        print(f"{kind} batch={batch} q_len={q_len} context={ctx}: {rows[-1].time_us:.1f} us", flush=True)
    print()
    print_table(rows)
    with open(args.out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(asdict(rows[0])) + ["copy_gb_s", "matmul_tflop_s"])
        writer.writeheader()
        for row in rows:
            writer.writerow(asdict(row) | {"copy_gb_s": copy_gb_s, "matmul_tflop_s": matmul_tflop_s})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
