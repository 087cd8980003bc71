"""The demo's PPO on 1 process against the same global batch on N data-parallel ranks, side by side.

    python -m bench.bench_ppo_ranks --nproc 2 --batch-size 8 --steps 5 --rounds 2

Each round runs ``oppo-engine demo`` twice, alternating: once on one process with the global batch
(``--batch-size`` rollouts per step, a quarter of them per minibatch), once as ``demo --nproc N`` with
``batch-size / N`` per rank (``torchrun``, gloo, FSDP2 actor and critic). Both sample the same prompts with
the same seeds (``ppo/ranks.py``), so in ``sequential`` mode their per-step rewards must agree (to
rounding), and that is printed beside the times. Times are the demo's own mean PPO step and rollout
seconds (``records.json``), so process start-up and the task build are not in them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def _demo(args, nproc: int, out: Path) -> dict:
    batch = args.batch_size if nproc == 1 else args.batch_size // nproc
    cmd = [sys.executable, "-m", "oppo_engine.cli", "demo", "--task", "polite", "--modes", args.mode,
           "--steps", str(args.steps), "--batch-size", str(batch), "--cache", args.cache, "--out", str(out),
           "--device", "cpu"]  # fmt: skip
    if nproc > 1:
        cmd += ["--nproc", str(nproc)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, timeout=args.timeout)
    return json.loads((out / "records.json").read_text())[args.mode]


def main(argv: list[str] | None = None) -> dict:
    fmt = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=fmt)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8, help="global batch, a multiple of 4 * nproc")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--mode", default="sequential")
    parser.add_argument("--cache", default=".cache/demo_task")
    parser.add_argument("--timeout", type=float, default=900)
    args = parser.parse_args(argv)
    if args.batch_size % (4 * args.nproc):
        parser.error(f"--batch-size must be a multiple of 4 * nproc = {4 * args.nproc}")
    runs: dict[int, list[dict]] = {1: [], args.nproc: []}
    for _ in range(args.rounds):
        for nproc in runs:
            with tempfile.TemporaryDirectory() as out:
                runs[nproc].append(_demo(args, nproc, Path(out)))
    one, many = runs[1], runs[args.nproc]
    step = {n: statistics.mean(r["s_per_step"] for r in rs) for n, rs in runs.items()}
    rollout = {n: statistics.mean(r["rollout_s_per_step"] for r in rs) for n, rs in runs.items()}
    rewards = [[rec["reward"] for rec in r["records"]] for r in (one[0], many[0])]
    diff = max(abs(a - b) for a, b in zip(*rewards, strict=True))
    n = args.nproc
    print(f"{args.mode}, global batch {args.batch_size}, {args.steps} steps x {args.rounds} rounds")
    print(f"  1 process : {step[1]:.3f} s/step (rollout {rollout[1]:.3f})")
    print(f"  {n} ranks   : {step[n]:.3f} s/step (rollout {rollout[n]:.3f})")
    print(f"  speed-up  : {step[1] / step[n]:.2f}x per PPO step, {rollout[1] / rollout[n]:.2f}x per rollout")
    print(f"  per-step rewards, 1 process vs {n} ranks: max |difference| {diff:.2e}")
    return {"s_per_step": step, "rollout_s_per_step": rollout, "reward_max_diff": diff}


if __name__ == "__main__":
    main()
