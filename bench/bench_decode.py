"""Decode throughput: the engine (mode="sequential") against HF `generate`, side by side in one run.

Same models, same prompts, same response lengths (``ignore_eos``), greedy; the two alternate for
``--repeats`` rounds and the median of each is reported. Generation only: scoring is left out on both sides
(the engine's reward is a constant rule), so the ratio is about decode.

``--sampler`` adds the CPU sampler at B=16, V=151,936 against ``torch.multinomial`` (bench/bench_sampler.py);
``--metadata`` adds the host side of one decode forward at B=256 with 4,096 tokens of context: the
runner's per-forward metadata (persistent block tables) against the rebuild it replaced, side by side.

    python -m bench.bench_decode --preset tiny --batch-size 16 --new-tokens 64 --sampler --metadata
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench import bench_sampler
from bench.baselines import hf_generate
from bench.workloads import PAD_TOKEN_ID, build_models
from oppo_engine import EngineConfig, RolloutEngine, SamplingParams
from oppo_engine.cache import KVArena, KVCacheManager, KVSpec
from oppo_engine.model.runner import ModelRunner, SeqChunk


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_engine(actor, new_tokens: int, batch_size: int) -> RolloutEngine:
    """The engine as a PPO loop holds it: built once, then stepped (its construction is not timed)."""
    return RolloutEngine(
        actor=actor,
        reward=lambda prompt, response: 0.0,
        config=EngineConfig(batch_size=batch_size, mode="sequential", max_model_len=1024),
        sampling=SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True),
    )


def run_engine(engine: RolloutEngine, prompts: list[list[int]]) -> tuple[float, int]:
    """One step over ``prompts``: (seconds, tokens generated)."""
    engine.add_prompts(prompts)
    _sync(engine.device)
    t0 = time.perf_counter()
    tokens = sum(len(r.response_ids) for r in engine.step().rollouts)
    _sync(engine.device)
    return time.perf_counter() - t0, tokens


def run_hf(actor, prompts: list[list[int]], new_tokens: int) -> tuple[float, int]:
    _sync(actor.device)
    t0 = time.perf_counter()
    out = hf_generate(actor, prompts, [new_tokens] * len(prompts), 0.0, 0, PAD_TOKEN_ID)
    _sync(actor.device)
    return time.perf_counter() - t0, sum(len(r) for r in out)


def rebuild_metadata(runner: ModelRunner, chunks: list[SeqChunk]) -> list[torch.Tensor]:
    """The runner's per-forward metadata as it was built before persistent block tables (the baseline):
    every sequence's page list copied out of the cache and flattened into a zero-padded Python table."""
    ids, positions, slots, cu, context_lens, tables = [], [], [], [0], [], []
    for c in chunks:
        q_len, ctx = len(c.token_ids), runner.cache.num_tokens(c.seq_id)
        ids.extend(c.token_ids)
        positions.extend(range(ctx - q_len, ctx))
        slots.extend(c.slots)
        cu.append(cu[-1] + q_len)
        context_lens.append(ctx)
        tables.append(runner.cache.pages(c.seq_id))
    width = max(len(t) for t in tables)
    flat: list[int] = []
    for t in tables:
        flat += t + [0] * (width - len(t))
    last = [i - 1 for i in cu[1:]]
    return [
        torch.tensor(ids + positions + slots + last, dtype=torch.int64),
        torch.tensor(cu + context_lens + flat, dtype=torch.int32),
    ]


def bench_metadata(actor, batch: int = 256, context: int = 4096, repeats: int = 200) -> dict[str, float]:
    """Host time of one decode forward's metadata at ``batch`` x ``context``: today's vs the old rebuild."""
    spec = KVSpec.from_hf_config(actor.config, torch.float32)
    page_size = 16
    pages = batch * -(-(context + 1) // page_size)
    arena = KVArena({"actor": spec}, page_size=page_size, num_pages=pages, device="cpu")  # untouched memory
    runner = ModelRunner(actor, KVCacheManager(arena, "actor"))
    for s in range(batch):
        runner.cache.append_slots(s, context)
    chunks = [SeqChunk(s, [7], runner.cache.append_slots(s, 1)) for s in range(batch)]
    times: dict[str, list[float]] = {"persistent": [], "rebuild": []}
    # Rounds of 10 calls each, the two alternating by round: per-call alternation would charge one side
    # for the other's memory churn (the rebuild allocates 65k-element lists).
    for _ in range(repeats // 10):
        for name, fn in (
            ("persistent", lambda: runner._prepare(chunks)),
            ("rebuild", lambda: rebuild_metadata(runner, chunks)),
        ):
            t0 = time.perf_counter()
            for _ in range(10):
                fn()
            times[name].append((time.perf_counter() - t0) / 10)
    ms = {name: 1e3 * statistics.median(ts) for name, ts in times.items()}
    print(f"host metadata per forward, B={batch} context={context}:")
    for name, v in ms.items():
        print(f"  {name:>10}: {v:8.3f} ms")
    ratio = ms["rebuild"] / ms["persistent"]
    print(f"metadata_speedup_vs_rebuild={ratio:.1f}")
    return {"metadata_ms": ms["persistent"], "rebuild_ms": ms["rebuild"], "metadata_speedup": ratio}


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--metadata", action="store_true", help="also time the host metadata at B=256, ctx 4096")
    p.add_argument("--sampler", action="store_true", help="also time the sampler at B=16, V=151,936")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads, both sides")
    args = p.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    actor, _ = build_models(args.preset, dtype, device, seed=0)
    g = torch.Generator().manual_seed(0)
    vocab = actor.config.vocab_size
    prompts = [
        torch.randint(16, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.batch_size)
    ]
    engine = make_engine(actor, args.new_tokens, args.batch_size)
    run_engine(engine, prompts)  # warm-up both paths
    run_hf(actor, prompts[:2], 4)
    times: dict[str, list[float]] = {"engine": [], "hf": []}
    for _ in range(args.repeats):
        for name, fn in (
            ("engine", lambda: run_engine(engine, prompts)),
            ("hf", lambda: run_hf(actor, prompts, args.new_tokens)),
        ):
            elapsed, tokens = fn()
            assert tokens == args.batch_size * args.new_tokens, (name, tokens)
            times[name].append(elapsed)
    tok = args.batch_size * args.new_tokens
    rates = {name: tok / statistics.median(ts) for name, ts in times.items()}
    print(
        f"preset={args.preset} device={device} B={args.batch_size} "
        f"prompt={args.prompt_len} new={args.new_tokens} threads={torch.get_num_threads()}"
    )
    for name, rate in rates.items():
        print(
            f"{name:>7}: {rate:10.1f} tok/s  "
            f"(median of {args.repeats}: {statistics.median(times[name]):.3f}s)"
        )
    engine.close()
    ratio = rates["engine"] / rates["hf"]
    print(f"decode_throughput_engine_vs_hf={ratio:.2f}")
    result = {"engine_tok_s": rates["engine"], "hf_tok_s": rates["hf"], "ratio": ratio}
    if args.sampler:
        ms = bench_sampler.measure(16, 151_936, reps=10)
        print("sampler B=16 V=151936: " + ", ".join(f"{k} {v:.2f} ms" for k, v in ms.items()))
        result["sampler_vs_multinomial"] = ms["cpp"] / ms["multinomial"]
        print(f"sampler_cpp_vs_multinomial={result['sampler_vs_multinomial']:.3f}")
    if args.metadata:
        result |= bench_metadata(actor)
    return result


if __name__ == "__main__":
    main()
