"""Figures for the CUDA-path fixes that a CPU can give: attention programs launched per layer (the flat
work list against the old (longest chunk's q blocks) x Hkv x N grid), and the reference log-probs' memory
and time (gather minus a row-blocked logsumexp against log_softmax over float32 rows), side by side.

    python -m bench.bench_cuda_path            # one run, the two formulas alternating
"""

from __future__ import annotations

import argparse
import time

import torch

from oppo_engine.kernels.paged_attention import _plan
from oppo_engine.model.scorer import picked_logprobs, scaled_logsumexp


def programs(
    q_lens: list[int], num_q_heads: int, num_kv_heads: int, head_dim: int, ctx: int
) -> tuple[int, int]:
    """(old grid, new grid) programs per layer for one forward, 7B-class bf16 tiles. The old launch used
    the prefill tiles for the whole batch and did not split a grid of >= 2 x 132 programs."""
    plan, _ = _plan(q_lens, len(q_lens), num_q_heads, num_kv_heads, head_dim, ctx, torch.bfloat16)
    new = sum(launch.num_items for launch in plan.launches) * num_kv_heads * plan.num_splits
    block_q = 128 // (num_q_heads // num_kv_heads)
    old = -(-max(q_lens) // block_q) * num_kv_heads * len(q_lens)
    return old, new


def old_logprobs(logits, inv_t, rows, tokens):
    return (logits.float() * inv_t[:, None]).log_softmax(-1)[rows, tokens]


def new_logprobs(logits, inv_t, rows, tokens):
    return picked_logprobs(logits, inv_t, scaled_logsumexp(logits, inv_t), rows, tokens)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=512)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()

    for prefill in (512, 4096):
        old, new = programs([prefill] + [1] * 255, 32, 8, 128, 4096)
        print(
            f"programs per layer, one {prefill}-token chunk among 255 decodes at ctx 4096: "
            f"old grid {old:,}, work list x 8 splits {new:,} ({old / new:.1f}x fewer)"
        )
    rows, vocab = 4096, 151_936
    print(
        f"reference log-probs at {rows} rows x {vocab} vocab: old 3 fp32 [R, V] = "
        f"{3 * rows * vocab * 4 / 2**30:.1f} GiB, new one bf16 [R, V] = {rows * vocab * 2 / 2**30:.2f} GiB "
        f"+ a 0.25 GiB fp32 block"
    )

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(args.rows, args.vocab, generator=gen).to(torch.bfloat16)
    inv_t = 1.0 / (0.5 + torch.rand(args.rows, generator=gen))
    picks = torch.arange(args.rows), torch.randint(0, args.vocab, (args.rows,), generator=gen)
    times = {"old": [], "new": []}
    for _ in range(args.repeats):  # alternating, one run
        for name, fn in (("old", old_logprobs), ("new", new_logprobs)):
            t0 = time.perf_counter()
            fn(logits, inv_t, *picks)
            times[name].append(time.perf_counter() - t0)
    old_s, new_s = (sorted(times[k])[len(times[k]) // 2] for k in ("old", "new"))
    diff = (old_logprobs(logits, inv_t, *picks) - new_logprobs(logits, inv_t, *picks)).abs().max().item()
    print(
        f"ref log-probs CPU {args.rows}x{args.vocab} bf16: old {old_s * 1e3:.1f} ms, "
        f"new {new_s * 1e3:.1f} ms; "
        f"ref_logprobs_new_vs_old_speed={old_s / new_s:.2f} max_abs_diff={diff:.1e}"
    )


if __name__ == "__main__":
    main()
