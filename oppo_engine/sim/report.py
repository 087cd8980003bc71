"""A plan's two pictures: one step of each mode (each lane's work against time, as in the Perfetto trace)
and s/step against chunk size. Both say they are predictions. matplotlib is imported here only."""

from __future__ import annotations

from pathlib import Path

from oppo_engine.sim.planner import Plan

_COLORS = {"actor": "#1f77b4", "reward": "#d62728", "reference": "#2ca02c", "critic": "#9467bd"}


def plot_steps(plan: Plan, path: str | Path) -> Path:
    """One step of each mode: rank 0's lanes against time."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    modes = [m for m in plan.modes.values() if m.timeline]  # the baseline arms have no engine timeline
    fig, axes = plt.subplots(
        max(1, len(modes)), 1, figsize=(11, 1.2 + 1.1 * max(1, len(modes))), squeeze=False
    )
    if not modes:
        axes[0, 0].set_title("no engine mode in this plan (baseline arms only)", fontsize=9, loc="left")
    for ax, m in zip(axes[: len(modes), 0], modes, strict=True):
        lanes = list(dict.fromkeys(lane for lane, *_ in m.timeline))
        t0 = min(start for _, _, start, _ in m.timeline)
        for row, lane in enumerate(lanes):
            bars = [(start - t0, end - start) for ln, _, start, end in m.timeline if ln == lane]
            ax.broken_barh(bars, (row - 0.4, 0.8), color=_COLORS.get(lane, "#7f7f7f"))
        ax.set_yticks(range(len(lanes)), lanes)
        chunk = "" if m.chunk_chosen is None else f", chunk {m.chunk_chosen}"
        ax.set_title(f"{m.mode}{chunk}: {m.rollout_s:.2f} s rollout (predicted)", fontsize=9, loc="left")
        ax.set_xlabel("seconds (predicted)")
    fig.suptitle("one step per mode, rank 0, PREDICTED by the twin", fontsize=10)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_chunks(plan: Plan, path: str | Path) -> Path:
    """s/step against chunk size for each streamed mode, "off" (its unstreamed mode) as a dashed line."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(7, 4))
    off = {"intra": "sequential", "oppo": "inter"}
    for m in plan.modes.values():
        if not m.chunk_sweep:
            continue
        sizes = sorted(m.chunk_sweep)
        line = ax.plot(sizes, [m.chunk_sweep[c] for c in sizes], marker="o", label=m.mode)[0]
        if isinstance(m.chunk_chosen, int) and m.chunk_chosen in m.chunk_sweep:
            chosen = m.chunk_sweep[m.chunk_chosen]
            ax.plot([m.chunk_chosen], [chosen], marker="*", ms=14, color=line.get_color())
        base = plan.modes.get(off[m.mode])
        if base is not None:
            ax.axhline(base.s_per_step, ls="--", color=line.get_color(), alpha=0.6, label=f"{m.mode} off")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("chunk size (tokens)")
    ax.set_ylabel("s/step (predicted)")
    ax.set_title("s/step against chunk size, PREDICTED by the twin (star: the controller's pick)", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
