"""The demo's side-by-side table and plots, from per-step records of each mode."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from statistics import mean


@dataclass(slots=True)
class StepRecord:
    step: int
    reward: float
    kl: float
    step_s: float  # the whole PPO step: rollout and update
    rollout_s: float
    elapsed_s: float  # this mode's own step time so far (the modes run interleaved)
    rollouts: int
    tokens: int
    exposed_scoring_s: float
    length_bias: float | None
    chunk_size: int | None
    overcommit: int
    stale_tokens: int


@dataclass(slots=True)
class ModeRun:
    mode: str
    records: list[StepRecord] = field(default_factory=list)
    unavailable: str | None = None  # why the mode could not run

    def final_reward(self, last: int = 3) -> float:
        return mean(r.reward for r in self.records[-last:])


def _rows(run: ModeRun, base: ModeRun | None) -> dict[str, str]:
    recs = run.records
    rollout_s = sum(r.rollout_s for r in recs)
    step_s = mean(r.step_s for r in recs)
    bias = [r.length_bias for r in recs if r.length_bias is not None]
    speedup = "-"
    if base is not None and base.records and base is not run:
        rollout_x = sum(r.rollout_s for r in base.records) / rollout_s
        step_x = mean(r.step_s for r in base.records) / step_s
        speedup = f"{rollout_x:.2f}x rollout, {step_x:.2f}x step"
    return {
        "s/step (PPO step)": f"{step_s:.3f}",
        "s/step (rollout)": f"{rollout_s / len(recs):.3f}",
        "rollouts/s": f"{sum(r.rollouts for r in recs) / rollout_s:.1f}",
        "tokens/s": f"{sum(r.tokens for r in recs) / rollout_s:.0f}",
        "exposed scoring s/step": f"{mean(r.exposed_scoring_s for r in recs):.3f}",
        "length bias": f"{mean(bias):.3f}" if bias else "1 (no cut)",
        "stale tokens/step": f"{mean(r.stale_tokens for r in recs):.1f}",
        "reward: first -> final": f"{recs[0].reward:+.3f} -> {run.final_reward():+.3f}",
        "speed-up vs " + (base.mode if base is not None else "-"): speedup,
    }


def format_table(runs: list[ModeRun]) -> str:
    """Metrics as rows, modes as columns; a mode that could not run says so."""
    base = next((r for r in runs if r.records), None)
    columns = {}
    for run in runs:
        columns[run.mode] = _rows(run, base) if run.records else None
    names = next((list(c) for c in columns.values() if c is not None), [])
    width = max(map(len, names), default=10)
    col_w = max(14, *(len(m) for m in columns), *(len(v) for c in columns.values() if c for v in c.values()))
    lines = ["".ljust(width) + " | " + " | ".join(m.ljust(col_w) for m in columns)]
    lines.append("-" * len(lines[0]))
    for name in names:
        cells = [(c[name] if c is not None else "unavailable").ljust(col_w) for c in columns.values()]
        lines.append(name.ljust(width) + " | " + " | ".join(cells))
    for run in runs:
        if run.unavailable:
            lines.append(f"{run.mode}: unavailable ({run.unavailable})")
    return "\n".join(lines)


def plot(out: Path, runs: list[ModeRun]) -> list[Path]:
    """reward.png (reward vs step and vs wall time) and control.png (chunk size and Δ per step)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in runs if r.records]
    paths = []
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for run in runs:
        ax1.plot([r.step for r in run.records], [r.reward for r in run.records], label=run.mode)
        ax2.plot([r.elapsed_s for r in run.records], [r.reward for r in run.records], label=run.mode)
    ax1.set(xlabel="PPO step", ylabel="mean reward", title="reward vs step")
    ax2.set(xlabel="wall time (s)", ylabel="mean reward", title="reward vs wall time")
    for ax in (ax1, ax2):
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    paths.append(out / "reward.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for run in runs:
        steps = [r.step for r in run.records]
        ax1.step(steps, [r.chunk_size or 0 for r in run.records], where="post", label=run.mode)
        ax2.step(steps, [r.overcommit for r in run.records], where="post", label=run.mode)
    ax1.set(xlabel="PPO step", ylabel="chunk size C (0: not streamed)", title="chunk size over time")
    ax2.set(xlabel="PPO step", ylabel="overcommit Δ", title="Δ over time")
    for ax in (ax1, ax2):
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    paths.append(out / "control.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)
    return paths
