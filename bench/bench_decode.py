"""Decode throughput: the engine (mode="sequential") against HF `generate`, side by side in one run.

Same models, same prompts, same response lengths (``ignore_eos``), greedy; the two alternate for
``--repeats`` rounds and the median of each is reported. Generation only: scoring is left out on both sides
(the engine's reward is a constant rule), so the ratio is about decode.

    python -m bench.bench_decode --preset tiny --batch-size 16 --new-tokens 64
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.baselines import hf_generate
from bench.workloads import PAD_TOKEN_ID, build_models
from oppo_engine import EngineConfig, RolloutEngine, SamplingParams


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_engine(actor, prompts: list[list[int]], new_tokens: int, batch_size: int) -> tuple[float, int]:
    engine = RolloutEngine(
        actor=actor,
        reward=lambda prompt, response: 0.0,
        config=EngineConfig(batch_size=batch_size, mode="sequential", max_model_len=1024),
        sampling=SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True),
    )
    engine.add_prompts(prompts)
    _sync(actor.device)
    t0 = time.perf_counter()
    tokens = sum(len(r.response_ids) for r in engine.step().rollouts)
    _sync(actor.device)
    elapsed = time.perf_counter() - t0
    engine.close()
    return elapsed, tokens


def run_hf(actor, prompts: list[list[int]], new_tokens: int) -> tuple[float, int]:
    _sync(actor.device)
    t0 = time.perf_counter()
    out = hf_generate(actor, prompts, [new_tokens] * len(prompts), 0.0, 0, PAD_TOKEN_ID)
    _sync(actor.device)
    return time.perf_counter() - t0, sum(len(r) for r in out)


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    actor, _ = build_models(args.preset, dtype, device, seed=0)
    g = torch.Generator().manual_seed(0)
    vocab = actor.config.vocab_size
    prompts = [
        torch.randint(16, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.batch_size)
    ]
    run_engine(actor, prompts[:2], 4, 2)  # warm-up both paths
    run_hf(actor, prompts[:2], 4)
    times: dict[str, list[float]] = {"engine": [], "hf": []}
    for _ in range(args.repeats):
        for name, fn in (
            ("engine", lambda: run_engine(actor, prompts, args.new_tokens, args.batch_size)),
            ("hf", lambda: run_hf(actor, prompts, args.new_tokens)),
        ):
            elapsed, tokens = fn()
            assert tokens == args.batch_size * args.new_tokens, (name, tokens)
            times[name].append(elapsed)
    tok = args.batch_size * args.new_tokens
    rates = {name: tok / statistics.median(ts) for name, ts in times.items()}
    print(
        f"preset={args.preset} device={device} B={args.batch_size} "
        f"prompt={args.prompt_len} new={args.new_tokens}"
    )
    for name, rate in rates.items():
        print(
            f"{name:>7}: {rate:10.1f} tok/s  "
            f"(median of {args.repeats}: {statistics.median(times[name]):.3f}s)"
        )
    ratio = rates["engine"] / rates["hf"]
    print(f"decode_throughput_engine_vs_hf={ratio:.2f}")
    return {"engine_tok_s": rates["engine"], "hf_tok_s": rates["hf"], "ratio": ratio}


if __name__ == "__main__":
    main()
