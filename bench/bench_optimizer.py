"""The PPO update's optimizer step: torch's default AdamW against ``fused=True`` (``ppo.trainer.adamw``).

    python -m bench.bench_optimizer --params 135e6 --rounds 3

AdamW over ``--params`` fp32 parameters in tensors of ~0.5M (SmolLM2-135M's size), a step after the state
exists; the arms alternate, the minimum over the rounds of the mean of two steps, the machine's load
beside it; and the largest difference of the weights after three steps from the same gradients.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

ARMS = {"default": {}, "foreach": {"foreach": True}, "fused": {"fused": True}}


def _params(n: int, chunks: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(n // chunks, generator=g)) for _ in range(chunks)]
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g) * 1e-3
    return ps


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--params", type=float, default=135e6)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    n = int(args.params)
    chunks = max(1, n // 500_000)
    times: dict[str, list[float]] = {a: [] for a in ARMS}
    after: dict[str, torch.Tensor] = {}
    print(f"load before: {os.getloadavg()}")
    for r in range(args.rounds):
        for arm, kw in ARMS.items():
            ps = _params(n, chunks)
            opt = torch.optim.AdamW(ps, lr=5e-6, **kw)
            opt.step()  # the states
            t = time.perf_counter()
            opt.step()
            opt.step()
            times[arm].append((time.perf_counter() - t) / 2)
            if r == 0:
                after[arm] = torch.cat([p.detach().flatten() for p in ps[:8]])
            del opt, ps
    best = {a: min(v) for a, v in times.items()}
    for arm, s in best.items():
        diff = (after[arm] - after["default"]).abs().max().item()
        print(f"{arm:8s} {s:.3f} s/step  {best['default'] / s:.2f}x default  max |w - w_default| {diff:.1e}")
    print(f"load after: {os.getloadavg()}")
    return best


if __name__ == "__main__":
    main()
