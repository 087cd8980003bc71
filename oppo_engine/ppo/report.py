"""The demo's figures from per-step records of each mode: time to reward (the paper's headline), the
ablation table, ``records.json`` and the reward curves.

Time to reward: one threshold for every mode, ``seq_first + 0.9 * (seq_final - seq_first)``, where first and
final are the base mode's (``sequential``'s) trailing :data:`TRAILING`-step mean rewards at the start and
the end of its run. A mode's time to reward is its own summed PPO step time (set-up excluded) at the first
step where its trailing mean reaches the threshold (``None`` if it never does).

Time to accuracy (a rule task, ``--task math``): the same rule applied to the per-step accuracy
(``StepRecord.accuracy``) instead of the reward: its own threshold from the base mode's first and final
trailing accuracy means, and each mode's summed step time at its trailing accuracy's first crossing.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from statistics import mean, median

TRAILING = 5  # steps in the trailing mean of the reward
THRESHOLD_FRACTION = 0.9


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
    chunk_size: int | str | None  # "off": the chunk controller did not stream the step
    overcommit: int
    stale_tokens: int
    response_len: float = 0.0
    env_calls: int = 0  # environment calls answered (multi-turn episodes)
    exposed_env_s: float = 0.0  # the actor idle because every sequence waited on its environment
    # A rule task's batch (--task math): the share with the right final number (not the reward), the
    # answers the rule could not read, and the share cut off at max_new_tokens. None for the other tasks.
    accuracy: float | None = None
    unparsed: int | None = None
    cut_off: float | None = None
    # The engine-trainer log-prob gap of the step (PPOStepStats.agreement, docs/agreement.md): the fresh
    # tokens' mean and max |delta| and mean k3, the stale tokens' mean |delta| (None: not measured, or none)
    agreement_mean_abs: float | None = None
    agreement_max_abs: float | None = None
    agreement_k3: float | None = None
    agreement_stale_mean_abs: float | None = None
    # Every class's statistics of that gap, ``{class: {tokens, sequences, mean_abs, max_abs, mean_k3,
    # frac_large, seq_sum_std, seq_sum_max_abs}}`` (agreement.CLASSES; an empty class has 0 tokens and None
    # elsewhere), and whether the step sampled with top-k/top-p (PPOStepStats.truncated_sampling: the
    # behaviour log-probs are then of a truncated law). None: not measured.
    agreement: dict[str, dict[str, float | int | None]] | None = None
    truncated_sampling: bool | None = None
    # The process's CPU seconds over the whole PPO step (time.process_time; every thread): beside step_s and
    # the torch threads, whether a slow step waited for cores or spun (StepMetrics.cpu_s is the engine's part)
    cpu_s: float | None = None
    # The machine's 1-minute load average (os.getloadavg) when the step ended: on a shared machine a step's
    # time is the load's as much as the engine's (None where the platform has none)
    load: float | None = None


def agreement_fields(agreement: dict | None, truncated_sampling: bool | None = None) -> dict:
    """``StepRecord``'s agreement fields from ``PPOStepStats.agreement`` and ``.truncated_sampling``
    (``None`` where it was not measured or the class is empty: records.json stays valid JSON)."""

    def value(cls: str, name: str) -> float | None:
        x = getattr(agreement[cls], name) if agreement else math.nan
        return None if math.isnan(x) else x

    def stats(gap) -> dict[str, float | int | None]:
        return {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in asdict(gap).items()}

    return {
        "agreement_mean_abs": value("fresh", "mean_abs"),
        "agreement_max_abs": value("fresh", "max_abs"),
        "agreement_k3": value("fresh", "mean_k3"),
        "agreement_stale_mean_abs": value("stale", "mean_abs"),
        "agreement": {cls: stats(gap) for cls, gap in agreement.items()} if agreement else None,
        "truncated_sampling": truncated_sampling,
    }


@dataclass(slots=True)
class ModeRun:
    mode: str
    records: list[StepRecord] = field(default_factory=list)
    unavailable: str | None = None  # why the mode could not run
    # Held-out greedy accuracy before and after the run (--task math), 0..1; None when not evaluated.
    eval_accuracy_initial: float | None = None
    eval_accuracy_final: float | None = None

    def final_reward(self, last: int = TRAILING) -> float:
        """Mean reward of the last ``last`` steps."""
        return mean(r.reward for r in self.records[-last:])

    def trailing(self) -> list[float]:
        """The trailing mean reward at each step from the TRAILING-th on (over all steps if fewer)."""
        return _trailing([r.reward for r in self.records])

    def trailing_accuracy(self) -> list[float] | None:
        """The trailing mean accuracy, as ``trailing()``; None unless every step recorded an accuracy (a
        rule task)."""
        accuracy = [r.accuracy for r in self.records]
        return _trailing(accuracy) if accuracy and None not in accuracy else None

    def s_per_step(self) -> float:
        return mean(r.step_s for r in self.records)

    def rollout_s_per_step(self) -> float:
        return mean(r.rollout_s for r in self.records)


def _trailing(values: list[float]) -> list[float]:
    if len(values) < TRAILING:
        return [mean(values)] if values else []
    return [mean(values[i - TRAILING : i]) for i in range(TRAILING, len(values) + 1)]


def _threshold(trailing: list[float]) -> float:
    return trailing[0] + THRESHOLD_FRACTION * (trailing[-1] - trailing[0])


def _steps_to(trailing: list[float], steps: int, threshold: float) -> int | None:
    """The step (1-based) of ``trailing``'s first value at or above ``threshold`` over ``steps`` records."""
    offset = min(TRAILING, steps) - 1
    for i, value in enumerate(trailing):
        if value >= threshold:
            return i + offset + 1
    return None


def reward_threshold(base: ModeRun) -> float:
    """``first + 0.9 * (final - first)`` of the base mode's trailing mean rewards."""
    return _threshold(base.trailing())


def accuracy_threshold(base: ModeRun) -> float | None:
    """``first + 0.9 * (final - first)`` of the base mode's trailing mean accuracies; None when its steps
    recorded no accuracy (not a rule task)."""
    trailing = base.trailing_accuracy()
    return _threshold(trailing) if trailing else None


def time_to_accuracy(run: ModeRun, threshold: float | None) -> float | None:
    """The mode's summed step time at the first step whose trailing mean accuracy reaches ``threshold``;
    None when it never does, or when there is no accuracy (``threshold`` None, or the mode's steps recorded
    none)."""
    trailing = run.trailing_accuracy()
    if threshold is None or trailing is None:
        return None
    step = _steps_to(trailing, len(run.records), threshold)
    return run.records[step - 1].elapsed_s if step is not None else None


def time_to_reward(run: ModeRun, threshold: float) -> float | None:
    """The mode's summed step time at the first step whose trailing mean reaches ``threshold``."""
    step = steps_to_reward(run, threshold)
    return run.records[step - 1].elapsed_s if step is not None else None


def steps_to_reward(run: ModeRun, threshold: float) -> int | None:
    """How many steps the mode took to reach ``threshold`` (its trailing mean's first crossing), or None:
    time to reward is this many steps at the mode's own s/step, so the two ratios separate the pipeline's
    speed from the reward curve's parity."""
    return _steps_to(run.trailing(), len(run.records), threshold)


def chunk_choice(run: ModeRun) -> str:
    """The chunk size the controller chose most often over the second half of the run (or "off"), with
    its share of those steps; "-" for a mode that never streams."""
    sizes = [r.chunk_size for r in run.records[len(run.records) // 2 :] if r.chunk_size is not None]
    if not sizes:
        return "-"
    arm, count = Counter(sizes).most_common(1)[0]
    return f"{arm} ({count}/{len(sizes)})"


def base_run(runs: list[ModeRun]) -> ModeRun | None:
    """The mode every ratio is taken against: ``sequential`` if it ran, else the first that ran."""
    ran = [r for r in runs if r.records]
    return next((r for r in ran if r.mode == "sequential"), ran[0] if ran else None)


def records_json(runs: list[ModeRun]) -> dict:
    """``{mode: {time_to_reward_s, threshold, s_per_step, rollout_s_per_step, final_reward, records}}``,
    ``time_to_accuracy_s`` (None: not reached) in a rule task's entries (its steps recorded an accuracy),
    and ``eval_accuracy_initial`` / ``eval_accuracy_final`` where the held-out accuracy was evaluated."""
    base = base_run(runs)
    if base is None:
        return {}
    threshold, accuracy = reward_threshold(base), accuracy_threshold(base)
    return {
        r.mode: {
            "time_to_reward_s": time_to_reward(r, threshold),
            "threshold": threshold,
            "s_per_step": r.s_per_step(),
            "rollout_s_per_step": r.rollout_s_per_step(),
            "final_reward": r.final_reward(),
            "records": [asdict(x) for x in r.records],
            **(
                {"time_to_accuracy_s": time_to_accuracy(r, accuracy)}
                if r.trailing_accuracy() is not None
                else {}
            ),
            **(
                {
                    "eval_accuracy_initial": r.eval_accuracy_initial,
                    "eval_accuracy_final": r.eval_accuracy_final,
                }
                if r.eval_accuracy_initial is not None or r.eval_accuracy_final is not None
                else {}
            ),
        }
        for r in runs
        if r.records
    }


def _percent(value: float | None) -> str:
    return f"{value:.1%}" if value is not None else "-"


def _mean_or_dash(values: list[float | None]) -> str:
    known = [v for v in values if v is not None]
    return f"{mean(known):.2e}" if known else "-"


def _ratio(base: float | None, value: float | None) -> str:
    return f"{base / value:.2f}x" if base is not None and value else "-"


def _first_step(recs: list[StepRecord]) -> str:
    """The first step's time, and its ratio to the later steps' median: the process's one-time costs
    (docs/ppo.md, "The first step")."""
    if len(recs) < 2:
        return f"{recs[0].step_s:.1f}"
    return f"{recs[0].step_s:.1f} ({recs[0].step_s / median(r.step_s for r in recs[1:]):.1f}x)"


def _cpu_share(recs: list[StepRecord]) -> str:
    """The process's CPU seconds over wall seconds, first step and later steps' median ("-": not
    measured): below the torch threads, the step waited for cores."""
    shares = [r.cpu_s / r.step_s if r.cpu_s is not None and r.step_s > 0 else None for r in recs]
    if shares[0] is None:
        return "-"
    later = [x for x in shares[1:] if x is not None]
    return f"{shares[0]:.2f}, {median(later):.2f}" if later else f"{shares[0]:.2f}"


def steps_to_accuracy(run: ModeRun, threshold: float | None) -> int | None:
    """How many steps the mode took to reach the accuracy ``threshold`` (as ``steps_to_reward``), or None."""
    trailing = run.trailing_accuracy()
    if threshold is None or trailing is None:
        return None
    return _steps_to(trailing, len(run.records), threshold)


def _time_to(run: ModeRun, base: ModeRun, threshold: float | None, what: str) -> dict[str, str]:
    """The table's three rows of time to ``what`` (``reward`` or ``accuracy``): seconds, the ratio to the
    base mode's, steps."""
    if what == "accuracy":
        t, base_t = time_to_accuracy(run, threshold), time_to_accuracy(base, threshold)
        steps = steps_to_accuracy(run, threshold)
    else:
        t, base_t = time_to_reward(run, threshold), time_to_reward(base, threshold)
        steps = steps_to_reward(run, threshold)
    return {
        f"time to {what} (s)": f"{t:.1f}" if t is not None else "not reached",
        f"  speed-up vs {base.mode}": _ratio(base_t, t),
        f"  steps to {what}": str(steps) if steps is not None else "-",
    }


def _load(recs: list[StepRecord]) -> str:
    """The machine's load average over the mode's steps, median and max ("-": not recorded)."""
    loads = [r.load for r in recs if r.load is not None]
    return f"{median(loads):.1f}, {max(loads):.1f}" if loads else "-"


def _class_stat(rec: StepRecord, cls: str, name: str) -> float | None:
    """One statistic of one token class of the step's engine-trainer gap (None: not measured, or empty)."""
    return rec.agreement[cls][name] if rec.agreement else None


def _class_mean(recs: list[StepRecord], cls: str) -> str:
    """The mean over the steps of one token class's mean |Δ|, steps where it was empty left out."""
    return _mean_or_dash([_class_stat(r, cls, "mean_abs") for r in recs])


def _carries(runs: list[ModeRun]) -> bool:
    """Some step of some mode measured tokens of the ``carried_current`` class."""
    return any(_class_stat(r, "carried_current", "tokens") for run in runs for r in run.records)


def _rows(run: ModeRun, base: ModeRun, threshold: float, carried: bool = False) -> dict[str, str]:
    """The table's column of ``run``; ``carried`` adds the ``carried_current`` class's gap row."""
    recs = run.records
    bias = [r.length_bias for r in recs if r.length_bias is not None]
    rollout_s = sum(r.rollout_s for r in recs)
    accuracy = accuracy_threshold(base)  # a rule task: time to accuracy in place of time to reward
    ruled = accuracy is not None and run.trailing_accuracy() is not None
    return {
        **(_time_to(run, base, accuracy, "accuracy") if ruled else _time_to(run, base, threshold, "reward")),
        "s/step (PPO step)": f"{run.s_per_step():.3f}",
        "first step s (x later median)": _first_step(recs),
        "CPU/wall: first step, later": _cpu_share(recs),
        "machine load (1 min): median, max": _load(recs),
        f"  speed-up vs {base.mode} ": _ratio(base.s_per_step(), run.s_per_step()),
        "s/step (rollout)": f"{run.rollout_s_per_step():.3f}",
        f"  speed-up vs {base.mode}  ": _ratio(base.rollout_s_per_step(), run.rollout_s_per_step()),
        "update s/step": f"{mean(r.step_s - r.rollout_s for r in recs):.3f}",
        "rollout share of the step": f"{rollout_s / sum(r.step_s for r in recs):.0%}",
        "exposed scoring s/step": f"{mean(r.exposed_scoring_s for r in recs):.3f}",
        **(
            {
                "tool calls/step": f"{mean(r.env_calls for r in recs):.1f}",
                "exposed tool s/step": f"{mean(r.exposed_env_s for r in recs):.3f}",
            }
            if any(r.env_calls for r in base.records)
            else {}
        ),  # fmt: skip
        "mean overcommit (Δ)": f"{mean(r.overcommit for r in recs):.1f}",
        "chunk size chosen": chunk_choice(run),
        "stale tokens/step": f"{mean(r.stale_tokens for r in recs):.1f}",
        "length bias": f"{mean(bias):.3f}" if bias else "-",
        "mean response length": f"{mean(r.response_len for r in recs):.1f}",
        "engine-trainer gap, mean |Δ|": _mean_or_dash([r.agreement_mean_abs for r in recs]),
        **({"  carried_current class, mean |Δ|": _class_mean(recs, "carried_current")} if carried else {}),
        "rollouts/s": f"{sum(r.rollouts for r in recs) / rollout_s:.1f}",
        "reward: first -> final": f"{recs[0].reward:+.3f} -> {run.final_reward():+.3f}",
        **(
            {
                "accuracy: first -> final": f"{recs[0].accuracy:.0%} -> "
                f"{mean(r.accuracy for r in recs[-TRAILING:]):.0%}",
                "cut off at max_new_tokens": f"{mean(r.cut_off for r in recs):.0%}",
                "unparsed answers/step": f"{mean(r.unparsed for r in recs):.1f}",
                "held-out accuracy: before -> after": f"{_percent(run.eval_accuracy_initial)} -> "
                f"{_percent(run.eval_accuracy_final)}",
            }
            if base.records[0].accuracy is not None and recs[0].accuracy is not None
            else {}
        ),
    }


def format_table(runs: list[ModeRun]) -> str:
    """The ablation table: metrics as rows, modes as columns; a mode that could not run says so. On a rule
    task (``--task math``) time to accuracy takes time to reward's place. The engine-trainer gap row is the
    ``fresh`` tokens'; a row for the ``carried_current`` class follows it when some mode measured one."""
    base = base_run(runs)
    if base is None:
        return "\n".join(f"{r.mode}: unavailable ({r.unavailable})" for r in runs)
    threshold = reward_threshold(base)
    carried = _carries(runs)
    columns = {run.mode: _rows(run, base, threshold, carried) if run.records else None for run in runs}
    names = list(_rows(base, base, threshold, carried))
    width = max(map(len, names))
    col_w = max(14, *(len(m) for m in columns), *(len(v) for c in columns.values() if c for v in c.values()))
    accuracy = accuracy_threshold(base)
    what, value = ("accuracy", accuracy) if accuracy is not None else ("reward", threshold)
    lines = [
        f"time to {what}: threshold {value:+.3f} = {base.mode}'s first trailing {TRAILING}-step mean "
        f"{what} + {THRESHOLD_FRACTION} x (its final - its first)",
        "".ljust(width) + " | " + " | ".join(m.ljust(col_w) for m in columns),
    ]
    lines.append("-" * len(lines[-1]))
    for name in names:
        cells = [(c[name] if c is not None else "unavailable").ljust(col_w) for c in columns.values()]
        lines.append(name.ljust(width) + " | " + " | ".join(cells))
    for run in runs:
        if run.unavailable:
            lines.append(f"{run.mode}: unavailable ({run.unavailable})")
    return "\n".join(lines)


def plot(out: Path, runs: list[ModeRun]) -> list[Path]:
    """reward.png (reward vs step and vs wall time, every mode overlaid, the time-to-reward threshold
    dashed), control.png (chunk size, 0 for "off", and Δ per step), on a rule task accuracy.png
    (``_plot_accuracy``) and, where the engine-trainer gap was measured, agreement.png
    (``_plot_agreement``)."""
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
    ax2.set(xlabel="the mode's own PPO step time (s)", ylabel="mean reward", title="reward vs wall time")
    base = base_run(runs)
    for ax in (ax1, ax2):
        ax.axhline(reward_threshold(base), color="grey", linestyle="--", linewidth=1, label="threshold")
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    paths.append(out / "reward.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for run in runs:
        steps = [r.step for r in run.records]
        sizes = [r.chunk_size if isinstance(r.chunk_size, int) else 0 for r in run.records]
        ax1.step(steps, sizes, where="post", label=run.mode)
        ax2.step(steps, [r.overcommit for r in run.records], where="post", label=run.mode)
    ax1.set(xlabel="PPO step", ylabel='chunk size C (0: not streamed, "off")', title="chunk size over time")
    ax2.set(xlabel="PPO step", ylabel="overcommit Δ", title="Δ over time")
    for ax in (ax1, ax2):
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    paths.append(out / "control.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)
    if all(r.trailing_accuracy() is not None for r in runs):
        paths.append(_plot_accuracy(plt, out / "accuracy.png", runs, base))
    if any(r.agreement for run in runs for r in run.records):
        paths.append(_plot_agreement(plt, out / "agreement.png", runs))
    return paths


def _plot_agreement(plt, path: Path, runs: list[ModeRun]) -> Path:
    """agreement.png: one panel per mode, the engine-trainer gap per PPO step of each token class that
    held tokens at some step (``StepRecord.agreement``), mean |Δ| solid and max |Δ| dashed in the class's
    colour; a step where the class is empty leaves a gap. The y axis is logarithmic when every plotted value
    is positive (fp32 rounding and a policy update differ by orders of magnitude)."""
    fig, axes = plt.subplots(1, len(runs), figsize=(5.5 * len(runs), 4), sharey=True, squeeze=False)
    # The classes in agreement.measure's order, one colour each across the panels.
    classes = list(dict.fromkeys(cls for run in runs for r in run.records for cls in r.agreement or ()))
    values = []
    for ax, run in zip(axes[0], runs, strict=True):
        steps = [r.step for r in run.records]
        for i, cls in enumerate(classes):
            if not any(_class_stat(r, cls, "tokens") for r in run.records):
                continue
            for stat, style, what in (("mean_abs", "-", "mean"), ("max_abs", "--", "max")):
                ys = [_class_stat(r, cls, stat) for r in run.records]
                ys = [math.nan if y is None else y for y in ys]
                ax.plot(steps, ys, style, color=f"C{i}", marker=".", label=f"{cls}, {what} |Δ|")
                values += [y for y in ys if not math.isnan(y)]
        ax.set(xlabel="PPO step", title=run.mode)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    axes[0][0].set_ylabel("|log π_trainer − log π_behaviour| (nats)")
    if values and min(values) > 0:
        axes[0][0].set_yscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _plot_accuracy(plt, path: Path, runs: list[ModeRun], base: ModeRun) -> Path:
    """accuracy.png (a rule task): each mode's per-step batch accuracy (thin) and its trailing mean (thick)
    against the mode's own PPO step time, the time-to-accuracy threshold dashed, and the held-out accuracy
    before and after as markers at 0 and the mode's last step."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for run in runs:
        t = [r.elapsed_s for r in run.records]
        (line,) = ax.plot(t, [r.accuracy for r in run.records], alpha=0.35, linewidth=1)
        trailing = run.trailing_accuracy()
        ax.plot(t[len(t) - len(trailing) :], trailing, color=line.get_color(), linewidth=2,
                label=f"{run.mode} (trailing {TRAILING}-step mean)")  # fmt: skip
        if run.eval_accuracy_initial is not None and run.eval_accuracy_final is not None:
            ax.plot([0, t[-1]], [run.eval_accuracy_initial, run.eval_accuracy_final], "o--",
                    color=line.get_color(), linewidth=0.8, label=f"{run.mode}: held-out, greedy")  # fmt: skip
    ax.axhline(accuracy_threshold(base), color="grey", linestyle="--", linewidth=1, label="threshold")
    ax.set(xlabel="the mode's own PPO step time (s)", ylabel="accuracy (right final number)",
           title="accuracy vs wall time", ylim=(0, 1))  # fmt: skip
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
