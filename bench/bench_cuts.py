"""The exact non-GEMM cuts of a SmolLM2 decode step, each measured alone: the same engine stepped with the
cut on and off, the two alternating.

The "on" arm runs every exact fusion of ``oppo_engine/model/fused.py``; the "off" arm the same minus
``--cut`` (``norm``: the fused RMSNorms; ``attention``: the fused rotary embedding and cache write of Llama's
attention; ``all``: both), by switching the actor runner's ``ModelRunner.fused``, so both arms run the
same engine, weights, cache and prompts. Each round runs one engine step per arm (32-token prompts,
``--new-tokens`` greedy with ``ignore_eos``, prefill included) and records per generated token: the
calling thread's CPU time (``time.thread_time``; the figure a loaded machine moves least), the process's
CPU time and the wall time; the fastest of ``--rounds`` is reported, with ``os.getloadavg()`` beside it.
Both arms' tokens and log-probs are compared: they must be equal to the bit. Both arms run each decoder
layer's calls one by one (``fused.DECODE_LAYERS`` off: a layer as one op would run the cut's ops in C++, and
the "off" arm's layers would then differ by that too), so the figure is the cut's alone.

``--breakdown`` instead splits one step's thread CPU time by subtraction: the step as it runs, the same
step with every linear layer's product (oneDNN's and ``small_linear``'s) replaced by a ready zero tensor of
its shape ("no GEMM"), and with
the paged attention replaced too ("no GEMM, no attention"), the three alternating, fastest of
``--rounds``; then the calling thread's CPU time per Python function (``cProfile`` timed by
``time.thread_time``) of one step without GEMMs and attention, the top entries printed.

    python -m bench.bench_cuts --dtype bf16 --batch-size 16 --cut attention --rounds 5
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from bench.bench_decode import DTYPES, actor_runner, make_engine
from oppo_engine.model import fused

CUTS = {"norm": ("is_llama_rms_norm",), "attention": ("is_llama_attention",)}
CUTS["all"] = CUTS["norm"] + CUTS["attention"]


def breakdown(engine, prompts, new_tokens: int, rounds: int, top: int = 25) -> dict[str, float]:
    """Thread CPU per token of a step: as it runs, without GEMMs, without GEMMs and attention (see above)."""
    import cProfile
    import pstats

    from oppo_engine import ops

    real = {
        "packed_linear": ops.packed_linear,
        "small_linear": ops.small_linear,
        "paged_attention": ops.paged_attention,
    }
    zeros: dict[tuple, torch.Tensor] = {}

    def no_linear(x, packed, bias):
        key = (tuple(x.shape), id(packed))
        if key not in zeros:
            zeros[key] = torch.zeros_like(real["packed_linear"](x, packed, bias))
        return zeros[key]

    def no_small(x, blocked, kblock):
        key = (tuple(x.shape), id(blocked))
        if key not in zeros:
            zeros[key] = torch.zeros_like(real["small_linear"](x, blocked, kblock))
        return zeros[key]

    def no_attention(q, *args, **kwargs):
        return torch.zeros_like(q)

    no_gemm = {"packed_linear": no_linear, "small_linear": no_small}
    arms = {
        "step": dict(real),
        "no GEMM": {**no_gemm, "paged_attention": real["paged_attention"]},
        "no GEMM, no attention": {**no_gemm, "paged_attention": no_attention},
    }

    def step(patch) -> float:
        for name, fn in patch.items():
            setattr(ops, name, fn)
        engine.add_prompts(prompts)
        t = time.thread_time()
        engine.step()
        return 1e3 * (time.thread_time() - t) / new_tokens

    best = {name: float("inf") for name in arms}
    loads = []
    try:
        for _ in range(rounds):
            for name, patch in arms.items():
                best[name] = min(best[name], step(patch))
            loads.append(os.getloadavg()[0])
        for name, fn in arms["no GEMM, no attention"].items():
            setattr(ops, name, fn)
        engine.add_prompts(prompts)
        prof = cProfile.Profile(time.thread_time)
        prof.enable()
        engine.step()
        prof.disable()
    finally:
        for name, fn in real.items():
            setattr(ops, name, fn)
    print(f"thread CPU per token, fastest of {rounds}, load {min(loads):.1f}-{max(loads):.1f}:")
    for name, ms in best.items():
        print(f"  {name:<24} {ms:7.2f} ms")
    rest = best["no GEMM, no attention"]
    gemm, attention = best["step"] - best["no GEMM"], best["no GEMM"] - rest
    print(f"  => GEMM {gemm:.2f} ms, attention {attention:.2f} ms, the rest {rest:.2f} ms")
    print("one step without GEMM and attention, thread CPU by function (cProfile adds its own cost):")
    pstats.Stats(prof).sort_stats("tottime").print_stats(top)
    return best


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    # Every op through ops' names, where the arms' patches and cuts act (see above).
    layers, fused.DECODE_LAYERS = fused.DECODE_LAYERS, False
    try:
        return _main(argv)
    finally:
        fused.DECODE_LAYERS = layers


def _main(argv: list[str] | None) -> dict[str, dict[str, float]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--cut", choices=list(CUTS), default="all", help="what the 'off' arm runs without")
    p.add_argument("--breakdown", action="store_true", help="split a step's thread CPU time (see above)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from oppo_engine.pretrained import load_pretrained

    actor, _ = load_pretrained("smollm2-135m-instruct", dtype=DTYPES[args.dtype])
    g = torch.Generator().manual_seed(0)
    vocab = actor.config.vocab_size
    prompts = [torch.randint(16, vocab, (32,), generator=g).tolist() for _ in range(args.batch_size)]
    engine = make_engine(actor, args.new_tokens, args.batch_size, graph=False, packed=True)
    if args.breakdown:
        engine.add_prompts(prompts)
        engine.step()  # warm-up: the packs are made here
        best = breakdown(engine, prompts, args.new_tokens, args.rounds)
        engine.close()
        return {"breakdown": best}
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
