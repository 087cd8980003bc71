"""The exact non-GEMM cuts of a SmolLM2 decode step, each measured alone: the same engine stepped with the
cut on and off, the two alternating.

The "on" arm runs every exact fusion of ``oppo_engine/model/fused.py``; the "off" arm the same minus
``--cut`` (``norm``: the fused RMSNorms; ``attention``: the fused rotary embedding and cache write of Llama's
attention; ``all``: both), by switching the actor runner's ``ModelRunner.fused``, so both arms run the
same engine, weights, cache and prompts. Each round runs one engine step per arm (32-token prompts,
``--new-tokens`` greedy with ``ignore_eos``, prefill included) and records per generated token: the
calling thread's CPU time (``time.thread_time``; the figure a loaded machine moves least), the process's
CPU time and the wall time; the fastest of ``--rounds`` is reported, with ``os.getloadavg()`` beside it.
Both arms' tokens and log-probs are compared: they must be equal to the bit.

    python -m bench.bench_cuts --dtype bf16 --batch-size 16 --cut attention --rounds 5
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from bench.bench_decode import DTYPES, make_engine
from oppo_engine.model import fused
from oppo_engine.model.runner import ModelRunner

CUTS = {"norm": ("is_llama_rms_norm",), "attention": ("is_llama_attention",)}
CUTS["all"] = CUTS["norm"] + CUTS["attention"]


def actor_runner(engine) -> ModelRunner:
    """The engine's actor runner (the one whose model is the engine's actor)."""
    import gc

    runners = [o for o in gc.get_objects() if isinstance(o, ModelRunner) and o.model is engine.actor]
    if len(runners) != 1:
        raise RuntimeError(f"expected one actor runner, found {len(runners)}")
    return runners[0]


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--cut", choices=list(CUTS), default="all", help="what the 'off' arm runs without")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from oppo_engine.pretrained import load_pretrained

    actor, _ = load_pretrained("smollm2-135m-instruct", dtype=DTYPES[args.dtype])
    g = torch.Generator().manual_seed(0)
    vocab = actor.config.vocab_size
    prompts = [torch.randint(16, vocab, (32,), generator=g).tolist() for _ in range(args.batch_size)]
    engine = make_engine(actor, args.new_tokens, args.batch_size, graph=False, packed=True)
    runner = actor_runner(engine)
    saved = {name: getattr(fused, name) for name in CUTS[args.cut]}
    for name in saved:
        setattr(fused, name, lambda module: False)
    arms = {"on": runner.fused, "off": fused.FusedModules(actor)}
    for name, fn in saved.items():
        setattr(fused, name, fn)

    def arm(name: str):
        runner.fused = arms[name]
        engine.add_prompts(prompts)
        t, c, w = time.thread_time(), time.process_time(), time.perf_counter()
        result = engine.step()
        t, c, w = time.thread_time() - t, time.process_time() - c, time.perf_counter() - w
        out = sorted((r.prompt_ids, r.response_ids, r.logprobs) for r in result.rollouts)
        return out, {"thread_ms": t, "cpu_ms": c, "wall_ms": w}

    first = {name: arm(name)[0] for name in ("on", "off")}  # warm-up, and the exactness check
    assert first["on"] == first["off"], "the cut changed the tokens or log-probs"
    best: dict[str, dict[str, float]] = {"on": {}, "off": {}}
    loads = []
    for r in range(args.rounds):
        for name in ("on", "off") if r % 2 == 0 else ("off", "on"):
            out, times = arm(name)
            assert out == first[name]
            for k, v in times.items():
                best[name][k] = min(best[name].get(k, float("inf")), 1e3 * v / args.new_tokens)
        loads.append(os.getloadavg()[0])
    engine.close()
    print(
        f"cut {args.cut}: smollm2 {args.dtype} B={args.batch_size} new={args.new_tokens} "
        f"threads={args.threads} load={min(loads):.1f}-{max(loads):.1f}, fastest of {args.rounds}, per token:"
    )
    for name in ("off", "on"):
        print("  " + f"{name:>3}: " + ", ".join(f"{k} {v:7.2f}" for k, v in best[name].items()))
    print("  saved: " + ", ".join(f"{k} {best['off'][k] - best['on'][k]:6.2f}" for k in best["on"]))
    return best


if __name__ == "__main__":
    main()
