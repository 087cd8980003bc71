"""The math demo's own update, arm against arm, on one batch of real rollouts (issue 35: the update is two
thirds of the demo's PPO step).

    python -m bench.bench_demo_update --rounds 2 --arms sdpa eager
    python -m bench.bench_demo_update --steps 3 --rounds 1 --arms eager   # whole steps first, then the A/B

One ``sequential`` trainer of the demo's defaults (SmolLM2-135M-Instruct, its bf16 rollout, B=32, the
update under bf16 autocast over fp32 weights), one engine step of 32 rollouts, then ``PPOTrainer._update``
on that batch once per arm and round, the arms alternated, after one untimed warm-up update per arm. The
actor's and critic's weights and AdamW states are restored before every update, so each arm does the same
work from the same state. Arms:

- ``sdpa``: the trainer's forwards with transformers' ``sdpa`` attention (the models' default);
- ``eager``: the same with transformers' ``eager`` attention (``set_attn_implementation("eager")``);
- ``padded``: ``sdpa`` with ``PPOConfig.share_prefix=False`` (each row's prompt computed in full).

Printed per arm and round: wall and process CPU seconds of the update, its losses (the arms must agree to
bf16 rounding), and the 1-minute load. Also timed once, outside ``_update`` but inside the demo's
``update_s``: ``collate``, ``engine.update_policy()`` (the bf16 replicas' refresh) and the rest.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import time
from pathlib import Path

import torch

from oppo_engine.ppo.batch import canonical_order, collate
from oppo_engine.ppo.demo import MATH_DEFAULTS, MATH_MODEL, DemoOptions, make_trainer, release_heap


def _state(trainer):
    return (
        copy.deepcopy(trainer.actor.state_dict()),
        copy.deepcopy(trainer.critic.state_dict()),
        copy.deepcopy(trainer.actor_optim.state_dict()),
        copy.deepcopy(trainer.critic_optim.state_dict()),
    )


def _restore(trainer, state) -> None:
    actor, critic, actor_optim, critic_optim = state
    trainer.actor.load_state_dict(actor)
    trainer.critic.load_state_dict(critic)
    trainer.actor_optim.load_state_dict(actor_optim)
    trainer.critic_optim.load_state_dict(critic_optim)


def _set_attention(trainer, impl: str) -> None:
    for model in (trainer.actor, trainer.critic):
        model.set_attn_implementation(impl)


def _arm(trainer, arm: str, base_config):
    _set_attention(trainer, "eager" if arm == "eager" else "sdpa")
    share = False if arm == "padded" else base_config.share_prefix
    trainer.config = dataclasses.replace(base_config, share_prefix=share)


def _timed_update(trainer, batch) -> tuple[float, float, dict]:
    c0, t0 = time.process_time(), time.perf_counter()
    stats = trainer._update(batch)
    return time.perf_counter() - t0, time.process_time() - c0, stats


def main(argv: list[str] | None = None) -> dict[str, list[float]]:
    fmt = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=fmt)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--arms", nargs="+", default=["sdpa", "eager"], choices=["sdpa", "eager", "padded"])
    parser.add_argument("--threads", type=int, default=MATH_DEFAULTS["threads"])
    parser.add_argument("--no-warmup", action="store_true")
    parser.add_argument("--steps", type=int, default=0, help="whole PPO steps before the A/B, each timed")
    parser.add_argument("--trim", action="store_true", help="malloc_trim(0) after each of those steps")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    defaults = {k: v for k, v in MATH_DEFAULTS.items() if k != "modes"}
    opts = dataclasses.replace(DemoOptions(), task="math", **defaults)
    trainer = make_trainer("sequential", opts, Path(MATH_MODEL), Path("."))
    for i in range(args.steps):  # whole PPO steps first, as the demo runs them (each its own batch)
        c0 = time.process_time()
        st = trainer.step()
        if args.trim:
            release_heap()
        print(
            f"PPO step {i + 1}: rollout {st.rollout_s:.1f} s, update {st.update_s:.1f} s (of it the "
            f"agreement forward {st.agreement_s:.1f} s), cpu {time.process_time() - c0:.1f} s, "
            f"load {os.getloadavg()[0]:.2f}",
            flush=True,
        )
    trainer._feed_engine()
    t0 = time.perf_counter()
    result = trainer.engine.step()
    rollout_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    batch = collate(canonical_order(result.rollouts), trainer.tokenizer.pad_token_id, trainer.device)
    collate_s = time.perf_counter() - t0
    lengths = batch.attention_mask.sum(1)
    print(
        f"rollout {rollout_s:.1f} s: {len(result.rollouts)} rollouts, {int(batch.mask.sum())} sampled "
        f"tokens, "
        f"rows of {int(lengths.min())}-{int(lengths.max())} tokens; collate {collate_s:.3f} s"
    )
    base_config = trainer.config
    state = _state(trainer)
    if not args.no_warmup:
        for arm in args.arms:
            _arm(trainer, arm, base_config)
            _restore(trainer, state)
            wall, cpu, _ = _timed_update(trainer, batch)
            print(f"warm-up {arm}: {wall:.1f} s (cpu {cpu:.1f} s)", flush=True)
    walls: dict[str, list[float]] = {arm: [] for arm in args.arms}
    for r in range(args.rounds):
        order = args.arms if r % 2 == 0 else list(reversed(args.arms))
        for arm in order:
            _arm(trainer, arm, base_config)
            _restore(trainer, state)
            load = os.getloadavg()[0]
            wall, cpu, stats = _timed_update(trainer, batch)
            walls[arm].append(wall)
            print(
                f"round {r} {arm:>6}: {wall:6.1f} s wall, {cpu:6.1f} s cpu, load {load:.2f}; policy loss "
                f"{stats['policy_loss']:+.5f} value loss {stats['value_loss']:.5f} "
                f"clipfrac {stats['clipfrac']:.4f}",
                flush=True,
            )
    t0 = time.perf_counter()
    trainer.engine.update_policy()
    refresh_s = time.perf_counter() - t0
    print(f"engine.update_policy(): {refresh_s:.2f} s (the bf16 rollout replicas' refresh)")
    base = min(walls[args.arms[0]])
    for arm, w in walls.items():
        print(f"{arm:>6}: min {min(w):.1f} s, {base / min(w):.2f}x of {args.arms[0]}")
    return walls


if __name__ == "__main__":
    main()
