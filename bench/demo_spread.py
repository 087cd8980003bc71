"""The seed-to-seed spread of the demo's final reward in ``sequential`` mode: the M of the README's goal
"each mode's final reward within M of sequential's".

    python -m bench.demo_spread --seeds 0,1,2 --steps 30

Runs the demo's PPO (the embedded task, the demo's settings) in ``sequential`` mode once per seed and
prints each final reward (the mean of the last 5 steps), their range (M = max - min) and standard
deviation. Rewards do not depend on the machine's load, only on the seeds.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from dataclasses import replace
from pathlib import Path

import torch

from oppo_engine.ppo.demo import DemoOptions, run_modes
from oppo_engine.ppo.task import build_task


def main(argv: list[str] | None = None) -> dict[int, float]:
    fmt = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=fmt)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", type=int, default=DemoOptions().steps)
    parser.add_argument("--cache", default=".cache/demo_task")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    cache = build_task(Path(args.cache))
    finals = {}
    for seed in (int(s) for s in args.seeds.split(",")):
        with tempfile.TemporaryDirectory() as out:  # its lane trace goes nowhere
            opts = replace(DemoOptions(), steps=args.steps, modes=("sequential",), seed=seed, out=Path(out))
            (run,) = run_modes(opts, cache / "actor", cache / "reward", log=lambda _: None)
        finals[seed] = run.final_reward()
        print(f"seed {seed}: first {run.records[0].reward:+.3f}, final (last 5 steps) {finals[seed]:+.3f}")
    values = list(finals.values())
    spread = max(values) - min(values)
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    print(f"sequential final reward over {len(values)} seeds: range M = {spread:.3f}, sd = {sd:.3f}")
    return finals


if __name__ == "__main__":
    main()
