"""A pack's attention: the dense block-diagonal mask, one causal sdpa call per sequence, batched calls.

    python -m bench.bench_pack_attention --rounds 3

A packed update (``max_tokens_per_microbatch``) runs sdpa over the whole pack with transformers' dense
``T x T`` block-diagonal causal mask: most of the square lies between sequences and is masked off, yet
computed. The exact alternative on a CPU without a varlen kernel is to split the pack and run one causal
sdpa per sequence (``torch.split``, so the backward concatenates instead of zero-filling a full-size
gradient per slice). The third, ``pack_attention="batched"`` (``oppo_engine/ppo/pack_attention.py``),
buckets the pack's sequences by length (a new bucket wherever a sequence is shorter than half its bucket's
longest), gathers each bucket into a right-padded batch ``[n, heads, L, head_dim]``, makes one causal sdpa
call over it and scatters the outputs back (``batched_sdpa``, what the trainer runs in every layer). Beside
it, the same with one bucket: one call over the whole pack, ``n x L^2``, which a pack of mixed lengths (a
whole random minibatch) keeps near ``T^2``. The sequences lie longest first, as ``plan_sorted_packs``
orders a pack. This times the four,
forward and backward, at SmolLM2-135M's attention shape (9 query
heads, 3 KV heads, head size 64, bf16) over the sequences of one minibatch of 8 of ``bench_update``'s
lengths (16-token prompts, lognormal responses of mean ~110, sigma 1): process CPU time per call, the arms
alternated, the minimum over the rounds, the load beside it; and the largest difference of each arm's
outputs from the dense mask's.
"""

from __future__ import annotations

import argparse
import math
import os
import time

import torch
import torch.nn.functional as F

from oppo_engine.ppo.pack_attention import PackLayout, batched_sdpa, bucket_lengths


def lengths(seed: int = 0, n: int = 8) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    mu = math.log(110.0) - 0.5
    return [16 + t for t in (torch.randn(n, generator=g) + mu).exp().round().clamp(1, 512).long().tolist()]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=5, help="calls per round and arm")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    lens = sorted(lengths(), reverse=True)
    total = sum(lens)
    heads, kv_heads, dim = 9, 3, 64
    g = torch.Generator().manual_seed(1)
    q, k, v = (
        torch.randn(1, h, total, dim, generator=g).to(dtype).requires_grad_()
        for h in (heads, kv_heads, kv_heads)
    )
    grad = torch.randn(1, heads, total, dim, generator=g).to(dtype)
    seq = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    pos = torch.cat([torch.arange(n) for n in lens])
    mask = ((seq[:, None] == seq[None]) & (pos[:, None] >= pos[None]))[None, None]

    def dense():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    def split():
        parts = zip(*(x.split(lens, 2) for x in (q, k, v)), strict=True)
        outs = [F.scaled_dot_product_attention(a, b, c, is_causal=True, enable_gqa=True) for a, b, c in parts]
        return torch.cat(outs, 2)

    one, bucketed = PackLayout.of(lens, "cpu", ratio=math.inf), PackLayout.of(lens, "cpu")
    buckets = [[lens[i] for i in b] for b in bucket_lengths(lens)]

    def batched(layout):
        return lambda: batched_sdpa(q, k, v, layout).transpose(1, 2)  # [1, T, H, D] -> [1, H, T, D]

    arms = {
        "dense mask": dense,
        "one call per sequence": split,
        "one batched call": batched(one),
        f"{len(buckets)} bucketed calls": batched(bucketed),
    }
    best = {name: math.inf for name in arms}
    inside = sum(n * (n + 1) // 2 for n in lens) / total**2
    fill = total / (len(lens) * max(lens))
    print(f"lengths {lens}, T = {total}: {inside:.1%} of the T x T square is attended; the batched call's "
          f"{len(lens)} x {max(lens)} padded batch is {fill:.1%} tokens; buckets {buckets}; {args.dtype}, "
          f"{torch.get_num_threads()} threads")  # fmt: skip
    for r in range(args.rounds):
        for name, fn in arms.items():
            t = time.process_time()
            for _ in range(args.calls):
                fn().backward(grad)
            ms = (time.process_time() - t) / args.calls * 1e3
            best[name] = min(best[name], ms)
            print(
                f"  round {r}: {name:22s} {ms:7.1f} ms CPU forward+backward (load {os.getloadavg()[0]:.2f})"
            )
    with torch.no_grad():
        reference = dense().float()
        diff = {name: (fn().float() - reference).abs().max().item() for name, fn in arms.items()}
    for name, ms in best.items():
        print(f"{name}: {ms:.1f} ms (min of {args.rounds}); largest |difference| from the dense mask's "
              f"outputs {diff[name]:.3g}")  # fmt: skip
    return {"best_ms": best, "max_diff": diff}


if __name__ == "__main__":
    main()
