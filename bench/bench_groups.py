"""Shared vs unshared prompts for n samples per prompt: tokens through each model and step time.

    python -m bench.bench_groups --preset small --n 8 --groups 2 --prompt-len 384 --response-len 16

Both sides produce the same rollouts: ``shared`` queues each prompt once with ``SamplingParams(n)`` (its
prefix prefilled once per model, pages shared), ``unshared`` queues it n times, each copy seeded as the
group's sample would be (what a user without groups would do), with ``share_prompt_prefix=False``: the
engine's default would find the copies alike and share them as a group does (docs/concepts.md, "Shared
prompt prefixes"), and this bench measures a group's sharing against none. Steps alternate between the
two in one process, so machine drift hits both alike; the responses are checked to be identical in
float32 (in bf16 on CUDA the two sides' prefills run GEMMs at other row counts, which may round
differently: a difference is reported, not raised). The speed-up line is machine-readable:
``speedup_shared_vs_unshared=X.XX``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from oppo_engine import EngineConfig, RolloutEngine, SamplingParams
from oppo_engine.presets import EOS_TOKEN_ID, PRESETS, build_models
from oppo_engine.sched.prompts import derive_seed, sample_seed

SEED = 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options; see --help."""
    p = argparse.ArgumentParser(prog="python -m bench.bench_groups", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="small", help=f"one of {sorted(PRESETS)} or a checkpoint directory")
    p.add_argument("--n", type=int, default=8, help="samples per prompt")
    p.add_argument("--groups", type=int, default=2, help="prompts per step (B = groups * n rollouts)")
    p.add_argument("--prompt-len", type=int, default=384)
    p.add_argument("--response-len", type=int, default=16, help="tokens per response (EOS ignored)")
    p.add_argument("--rounds", type=int, default=3, help="measured steps per side")
    p.add_argument("--mode", default="sequential", choices=["sequential", "intra"])
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    if args.n < 1 or args.groups < 1 or args.rounds < 1 or args.prompt_len < 2 or args.response_len < 1:
        p.error("--n, --groups, --rounds, --response-len must be >= 1 and --prompt-len >= 2")
    return args


def _engine(actor, reward, args, n: int) -> RolloutEngine:
    batch = args.groups * args.n
    config = EngineConfig(
        batch_size=batch,
        mode=args.mode,
        max_model_len=args.prompt_len + args.response_len + 1,
        max_num_batched_tokens=max(4096, args.prompt_len),
        share_prompt_prefix=n > 1,  # the unshared side: n copies that share nothing (see the docstring)
    )
    sampling = SamplingParams(max_new_tokens=args.response_len, ignore_eos=True, seed=SEED, n=n)
    return RolloutEngine(actor, reward, config=config, sampling=sampling, eos_token_id=EOS_TOKEN_ID)


def _tokens_through(engine: RolloutEngine) -> dict[str, int]:
    """Tokens each model ran its forward over in the last step (prefill and decode)."""
    out: dict[str, int] = {}
    for span in engine.timeline.spans():
        out[span.lane] = out.get(span.lane, 0) + int(span.args.get("tokens", 0))
    return out


def main(argv: list[str] | None = None) -> None:
    """Run both sides step by step, alternating, and print the table."""
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    actor, reward = build_models(args.preset, dtype, args.device, seed=SEED)
    vocab = actor.config.vocab_size
    g = torch.Generator().manual_seed(SEED)
    steps = args.rounds + 1  # the first step of each side warms up
    prompts = [
        torch.randint(4, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(steps * args.groups)
    ]

    shared = _engine(actor, reward, args, args.n)
    shared.add_prompts(prompts)
    unshared = _engine(actor, reward, args, 1)
    copies, sampling = [], []
    for i, p in enumerate(prompts):
        for j in range(args.n):
            copies.append(p)
            seed = sample_seed(derive_seed(SEED, i), j)
            sampling.append(SamplingParams(max_new_tokens=args.response_len, ignore_eos=True, seed=seed))
    unshared.add_prompts(copies, sampling)

    times: dict[str, list[float]] = {"shared": [], "unshared": []}
    tokens: dict[str, dict[str, int]] = {"shared": {}, "unshared": {}}
    responses: dict[str, list[list[int]]] = {"shared": [], "unshared": []}
    for step in range(steps):
        order = [("shared", shared), ("unshared", unshared)]
        if step % 2:
            order.reverse()
        for name, engine in order:
            t0 = time.perf_counter()
            result = engine.step()
            dt = time.perf_counter() - t0
            rollouts = sorted(result.rollouts, key=lambda r: (r.group_id, r.sample_index))
            responses[name].extend(r.response_ids for r in rollouts)
            if step == 0:
                continue
            times[name].append(dt)
            for lane, n in _tokens_through(engine).items():
                tokens[name][lane] = tokens[name].get(lane, 0) + n
            print(f"step {step} {name:8s} {dt * 1e3:9.1f} ms  shared tokens {result.metrics.shared_tokens}")

    identical = responses["shared"] == responses["unshared"]
    med = {k: statistics.median(v) for k, v in times.items()}
    print()
    print(
        f"preset={args.preset} mode={args.mode} n={args.n} groups/step={args.groups} "
        f"prompt={args.prompt_len} response={args.response_len} device={args.device} "
        f"threads={torch.get_num_threads()} rounds={args.rounds}"
    )
    print(
        f"{'side':10s} {'step ms (median)':>17s} "
        + " ".join(f"{lane + ' tokens':>15s}" for lane in tokens["unshared"])
    )
    for name in ("unshared", "shared"):
        cols = " ".join(f"{tokens[name].get(lane, 0):15d}" for lane in tokens["unshared"])
        print(f"{name:10s} {med[name] * 1e3:17.1f} {cols}")
    ratios = " ".join(
        f"{lane}={tokens['unshared'][lane] / max(1, tokens['shared'].get(lane, 0)):.2f}x"
        for lane in tokens["unshared"]
    )
    print(f"tokens through each model, unshared / shared: {ratios}")
    print(f"identical responses: {identical}")
    print(f"speedup_shared_vs_unshared={med['unshared'] / med['shared']:.2f}")
    if not identical:
        same = sum(a == b for a, b in zip(responses["shared"], responses["unshared"], strict=True))
        equal = f"{same} of {len(responses['shared'])} equal"
        if dtype == torch.float32:
            raise SystemExit(f"shared and unshared rollouts differ ({equal})")
        # bf16 on CUDA: the two sides prefill at other row counts (one prompt per group, or n copies), and
        # cuBLAS picks its kernels by shape, so the prompts' K/V may round differently: not a sharing fault.
        print(
            f"NOTE: {equal} in {dtype}: GEMMs at other row counts may round differently (float32 is checked)"
        )


if __name__ == "__main__":
    main()
