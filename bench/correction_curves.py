"""TIS and MIS against no correction on the math demo's own run (issue 37): SmolLM2-135M-Instruct rolled out
by the engine in bf16, the update under bf16 autocast over fp32 weights, one-operation problems, B=32 in
minibatches of 8, 18 ``sequential`` steps, several seeds.

    python -m bench.correction_curves --seeds 0 1 2 --arms none tis mis --steps 18

Each (seed, arm) is one ``python -m bench.math_curve`` run in a fresh process, the arms alternating within a
seed so that the machine's load falls on each alike. Greedy held-out accuracy over the 200 fixed problems is
taken before (once: it does not depend on the arm or the seed), every ``--eval-every`` steps and at the end.
Each run's steps go to ``bench/results/correction_<arm>_s<seed>.jsonl``; the summary table (held-out accuracy
per evaluation, s/step and the update's seconds, median over the steps) is printed and written beside them,
with a plot of the held-out curves. ``--summarize`` rebuilds the table from the files alone.

There is no pass bar: at the measured |Δ| of about 0.05 nats (docs/agreement.md), a cap of 2 rarely binds, and
the curves may differ only by noise. This is a slow benchmark (about 7 minutes a run on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path("bench/results")


def _path(arm: str, seed: int, tag: str) -> Path:
    return RESULTS / f"correction{tag}_{arm}_s{seed}.jsonl"


def _records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _initial(tag: str, arms: list[str], seeds: list[int]) -> float | None:
    for seed in seeds:
        for arm in arms:
            for r in _records(_path(arm, seed, tag)):
                if r.get("event") == "heldout_initial":
                    return r["accuracy"]
            for r in _records(_path(arm, seed, tag)):
                if r.get("event") == "end":
                    return r["initial"]
    return None


def summarize(arms: list[str], seeds: list[int], tag: str = "") -> dict:
    """The table of every finished run, and the mean over seeds per arm."""
    rows = []
    for arm in arms:
        for seed in seeds:
            recs = _records(_path(arm, seed, tag))
            end = next((r for r in recs if r.get("event") == "end"), None)
            if end is None:
                continue
            steps = [r for r in recs if r.get("event") == "step"]
            evals = {
                r["steps"]: r["accuracy"] for r in recs if str(r.get("event", "")).startswith("heldout_step")
            }
            evals[end["steps"]] = end["final"]
            rows.append(
                dict(
                    arm=arm,
                    seed=seed,
                    initial=end["initial"],
                    curve=dict(sorted(evals.items())),
                    final=end["final"],
                    gain_points=end["gain_points"],
                    step_s=statistics.median(r["step_s"] for r in steps),
                    update_s=statistics.median(r["update_s"] for r in steps),
                    rollout_s=statistics.median(r["rollout_s"] for r in steps),
                    train_accuracy_last6=round(statistics.mean(r["accuracy"] for r in steps[-6:]), 3),
                    load=[min(min(r["load"]) for r in steps), max(max(r["load"]) for r in steps)],
                )
            )
    means = {}
    for arm in arms:
        mine = [r for r in rows if r["arm"] == arm]
        if mine:
            means[arm] = dict(
                runs=len(mine),
                gain_points=round(statistics.mean(r["gain_points"] for r in mine), 1),
                gain_sd=round(statistics.stdev(r["gain_points"] for r in mine), 1) if len(mine) > 1 else None,
                step_s=round(statistics.median(r["step_s"] for r in mine), 2),
                update_s=round(statistics.median(r["update_s"] for r in mine), 2),
            )
    return dict(rows=rows, means=means)


def _print(summary: dict) -> None:
    print(
        "| arm | seed | held-out: initial -> per evaluation | gain | s/step | update s | rollout s | load |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in summary["rows"]:
        curve = " -> ".join(f"{100 * a:.1f} ({s})" for s, a in r["curve"].items())
        print(
            f"| {r['arm']} | {r['seed']} | {100 * r['initial']:.1f} -> {curve} | {r['gain_points']:+.1f} | "
            f"{r['step_s']:.1f} | {r['update_s']:.1f} | {r['rollout_s']:.1f} | "
            f"{r['load'][0]}-{r['load'][1]} |"
        )
    for arm, m in summary["means"].items():
        print(f"{arm}: {m['runs']} runs, gain {m['gain_points']:+.1f} (sd {m['gain_sd']}), "
              f"s/step {m['step_s']}, update {m['update_s']} s")  # fmt: skip


def _plot(summary: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"none": "tab:gray", "tis": "tab:blue", "mis": "tab:orange"}
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in summary["rows"]:
        xs = [0, *r["curve"].keys()]
        ys = [100 * r["initial"], *(100 * a for a in r["curve"].values())]
        ax.plot(xs, ys, marker="o", color=colors.get(r["arm"]), alpha=0.8, label=f"{r['arm']} s{r['seed']}")
    ax.set_xlabel("PPO step")
    ax.set_ylabel("greedy held-out accuracy (%)")
    ax.set_title("SmolLM2-135M, bf16 rollout: rollout correction")
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main(argv: list[str] | None = None) -> dict:
    fmt = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=fmt)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--arms", nargs="+", choices=("none", "tis", "mis"), default=["none", "tis", "mis"])
    parser.add_argument("--steps", type=int, default=18)
    parser.add_argument("--eval-every", type=int, default=6)
    parser.add_argument("--heldout", type=int, default=200)
    parser.add_argument("--tag", default="", help="a suffix for the result files")
    parser.add_argument("--summarize", action="store_true", help="only rebuild the table from the files")
    args = parser.parse_args(argv)
    RESULTS.mkdir(parents=True, exist_ok=True)
    if not args.summarize:
        for seed in args.seeds:
            for arm in args.arms:
                out = _path(arm, seed, args.tag)
                if any(r.get("event") == "end" for r in _records(out)):
                    print(f"[{arm} s{seed}] done already: {out}", flush=True)
                    continue
                out.unlink(missing_ok=True)  # a killed run starts again
                initial = _initial(args.tag, args.arms, args.seeds)
                cmd = [sys.executable, "-m", "bench.math_curve", "--max-steps", str(args.steps),
                       "--minutes", "600", "--trainer", "bf16", "--batch-size", "32", "--max-ops", "1",
                       "--heldout", str(args.heldout), "--eval-every", str(args.eval_every),
                       "--rollout-correction", arm, "--seed", str(seed), "--out", str(out)]  # fmt: skip
                if initial is not None:
                    cmd += ["--initial", str(initial)]
                t0 = time.perf_counter()
                print(f"[{arm} s{seed}] {' '.join(cmd[1:])} (load {os.getloadavg()[0]:.2f})", flush=True)
                subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
                print(f"[{arm} s{seed}] {time.perf_counter() - t0:.0f} s", flush=True)
    summary = summarize(args.arms, args.seeds, args.tag)
    _print(summary)
    (RESULTS / f"correction{args.tag}_summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    if summary["rows"]:
        _plot(summary, RESULTS / f"correction{args.tag}_curves.png")
    return summary


if __name__ == "__main__":
    main()
