"""What the overcommit defaults give a PPO loop: staleness, policy lag, length bias -- and what they cost.

    python -m bench.bench_staleness --batch-size 16 --steps 8

Three engines in `oppo` mode on one seeded long-tail workload, stepped alternately with an update after
every step, as a PPO loop does: the defaults (Δ from B/8 up to B/4, `max_policy_lag=2`), the default Δ
without the lag bound, and the former fixed ones (`DeltaControl(init=16, max=64)`, no lag bound). Per
configuration: the share of returned tokens sampled by an older policy, the largest policy lag of a
returned token, the largest deferral, the mean length bias of the first three batches, and generated
tokens per second; then the throughput ratios.
"""

from __future__ import annotations

import argparse
import time

import torch

from bench.workloads import build_models, make_workload
from oppo_engine import EngineConfig, RolloutEngine, SamplingParams
from oppo_engine.control import DeltaControl

CONFIGS = {
    "defaults": {},
    "no_lag": {"max_policy_lag": None},  # the default Δ alone: what the lag bound itself costs
    "former": {"delta": DeltaControl(init=16, max=64), "max_policy_lag": None},
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options; see --help."""
    p = argparse.ArgumentParser(
        prog="python -m bench.bench_staleness",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--batch-size", type=int, default=16, help="rollouts per step (B)")
    p.add_argument("--steps", type=int, default=8, help="steps per configuration")
    p.add_argument("--response-len-cap", type=int, default=96, help="longest response of the workload")
    p.add_argument("--seed", type=int, default=0, help="seed of the models, the workload and the sampling")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    """Run both configurations side by side; print one line each and the throughput ratio."""
    args = parse_args(argv)
    actor, reward = build_models("tiny", torch.float32, torch.device("cpu"), args.seed)
    num_prompts = args.batch_size * (args.steps + 12)
    work = make_workload(
        "longtail", num_prompts, 16, args.response_len_cap, actor.config.vocab_size, args.seed
    )
    engines = {}
    for name, knobs in CONFIGS.items():
        engine = RolloutEngine(
            actor=actor,
            reward=reward,
            config=EngineConfig(
                batch_size=args.batch_size, max_model_len=16 + args.response_len_cap, **knobs
            ),
            sampling=SamplingParams(temperature=1.0, seed=args.seed),
            eos_token_id=(),
        )
        sampling = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in work.max_new_tokens]
        engine.add_prompts(work.prompts, sampling=sampling)
        engines[name] = engine
    stats = {name: dict(tokens=0, stale=0, max_lag=0, max_deferred=0, seconds=0.0, generated=0, bias=[])
             for name in engines}  # fmt: skip
    for _ in range(args.steps):
        for name, engine in engines.items():  # alternating: drift of the machine hits both alike
            t0 = time.perf_counter()
            result = engine.step()
            s = stats[name]
            s["seconds"] += time.perf_counter() - t0
            s["generated"] += result.metrics.tokens_generated
            s["tokens"] += sum(len(r.response_ids) for r in result.rollouts)
            s["stale"] += result.metrics.stale_tokens
            lags = [engine.policy_version - v for r in result.rollouts for v in r.policy_versions]
            s["max_lag"] = max(s["max_lag"], *lags, 0)
            s["max_deferred"] = max(s["max_deferred"], *(r.deferred_steps for r in result.rollouts), 0)
            if len(s["bias"]) < 3 and result.metrics.length_bias is not None:
                s["bias"].append(result.metrics.length_bias)
            engine.update_policy()
    summary = {}
    for name, s in stats.items():
        summary[name] = dict(
            stale_share=s["stale"] / max(1, s["tokens"]),
            max_lag=s["max_lag"],
            max_deferred=s["max_deferred"],
            length_bias=sum(s["bias"]) / max(1, len(s["bias"])),
            tokens_per_s=s["generated"] / s["seconds"],
        )
        v = summary[name]
        print(
            f"{name:>9}: stale tokens {v['stale_share']:.0%}  max lag {v['max_lag']}  max deferred "
            f"{v['max_deferred']}  length bias (first 3 batches) {v['length_bias']:.2f}  "
            f"{v['tokens_per_s']:.0f} tok/s"
        )
        engines[name].close()
    for other in ("former", "no_lag"):
        ratio = summary["defaults"]["tokens_per_s"] / summary[other]["tokens_per_s"]
        print(f"throughput_defaults_vs_{other}={ratio:.2f}")
    return summary


if __name__ == "__main__":
    main()
