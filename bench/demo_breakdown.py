"""Where the demo's PPO step spends its time, per mode, measured side by side (modes interleaved step by step,
as the demo runs them): the rollout (actor decode iterations and their mean cost, scoring after the actor,
the chunk controller's arm) against the update (the stale log-prob recompute and the minibatch passes).

    python -m bench.demo_breakdown --steps 12 --batch-size 32

It answers two questions with numbers from one run: why a mode's rollout is slower than another's (more
decode iterations, or dearer ones: streaming beside a prefill), and how much the update caps the
time-to-reward ratio (the step's speed-up is ``1 / (u + (1 - u) / r)`` for an update share ``u`` and a
rollout speed-up ``r``).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from dataclasses import fields, replace
from pathlib import Path

import torch

from oppo_engine.ppo.demo import DemoOptions, make_trainer
from oppo_engine.ppo.task import build_task


def _options(argv: list[str] | None) -> DemoOptions:
    fmt = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=fmt)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--modes", default="sequential,intra,inter,oppo")
    parser.add_argument("--cache", default=".cache/demo_task")
    names = {f.name: f for f in fields(DemoOptions)}
    for name in ("batch_size", "overcommit", "max_deferrals", "max_policy_lag", "seed", "max_new_tokens"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=_int_or_none, default=names[name].default)
    args = parser.parse_args(argv)
    extra = {k: getattr(args, k) for k in vars(args) if k in names and k not in ("steps", "modes", "cache")}
    return replace(
        DemoOptions(),
        steps=args.steps,
        modes=tuple(args.modes.split(",")),
        cache=Path(args.cache),
        **extra,
    )


def _int_or_none(text: str) -> int | None:
    return None if text.lower() == "none" else int(text)


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    opts = _options(argv)
    torch.set_num_threads(opts.threads)
    cache = build_task(opts.cache)
    trainers = {m: make_trainer(m, opts, cache / "actor", cache / "reward") for m in opts.modes}
    rows: dict[str, list[dict]] = defaultdict(list)
    for trainer in trainers.values():  # time the stale log-prob recompute inside the update
        _time_old_logprobs(trainer)
    modes = list(trainers)
    for i in range(opts.steps):
        for mode in modes[i % len(modes) :] + modes[: i % len(modes)]:  # interleaved, the order rotated
            trainer = trainers[mode]
            trainer._old_logprobs_s = 0.0
            t0 = time.perf_counter()
            stats = trainer.step()
            step_s = time.perf_counter() - t0
            m = stats.rollout.metrics
            spans = trainer.engine.timeline.spans()
            actor = [s for s in spans if s.lane == "actor"]
            scorer = [s for s in spans if s.lane != "actor"]
            rows[mode].append(
                dict(
                    step_s=step_s,
                    rollout_s=stats.rollout_s,
                    update_s=stats.update_s,
                    recompute_s=trainer._old_logprobs_s,
                    iterations=len(actor),
                    actor_s=sum(s.duration_s for s in actor),
                    scorer_s=sum(s.duration_s for s in scorer),
                    exposed_s=m.exposed_scoring_s,
                    tokens=m.tokens_generated,
                    response_len=stats.response_len,
                    arm=m.chunk_size,
                )
            )
    for trainer in trainers.values():
        trainer.close()
    return _report(rows, opts)


def _time_old_logprobs(trainer) -> None:
    inner = trainer.old_logprobs

    def timed(batch):
        t0 = time.perf_counter()
        try:
            return inner(batch)
        finally:
            trainer._old_logprobs_s += time.perf_counter() - t0

    trainer.old_logprobs = timed


def _report(rows: dict[str, list[dict]], opts: DemoOptions) -> dict[str, dict[str, float]]:
    skip = 1  # the first step carries one-time costs
    summary = {}
    base = None
    print(
        f"B={opts.batch_size} overcommit={opts.overcommit} max_deferrals={opts.max_deferrals} "
        f"max_policy_lag={opts.max_policy_lag} steps={opts.steps} (first step left out)"
    )
    header = (
        "mode",
        "step",
        "rollout",
        "update",
        "recomp",
        "u-share",
        "iters",
        "ms/iter",
        "scorer",
        "exposed",
        "tok/step",
        "len",
        "r-speedup",
        "s-speedup",
    )
    print(" ".join(f"{h:>9}" for h in header))
    for mode, rs in rows.items():
        rs = rs[skip:] or rs
        mean = {k: statistics.fmean(r[k] for r in rs) for k in rs[0] if k != "arm"}
        mean["ms_per_iter"] = 1e3 * mean["actor_s"] / max(1.0, mean["iterations"])
        base = base or mean
        summary[mode] = mean
        print(
            f"{mode:>9} {mean['step_s']:9.3f} {mean['rollout_s']:9.3f} {mean['update_s']:9.3f} "
            f"{mean['recompute_s']:9.3f} {mean['update_s'] / mean['step_s']:9.0%} {mean['iterations']:9.1f} "
            f"{mean['ms_per_iter']:9.2f} {mean['scorer_s']:9.3f} {mean['exposed_s']:9.3f} "
            f"{mean['tokens']:9.0f} {mean['response_len']:9.1f} "
            f"{base['rollout_s'] / mean['rollout_s']:9.2f} {base['step_s'] / mean['step_s']:9.2f}"
        )
        by_arm = defaultdict(list)
        for r in rs:
            if r["arm"] is not None:
                by_arm[r["arm"]].append(r)
        for arm, ar in sorted(by_arm.items(), key=lambda kv: str(kv[0])):
            ms = 1e3 * sum(r["actor_s"] for r in ar) / max(1, sum(r["iterations"] for r in ar))
            print(
                f"{'':>9}   arm {arm!s:>4}: {len(ar):2d} steps, rollout "
                f"{statistics.fmean(r['rollout_s'] for r in ar):.3f} s, {ms:.2f} ms/iter, "
                f"{statistics.fmean(r['iterations'] for r in ar):.1f} iters"
            )
    return summary


if __name__ == "__main__":
    main()
