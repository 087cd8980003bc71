"""Reporting for bench_e2e: per-mode summary, table, CSV files and the PNG figure."""

from __future__ import annotations

import csv
import math
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

from oppo_engine.obs.metrics import StepMetrics
from oppo_engine.obs.timeline import Span


@dataclass(slots=True)
class StepRecord:
    """One measured step of one mode: its metrics (wall_s measured by the bench) and lane spans."""

    mode: str
    step: int
    metrics: StepMetrics
    spans: list[Span] = field(default_factory=list)
    swap_s: float = 0.0  # untimed release_memory/resume around the step (a PPO loop's training phase)
    total_pages: int | None = None  # size of the mode's KV arena in pages (cache_stats); None for hf


@dataclass(slots=True)
class ModeSummary:
    """What the table, the CSV and the speedup lines report for one mode."""

    mode: str
    reason: str = ""  # why the mode is unavailable; empty when it ran
    steps: int = 0
    median_step_s: float = math.nan
    rollouts_per_s: float = math.nan
    tokens_per_s: float = math.nan
    exposed_scoring_s: float = math.nan  # median over steps
    lane_busy: dict[str, float] = field(default_factory=dict)  # mean over steps
    gpu_util: float | None = None
    peak_pages: int | None = None
    total_pages: int | None = None

    @property
    def available(self) -> bool:
        return not self.reason


def summarize(mode: str, records: list[StepRecord], paged: bool) -> ModeSummary:
    """Aggregate the measured (post-warmup) steps of `mode`; `paged` is False for the hf baseline."""
    ms = [r.metrics for r in records]
    if not ms:
        return ModeSummary(mode, reason="no measured steps")
    wall = sum(m.wall_s for m in ms)
    lanes = sorted({lane for m in ms for lane in m.lane_busy})
    utils = [m.gpu_util for m in ms if m.gpu_util is not None]
    return ModeSummary(
        mode,
        steps=len(ms),
        median_step_s=statistics.median(m.wall_s for m in ms),
        rollouts_per_s=sum(m.rollouts for m in ms) / wall,
        # NOTE: the speedup basis: overcommit returns the shortest responses first, so per-step counts
        # of rollouts are biased in its favour over few steps, while generated tokens are not.
        tokens_per_s=sum(m.tokens_generated for m in ms) / wall,
        exposed_scoring_s=statistics.median(m.exposed_scoring_s for m in ms),
        lane_busy={lane: statistics.fmean(m.lane_busy.get(lane, 0.0) for m in ms) for lane in lanes},
        gpu_util=statistics.fmean(utils) if utils else None,
        peak_pages=max(m.pages_used for m in ms) if paged else None,
        total_pages=max((r.total_pages for r in records if r.total_pages is not None), default=None),
    )


def _fmt(v: float | int | None, spec: str) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def _busy(b: dict[str, float]) -> str:
    return " ".join(f"{lane}={frac:.0%}" for lane, frac in b.items()) or "-"


def _pages(s: ModeSummary) -> str:
    """Peak pages used over the arena size, e.g. `812/1024`."""
    if s.peak_pages is None:
        return "-"
    return f"{s.peak_pages}/{_fmt(s.total_pages, 'd')}"


def format_table(summaries: list[ModeSummary]) -> str:
    """A fixed-width table, one row per mode; unavailable modes show their reason."""
    head = (
        f"{'mode':<11}{'step s':>9}{'rollouts/s':>12}{'tok/s':>11}{'exposed s':>11}{'gpu %':>7}{'pages':>14}"
        "  lanes"
    )
    rows = [head, "-" * len(head)]
    for s in summaries:
        if not s.available:
            rows.append(f"{s.mode:<11}unavailable: {s.reason}")
            continue
        rows.append(
            f"{s.mode:<11}{_fmt(s.median_step_s, '.3f'):>9}{_fmt(s.rollouts_per_s, '.2f'):>12}"
            f"{_fmt(s.tokens_per_s, '.1f'):>11}{_fmt(s.exposed_scoring_s, '.3f'):>11}"
            f"{_fmt(s.gpu_util, '.0f'):>7}"
            f"{_pages(s):>14}  {_busy(s.lane_busy)}"
        )
    return "\n".join(rows)


def speedup_line(summaries: dict[str, ModeSummary], fast: str, base: str) -> str:
    """`speedup_<fast>_vs_<base>=X.XX` on generated tokens/s, or `=nan (reason)`."""
    key = f"speedup_{fast}_vs_{base}"
    for mode in (fast, base):
        s = summaries.get(mode)
        if s is None:
            return f"{key}=nan ({mode}: not in --modes)"
        if not s.available:
            return f"{key}=nan ({mode}: {s.reason})"
    ratio = summaries[fast].tokens_per_s / summaries[base].tokens_per_s
    return f"{key}={ratio:.2f}"


MIN_STEPS_FOR_SPEEDUP = 3  # fewer measured steps per mode: one cold or noisy step decides the ratio
MAX_STEP_SPREAD = 2.0  # slowest over fastest measured step of one mode above which its figures are noisy


def spread_warnings(records: dict[str, list[StepRecord]]) -> list[str]:
    """A warning line for each mode whose measured step times spread more than ``MAX_STEP_SPREAD`` times."""
    lines = []
    for mode, recs in records.items():
        walls = [r.metrics.wall_s for r in recs]
        if len(walls) >= 2 and min(walls) > 0 and max(walls) / min(walls) > MAX_STEP_SPREAD:
            lines.append(
                f"WARNING [{mode}] step times spread {max(walls) / min(walls):.1f}x "
                f"({min(walls):.3f}s to {max(walls):.3f}s): its figures are noisy; run more --warmup / "
                "--steps"
            )
    return lines


def too_few_steps_line(steps: int) -> str:
    """Said instead of the speed-up lines when too few steps were measured to compare modes."""
    return (
        f"no speed-up line: --steps {steps} is below {MIN_STEPS_FOR_SPEEDUP}, and so few steps per mode "
        "(one of them possibly cold) cannot support a ratio; run --steps 3 or more"
    )


def write_csvs(out: Path, summaries: list[ModeSummary], records: list[StepRecord]) -> list[Path]:
    """summary.csv (one row per mode) and steps.csv (one row per measured step)."""
    out.mkdir(parents=True, exist_ok=True)
    summary_rows = [
        asdict(s) | {"available": s.available, "lane_busy": _busy(s.lane_busy)} for s in summaries
    ]
    step_rows = [
        {"mode": r.mode, "step": r.step, "swap_s": r.swap_s, "total_pages": r.total_pages}
        | asdict(r.metrics)
        | {"lane_busy": _busy(r.metrics.lane_busy)}
        for r in records
    ]
    paths = []
    for name, rows in (("summary.csv", summary_rows), ("steps.csv", step_rows)):
        path = out / name
        with path.open("w", newline="") as f:
            if rows:
                w = csv.DictWriter(f, fieldnames=list(rows[0]))
                w.writeheader()
                w.writerows(rows)
        paths.append(path)
    return paths


def plot(path: Path, summaries: list[ModeSummary], step_spans: dict[str, list[Span]]) -> str:
    """Throughput per mode and a lane timeline of one step per mode; returns what was done."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "PNG skipped: matplotlib is not installed (pip install matplotlib)"
    ran = [s for s in summaries if s.available]
    fig, (ax_tp, ax_tl) = plt.subplots(1, 2, figsize=(13, 4.5), gridspec_kw={"width_ratios": [1, 2]})
    ax_tp.bar([s.mode for s in ran], [s.tokens_per_s for s in ran], color="tab:blue")
    ax_tp.set_ylabel("generated tokens / s")
    ax_tp.set_title("throughput per mode")
    rows: list[tuple[str, list[tuple[float, float]]]] = []
    for mode, spans in step_spans.items():
        if not spans:
            continue
        t0 = min(s.start_s for s in spans)
        for lane in dict.fromkeys(s.lane for s in spans):
            rows.append(
                (f"{mode}/{lane}", [(s.start_s - t0, s.end_s - s.start_s) for s in spans if s.lane == lane])
            )
    for y, (_, bars) in enumerate(rows):
        ax_tl.broken_barh(bars, (y - 0.4, 0.8), color=f"C{y % 10}")
    ax_tl.set_yticks(range(len(rows)), [label for label, _ in rows])
    ax_tl.invert_yaxis()
    ax_tl.set_xlabel("seconds since step start")
    ax_tl.set_title("lane timeline of the last measured step")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"wrote {path}"
