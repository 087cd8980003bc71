"""What the chunk controller decides on a fresh machine (no calibrated profile, no prior): its first step
runs "off", and the profiler times the actor's decode (``N·d``) and the scorers' busy time ``T`` from that
step's own forwards. No chunk size can save more than ``T`` (streaming at best hides all of it), so every
chunk size is futile -- explored only as a hopeless arm -- exactly when ``T <= noise_floor · (N·d + T)``.
The profiler fits its hand-off/per-token line only through forwards of two token counts or more: an
unstreamed step's single whole-batch forward per scorer leaves it unmeasured. Fake clock, exact numbers."""

import pytest

from oppo_engine.control import OFF, ChunkControl, ChunkSizeController, SwitchProfile
from oppo_engine.obs.timeline import Span
from oppo_engine.sched.profiler import SwitchCostProfiler

SIZES = (4, 8, 16, 32, 64)


def first_step_profile(scoring_s: float | None, **overrides) -> SwitchProfile:
    """What the profiler reports after one unstreamed step: 8 sequences, 800 tokens (100 decode iterations
    of 1 ms: ``N·d`` = 0.1 s), 1,000 tokens scored in ``scoring_s``; no line, no slowdown, no tail."""
    values = dict(
        handoff_s=0.0,
        prefill_s_per_token=(scoring_s or 0.0) / 1000,
        decode_iter_s=1e-3,
        slowdown={},
        running_seqs=8.0,
        tail_seqs=0.0,
        tokens_per_step=800.0,
        scored_tokens_per_step=1000.0,
        scoring_s=scoring_s,
    )
    values.update(overrides)
    return SwitchProfile(**values)


# noise_floor 0.02: futile iff T <= 0.02 * (0.1 + T), i.e. T <= 0.002 / 0.98 = 2.0408 ms.
SHORT = first_step_profile(2e-3)  # 2 ms of scoring: at most 2 ms of a 0.102 s step to save
LONG = first_step_profile(0.2)  # 0.2 s of scoring behind a 0.1 s decode


def test_every_chunk_size_is_futile_exactly_when_the_scoring_is_within_the_floor_of_the_step():
    ctrl = ChunkSizeController(ChunkControl())
    ctrl.set_profile(SHORT)
    assert ctrl.futile() == list(SIZES)
    assert set(ctrl.futile()) <= set(ctrl.hopeless())
    ctrl.set_profile(first_step_profile(2.1e-3))  # 2.1 ms > 0.02 * 0.1021 s = 2.042 ms
    assert ctrl.futile() == []
    ctrl.set_profile(first_step_profile(2e-3, decode_iter_s=1.1e-3))  # 0.11 s of decode: limit 2.24 ms
    assert ctrl.futile() == list(SIZES)
    ctrl.set_profile(first_step_profile(2e-3, decode_iter_s=0.9e-3))  # 0.09 s: limit 1.84 ms < 2 ms
    assert ctrl.futile() == []


def test_a_fitted_intercept_from_one_token_count_does_not_make_chunk_sizes_futile():
    """The reviewer's reproduction: one whole-batch forward per scorer, 177 tokens in 96 ms, once read as
    a 96 ms hand-off and no per-token cost (so "off" priced as decode alone): every size looked futile.
    The bound reads the same step as 96 ms of scoring to hide behind a 0.1 s decode: nothing is futile."""
    ctrl = ChunkSizeController(ChunkControl())
    ctrl.set_profile(first_step_profile(0.096, handoff_s=0.096, prefill_s_per_token=0.0))
    assert ctrl.futile() == []


def test_nothing_is_futile_while_the_scoring_was_not_measured():
    ctrl = ChunkSizeController(ChunkControl())
    assert ctrl.futile() == []  # no profile
    ctrl.set_profile(first_step_profile(None, handoff_s=0.05, prefill_s_per_token=2e-5))
    assert ctrl.futile() == []  # only streamed steps measured: no busy time of an unstreamed step


def first_arms(profile: SwitchProfile, steps: int, control: ChunkControl | None = None) -> list:
    """The arms a fresh controller runs: its first (warm-up) step, after which the profiler's profile of
    that step arrives, then ``steps - 1`` more; every arm measures the same per-token time."""
    ctrl = ChunkSizeController(control or ChunkControl())
    arms = []
    for k in range(steps):
        arm = ctrl.chunk_size()
        ctrl.observe(arm, 1.0, 1000)
        arms.append(arm)
        if k == 0:
            ctrl.set_profile(profile)
    return arms


def test_long_scoring_is_explored():
    assert ChunkSizeController(ChunkControl()).ranking()[0] == OFF  # the first step runs "off"
    arms = first_arms(
        LONG, 4, ChunkControl(explore_budget=None)
    )  # the budget aside (see test_control_chunk_budget)
    assert arms[0] == OFF and any(a in SIZES for a in arms[1:]), arms


def test_short_scoring_is_not_explored_but_every_hopeless_every_th_exploration():
    control = ChunkControl(explore_period=10, hopeless_every=4)
    arms = first_arms(SHORT, 60, control)
    first_streamed = next(i for i, a in enumerate(arms) if a != OFF)
    # explorations 2 and 3 (after 10 steps each on "off") have nothing worth a step; the 4th tries the most
    # promising futile chunk size once (measurements can overrule the model), which loses the tie to "off"
    assert first_streamed >= 30, arms
    assert sum(a != OFF for a in arms) == 1, arms


@pytest.mark.parametrize(
    "control, profile",
    [
        (ChunkControl(), first_step_profile(2e-3, slowdown={16: 0.0})),  # a slowdown is known
        (ChunkControl(prior="list"), SHORT),  # the candidate list, not the model, starts the search
        (ChunkControl(off=False), SHORT),  # no "off" to lose to
    ],
)
def test_nothing_is_futile_once_a_slowdown_is_known_under_prior_list_or_without_off(control, profile):
    ctrl = ChunkSizeController(control)
    ctrl.set_profile(profile)
    assert ctrl.futile() == []


def spans(step: float, streamed: bool) -> list[Span]:
    """A step on a fake clock from ``step``: 10 actor iterations of 1 ms (4 sequences: 40 tokens); the two
    scorers prefill either 120 tokens each in one forward after the actor (``streamed=False``: the
    whole batch), or 20- and 40-token chunks beside it; a forward takes 2 ms + 0.1 ms per token."""
    out = [Span("actor", "decode", step + i * 1e-3, step + (i + 1) * 1e-3) for i in range(10)]
    cost = {20: 4e-3, 40: 6e-3, 120: 14e-3}
    forwards = [(step + 0.01, 120)] if not streamed else [(step, 20), (step + 0.005, 40)]
    for lane in ("reward", "reference"):
        for start, tokens in forwards:
            out.append(Span(lane, "prefill", start, start + cost[tokens], {"tokens": tokens}))
    return out


def test_the_profiler_fits_no_line_through_one_token_count():
    profiler = SwitchCostProfiler("actor", ["reward", "reference"])
    off = profiler.observe(spans(0.0, streamed=False), OFF, 40, [])
    # Both scorers ran side by side for 14 ms: all of it is the busy time, and all of it is assumed per
    # token (1 ms decode, 120 tokens each) -- not a 28 ms hand-off and a free token.
    assert off.scoring_s == pytest.approx(14e-3)
    assert off.handoff_s == 0.0 and off.prefill_s_per_token == pytest.approx(14e-3 / 120)
    streamed = profiler.observe(spans(1.0, streamed=True), 20, 40, [])
    # Two token counts per lane: the line, 2 ms + 0.1 ms per token per scorer, replaces the assumption.
    assert streamed.handoff_s == pytest.approx(4e-3) and streamed.prefill_s_per_token == pytest.approx(2e-4)
    assert streamed.scoring_s == pytest.approx(14e-3)  # measured by unstreamed steps only
    again = profiler.observe(spans(2.0, streamed=False), OFF, 40, [])
    assert again.handoff_s == pytest.approx(4e-3) and again.prefill_s_per_token == pytest.approx(2e-4)
    assert again.scoring_s == pytest.approx(14e-3)


def test_off_is_not_hopeless_when_every_chunk_size_is_futile():
    """The model, which does not know the bound, prices streaming 3x faster than "off" (0.2 s of scoring
    hidden behind a 0.1 s decode); a noise floor of 0.9 makes every size futile (0.2 <= 0.9 * 0.3). "Off"
    is then the best arm that is not futile, not a hopeless one: before, every arm was hopeless, the first
    exploration had no arm, and the engine's next step failed (a flaky test_chunk_off case)."""
    ctrl = ChunkSizeController(ChunkControl(noise_floor=0.9))
    ctrl.observe(ctrl.chunk_size(), 0.3, 800)  # the warm-up step
    ctrl.set_profile(LONG)
    assert ctrl.futile() == list(SIZES) and OFF not in ctrl.hopeless()
    assert ctrl.chunk_size() == OFF and ctrl.exploring
