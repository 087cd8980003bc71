"""The CPU sampler beside what a user would otherwise run, on fp32 logits of B rows.

    python bench/bench_sampler.py [--reps 20] [--threads N]

Columns (median ms over ``--reps`` interleaved calls after a warm-up):

- ``cpp``: ``torch.ops.oppo.sample`` (what ``ops.sample`` runs on the CPU), every row sampled at T = 0.8;
- ``cpp_greedy``: the same op with every row greedy (no noise drawn);
- ``sample_ref``: the pure-torch reference with the same counter-based noise (the CPU path before the op);
- ``multinomial``: ``log_softmax(logits / T)``, ``torch.multinomial(exp(.))`` and the log-prob gather --
  the baseline a user would otherwise write (its own RNG, so not batch-invariant);
- ``argmax_lsm``: greedy ``argmax`` + ``log_softmax`` gather, the floor for an all-greedy batch.

A second table times ``Sampler``'s top-k / top-p truncation (which runs in torch before the op) at B=16,
V=151,936, T=0.8: ``prefix`` (top-k selection of 4096 candidates per row, the path it takes) beside
``full_sort`` (a sort of the whole vocabulary, its fallback for rows the prefix cannot settle).

The last line, ``sampler_cpp_vs_multinomial=<ratio>``, is cpp / multinomial at B=16, V=151,936 (the goal is
<= 0.5). Logits are ``3 * randn``: a flat-ish distribution, so no vocabulary region can be skipped.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from oppo_engine import ops  # noqa: F401  (loads the extension that registers torch.ops.oppo.sample)
from oppo_engine.kernels.sample import sample_ref
from oppo_engine.model.sampler import _truncate, _truncate_sorted

SHAPES = [(16, 151_936), (64, 151_936), (16, 512), (64, 512)]
COLUMNS = ["cpp", "cpp_greedy", "sample_ref", "multinomial", "argmax_lsm"]
TRUNCATIONS = [(50, 1.0), (0, 0.9), (50, 0.9), (0, 0.99)]  # (top_k, top_p); 0 = no top-k


def median_ms(fns: dict[str, Callable[[], object]], reps: int) -> dict[str, float]:
    """Median wall time of each function; calls are interleaved so a noisy neighbour slows all alike."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(reps):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: 1e3 * statistics.median(t) for name, t in times.items()}


def multinomial(logits: torch.Tensor, temperature: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logprobs = torch.log_softmax(logits / temperature[:, None], dim=-1)
    tokens = torch.multinomial(logprobs.exp(), 1)
    return tokens.squeeze(1), logprobs.gather(1, tokens).squeeze(1)


def argmax_lsm(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = logits.argmax(dim=-1, keepdim=True)
    return tokens.squeeze(1), torch.log_softmax(logits, dim=-1).gather(1, tokens).squeeze(1)


def measure(batch: int, vocab: int, reps: int) -> dict[str, float]:
    gen = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn((batch, vocab), generator=gen)
    temperature = torch.full((batch,), 0.8)
    greedy = torch.zeros(batch)
    seeds = torch.randint(0, 2**62, (batch,), generator=gen)
    positions = torch.randint(0, 2**20, (batch,), generator=gen)
    fns = {
        "cpp": lambda: torch.ops.oppo.sample(logits, temperature, seeds, positions),
        "cpp_greedy": lambda: torch.ops.oppo.sample(logits, greedy, seeds, positions),
        "sample_ref": lambda: sample_ref(logits, temperature, seeds, positions),
        "multinomial": lambda: multinomial(logits, temperature),
        "argmax_lsm": lambda: argmax_lsm(logits),
    }
    return median_ms(fns, reps)


def measure_truncation(reps: int) -> None:
    batch, vocab = 16, 151_936
    logits = 3 * torch.randn((batch, vocab), generator=torch.Generator().manual_seed(1))
    temperature = torch.full((batch,), 0.8)
    print(f"{'top_k':>6} {'top_p':>6} {'prefix':>10} {'full_sort':>10}")
    for top_k, top_p in TRUNCATIONS:
        k, p = torch.full((batch,), top_k), torch.full((batch,), top_p)
        ms = median_ms(
            {
                "prefix": lambda k=k, p=p: _truncate(logits, temperature, k, p),
                "full_sort": lambda k=k, p=p: _truncate_sorted(logits, temperature, k, p),
            },
            reps,
        )
        print(f"{top_k:>6} {top_p:>6} {ms['prefix']:>10.1f} {ms['full_sort']:>10.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    print(f"torch {torch.__version__}, {threads} threads, fp32 logits, median ms of {args.reps} calls")
    print(f"{'B':>4} {'V':>8} " + " ".join(f"{c:>12}" for c in COLUMNS) + f" {'cpp/multin':>11}")
    results = {}
    for batch, vocab in SHAPES:
        ms = results[batch, vocab] = measure(batch, vocab, args.reps)
        ratio = ms["cpp"] / ms["multinomial"]
        print(f"{batch:>4} {vocab:>8} " + " ".join(f"{ms[c]:>12.3f}" for c in COLUMNS) + f" {ratio:>11.3f}")
    measure_truncation(max(3, args.reps // 4))
    ms = results[16, 151_936]
    print(f"sampler_cpp_vs_multinomial={ms['cpp'] / ms['multinomial']:.3f}")


if __name__ == "__main__":
    main()
