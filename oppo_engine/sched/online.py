"""What the online controllers are fed after each step, and the chunk size they choose before it.

The controllers themselves (``control/``) are pure Python; this is where a step's measurements become
their inputs: the chunk-size controller gets the time per generated token and the lanes' switch-cost
profile, the Δ controller the batch's mean reward. Under a process group both see the group's numbers:
``group`` is the engine's ``EngineGroup`` (``distributed/group.py``), which exchanges a ``StepReport``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from oppo_engine.control import ChunkSizeController, DeltaController, SwitchProfile
from oppo_engine.model.roles import ACTOR, REFERENCE, REWARD
from oppo_engine.obs import Timeline
from oppo_engine.sched.profiler import SwitchCostProfiler
from oppo_engine.sched.sequence import Sequence
from oppo_engine.sched.step import StepOutcome


@dataclass(frozen=True, slots=True)
class StepReport:
    """What a step measured, for the controllers: tokens generated, wall seconds, the sum and count of the
    returned batch's rewards, and the switch-cost profile so far (``None`` where none was measured).

    One rank's report goes in ``EngineGroup.end_step``; the group's comes out, in the same form: tokens,
    rewards and their count summed over the ranks, ``wall_s`` the slowest per-token time times the group's
    tokens (so that ``wall_s / tokens`` is the slowest rank's time per token), the profile field-wise
    largest."""

    tokens: int
    wall_s: float
    reward_sum: float
    rewards: int
    profile: SwitchProfile | None = None


def chunk_controller(
    config, models, *, prior: Callable[[], SwitchProfile | None] | None = None
) -> tuple[ChunkSizeController | None, SwitchCostProfiler | None]:
    """The chunk-size controller of an ``EngineConfig`` (a fixed ``chunk_size``, or the online search) and
    the profiler that feeds it the lanes' switch costs; ``(None, None)`` outside the streaming modes.
    ``models`` are the engine's by role; the profiler also watches a remote reward and reference.

    Under ``ChunkControl(prior="model")`` the search starts from the switch costs ``prior()`` predicts
    (the engine passes the twin's cost model of its models on its device, ``sim/prior.py``); where it has
    none (``None``) the search starts from the candidate list."""
    if config.mode not in ("intra", "oppo"):
        return None, None
    fixed = config.chunk_size if isinstance(config.chunk_size, int) else None
    scorers = [REWARD, REFERENCE, *(n for n in models if n != ACTOR)]
    control = ChunkSizeController(config.chunk, fixed=fixed)
    if fixed is None and config.chunk.prior == "model" and prior is not None:
        predicted = prior()
        if predicted is not None:
            control.set_prior(predicted)
    return control, SwitchCostProfiler(ACTOR, scorers)


def next_chunk_size(control: ChunkSizeController | None, group) -> int | str | None:
    """The chunk size (or "off") of the next step; ``None`` outside the streaming modes. Under a process
    group, rank 0's online decision (collective)."""
    if control is None:
        return None
    chunk_size = control.chunk_size()
    if group is not None and control.fixed is None:
        chunk_size = group.agree_chunk_size(chunk_size)
    return chunk_size


def feed_controllers(
    chunk_size: int | str | None,
    out: StepOutcome,
    wall_s: float,
    batch: list[Sequence],
    *,
    chunk_control: ChunkSizeController | None,
    profiler: SwitchCostProfiler | None,
    delta_control: DeltaController | None,
    trainer_reward: bool,
    timeline: Timeline,
    group,
) -> None:
    """Feed the chunk-size controller this step's time per token and the lanes' switch-cost profile, and
    the Δ controller the batch's mean reward (unless the trainer reports its own: ``trainer_reward``).
    Under a process group both are fed the group's numbers (collective: the step's last exchange)."""
    profile = None
    if chunk_size is not None:
        finish_times = [s.finish_time for s in out.finished if s.finish_time is not None]
        profile = profiler.observe(timeline.spans(), chunk_size, out.tokens_generated, finish_times)
    reward_sum = sum(float(s.final_reward) for s in batch)
    report = StepReport(out.tokens_generated, wall_s, reward_sum, len(batch), profile)
    if group is not None:
        report = group.end_step(report)
    if chunk_size is not None:
        chunk_control.observe(chunk_size, report.wall_s, report.tokens)
        if report.profile is not None:
            chunk_control.set_profile(report.profile)
    if delta_control is not None and report.rewards and not trainer_reward:
        delta_control.observe_reward(report.reward_sum / report.rewards)
