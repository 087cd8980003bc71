"""Where a real model's first PPO step goes (issue 35, item 6): the math task's trainer on SmolLM2, built
in a fresh process, then ``--steps`` steps, each split into the engine's step (generation, exposed scoring)
and the update's parts: the no-grad agreement forward, the forwards with grad, the backwards, and the
optimizer steps (AdamW allocates its state at its first step). Beside each part: the process's CPU
seconds over its wall seconds (``cpu/wall``; 2.0 is both threads busy the whole time, below 1 the
process waited for a core) and the machine's load.

    python -m bench.first_step --threads 2 --batch-size 4 --max-new-tokens 32 --steps 2
    OMP_WAIT_POLICY=PASSIVE python -m bench.first_step ...   # OpenMP threads sleep, not spin, at barriers

``OMP_WAIT_POLICY`` is read by the OpenMP runtime when torch loads: it must be set in the environment of the
process. Each run appends one JSON line to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import torch

from oppo_engine.ppo import demo


class Clock:
    """Wall and CPU seconds summed per named part."""

    def __init__(self) -> None:
        self.wall: dict[str, float] = defaultdict(float)
        self.cpu: dict[str, float] = defaultdict(float)

    def wrap(self, name, fn):
        def timed(*args, **kwargs):
            w, c = time.perf_counter(), time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.wall[name] += time.perf_counter() - w
                self.cpu[name] += time.process_time() - c

        return timed

    def take(self) -> dict:
        out = {
            k: [round(self.wall[k], 2), round(self.cpu[k] / max(self.wall[k], 1e-9), 2)] for k in self.wall
        }
        self.wall.clear()
        self.cpu.clear()
        return out


def main(argv: list[str] | None = None) -> dict:
    fmt = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=fmt)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--mode", default="sequential")
    parser.add_argument("--out", default="bench/results/first_step.jsonl")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    clock = Clock()
    record = dict(threads=args.threads, batch_size=args.batch_size, max_new_tokens=args.max_new_tokens,
                  mode=args.mode, omp_wait_policy=os.environ.get("OMP_WAIT_POLICY"),
                  load_before=[round(x, 2) for x in os.getloadavg()])  # fmt: skip
    opts = replace(demo.DemoOptions(), task="math", modes=(args.mode,), batch_size=args.batch_size,
                   max_new_tokens=args.max_new_tokens, threads=args.threads,
                   out=Path(tempfile.mkdtemp()))  # fmt: skip
    t = time.perf_counter()
    demo._pretrained(demo.MATH_MODEL, opts.seed)
    record["load_models_s"] = round(time.perf_counter() - t, 2)
    t = time.perf_counter()
    trainer = demo.make_trainer(args.mode, opts, demo.MATH_MODEL, demo.MATH_MODEL)
    record["build_trainer_s"] = round(time.perf_counter() - t, 2)
    trainer.engine.step = clock.wrap("engine_step", trainer.engine.step)
    forward = trainer._forward

    def split_forward(*a, **k):
        name = "forward_grad" if torch.is_grad_enabled() else "forward_nograd"
        return clock.wrap(name, forward)(*a, **k)

    trainer._forward = split_forward
    backward = torch.Tensor.backward
    torch.Tensor.backward = clock.wrap("backward", backward)
    trainer.actor_optim.step = clock.wrap("optimizer", trainer.actor_optim.step)
    trainer.critic_optim.step = clock.wrap("optimizer", trainer.critic_optim.step)
    steps = []
    try:
        for _ in range(args.steps):
            w, c = time.perf_counter(), time.process_time()
            stats = trainer.step()
            wall = time.perf_counter() - w
            m = stats.rollout.metrics
            cpu = (time.process_time() - c) / wall
            steps.append(dict(step=stats.step, wall_s=round(wall, 2), cpu_per_wall=round(cpu, 2),
                              rollout_s=round(stats.rollout_s, 2), update_s=round(stats.update_s, 2),
                              generation_s=round(m.generation_s, 2),
                              exposed_scoring_s=round(m.exposed_scoring_s, 2),
                              tokens=m.tokens_generated, parts=clock.take(),
                              load=[round(x, 2) for x in os.getloadavg()]))  # fmt: skip
            print(json.dumps(steps[-1]), flush=True)
    finally:
        torch.Tensor.backward = backward
        trainer.close()
    record["steps"] = steps
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a") as f:
        f.write(json.dumps(record) + "\n")
    print(json.dumps({k: v for k, v in record.items() if k != "steps"}))
    return record


if __name__ == "__main__":
    main()
