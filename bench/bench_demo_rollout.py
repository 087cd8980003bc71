"""The math demo's rollout with and without the shared prompt prefix (``EngineConfig.share_prompt_prefix``),
side by side on the same prompts.

    python -m bench.bench_demo_rollout --rounds 3

Two ``sequential`` trainers of the demo's defaults (SmolLM2-135M-Instruct, its bf16 rollout, B=32), one
with ``share_prompt_prefix=True`` (the default) and one with ``False``; each round runs one engine step
(``engine.step()``: the actor, the reference and the critic, the rule reward) on each, alternating which
goes first, with no update between steps, so round ``k`` of both arms rolls out the same 32 prompts under
the same weights and seeds. Printed per arm and round: wall and process CPU seconds, the step's exposed
scoring, the tokens each model did not compute (``StepMetrics.shared_tokens``), and how many of the 32
responses are token for token the other arm's (bf16 rounding may move a sampled token where two logits
are within it)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from pathlib import Path

import torch

from oppo_engine.ppo import demo
from oppo_engine.ppo.demo import MATH_DEFAULTS, MATH_MODEL, DemoOptions


def _trainer(opts: DemoOptions, share: bool):
    original = demo.engine_overrides

    def overrides(mode, o):
        return {**original(mode, o), "share_prompt_prefix": share}

    demo.engine_overrides = overrides  # this bench's arms only; restored at once
    try:
        return demo.make_trainer("sequential", opts, Path(MATH_MODEL), Path("."))
    finally:
        demo.engine_overrides = original


def main(argv: list[str] | None = None) -> dict[str, list[float]]:
    fmt = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=fmt)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=MATH_DEFAULTS["threads"])
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    defaults = {k: v for k, v in MATH_DEFAULTS.items() if k != "modes"}
    opts = dataclasses.replace(DemoOptions(), task="math", **defaults)
    arms = {"shared": _trainer(opts, True), "unshared": _trainer(opts, False)}
    walls: dict[str, list[float]] = {arm: [] for arm in arms}
    for r in range(args.rounds):
        responses = {}
        order = list(arms) if r % 2 == 0 else list(reversed(arms))
        for arm in order:
            trainer = arms[arm]
            trainer._feed_engine()
            load = os.getloadavg()[0]
            c0, t0 = time.process_time(), time.perf_counter()
            result = trainer.engine.step()
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            trainer._queued -= len(result.rollouts) + len(result.failed)
            walls[arm].append(wall)
            m = result.metrics
            responses[arm] = {tuple(x.prompt_ids): tuple(x.response_ids) for x in result.rollouts}
            print(
                f"round {r} {arm:>8}: {wall:5.1f} s wall, {cpu:5.1f} s cpu, load {load:.2f}; exposed scoring "
                f"{m.exposed_scoring_s:.1f} s; not computed {m.shared_tokens}",
                flush=True,
            )
        same = sum(responses["shared"].get(p) == resp for p, resp in responses["unshared"].items())
        print(f"round {r}: {same} of {len(responses['unshared'])} responses token for token equal")
    for trainer in arms.values():
        trainer.close()
    base = min(walls["unshared"])
    for arm, w in walls.items():
        print(f"{arm:>8}: min {min(w):.1f} s, {base / min(w):.2f}x of unshared")
    return walls


if __name__ == "__main__":
    main()
