"""The chunk controller's "off" arm (no streaming) on synthetic step-time landscapes with a fake clock:
it settles on "off" when streaming costs and on a chunk size when it pays, keeps "off" within the noise
band, explores arms the cost model calls hopeless rarely, brings them back when the profile changes, and
switches when the landscape changes halfway through a run."""

import dataclasses
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oppo_engine.control import (
    OFF,
    ChunkControl,
    ChunkSizeController,
    SwitchProfile,
    predicted_seconds_per_token,
)

TOKENS = 1000
SIZES = (4, 8, 16, 32, 64)


def run(ctrl, landscape, steps, rng, noise=0.03):
    """``steps`` steps: arm a takes landscape[a] · 1e-4 s/token, times (1 + noise·N(0, 1)); the arms run."""
    arms = []
    for _ in range(steps):
        arm = ctrl.chunk_size()
        seconds = landscape[arm] * 1e-4 * TOKENS * max(0.05, 1.0 + noise * rng.gauss(0.0, 1.0))
        ctrl.observe(arm, seconds, TOKENS)
        arms.append(arm)
    return arms


def profile(slowdown, scored_tokens, **overrides):
    """256 decode iterations of 1 ms per step: decode alone 0.256 s; scoring costs scored_tokens · 1e-4 s."""
    values = dict(
        handoff_s=1e-3,
        prefill_s_per_token=1e-4,
        decode_iter_s=1e-3,
        slowdown={4: slowdown, 64: slowdown},
        running_seqs=32.0,
        tail_seqs=4.0,
        tokens_per_step=8192.0,
        scored_tokens_per_step=scored_tokens,
    )
    values.update(overrides)
    return SwitchProfile(**values)


# The CPU's case: the actor runs 45% slower beside a prefill and hides 0.05 s of scoring: streaming costs.
COSTLY = profile(slowdown=0.45, scored_tokens=500.0)
# The GPU's case: 3% slowdown, 1.5 s of scoring hidden behind a 0.26 s decode: streaming pays.
PAYS = profile(slowdown=0.03, scored_tokens=15000.0)
# Landscapes the profiles describe (relative step times per token).
STREAMING_COSTS = {OFF: 1.0, 4: 1.6, 8: 1.5, 16: 1.45, 32: 1.5, 64: 1.55}
STREAMING_PAYS = {OFF: 1.0, 4: 0.75, 8: 0.6, 16: 0.5, 32: 0.55, 64: 0.7}


def streamed_steps(arms):
    return sum(a != OFF for a in arms)


def test_the_cost_model_predicts_when_streaming_cannot_pay():
    costly = {a: predicted_seconds_per_token(COSTLY, a) for a in (*SIZES, OFF)}
    pays = {a: predicted_seconds_per_token(PAYS, a) for a in (*SIZES, OFF)}
    assert min(costly, key=costly.get) == OFF
    assert all(costly[c] > 1.25 * costly[OFF] for c in SIZES)  # every chunk size is hopeless
    assert min(pays, key=pays.get) != OFF and pays[OFF] > 1.25 * min(pays.values())  # "off" is hopeless
    ctrl = ChunkSizeController(ChunkControl())
    ctrl.set_profile(COSTLY)
    assert ctrl.hopeless() == ctrl.ranking()[1:] and ctrl.ranking()[0] == OFF
    ctrl.set_profile(PAYS)
    assert OFF in ctrl.hopeless() and ctrl.ranking()[0] in SIZES


@pytest.mark.parametrize("with_profile", [False, True])
def test_settles_on_off_when_streaming_costs(with_profile):
    for seed in range(3):
        ctrl = ChunkSizeController(ChunkControl())
        if with_profile:
            ctrl.set_profile(COSTLY)
        arms = run(ctrl, STREAMING_COSTS, 150, random.Random(seed))
        assert ctrl.incumbent == OFF
        # without a profile every exploration tries two chunk sizes; with one, they are hopeless
        assert arms[-100:].count(OFF) >= (95 if with_profile else 80), arms[-100:]


@pytest.mark.parametrize("with_profile", [False, True])
def test_settles_on_a_chunk_size_when_streaming_pays(with_profile):
    for seed in range(3):
        ctrl = ChunkSizeController(ChunkControl())
        if with_profile:
            ctrl.set_profile(PAYS)
        arms = run(ctrl, STREAMING_PAYS, 150, random.Random(seed))
        assert ctrl.incumbent == 16
        assert arms[-100:].count(16) >= 75, arms[-100:]


def test_a_lucky_first_step_does_not_make_streaming_the_incumbent():
    """The first exploration gives each arm one step; "off" is the first incumbent and a faster-looking
    streaming arm must confirm over min_samples steps (the heavy tail makes single steps incomparable)."""
    # explore_budget=None: every arm of the first exploration runs at once (the budget would defer them)
    ctrl = ChunkSizeController(ChunkControl(candidates=(8, 16), warmup_steps=0, explore_budget=None))
    times = iter([1.0, 1.5, 0.3, 1.8])  # off, 8, 16 (a batch of short answers), 16 again: slow
    arms = []
    for _ in range(4):
        arms.append(ctrl.chunk_size())
        ctrl.observe(arms[-1], next(times) * 1e-4 * TOKENS, TOKENS)
    assert arms == [OFF, 8, 16, 16]
    assert ctrl.incumbent == OFF and not ctrl.exploring


def test_the_warmup_step_measures_no_arm():
    """The run's first step is slow for reasons of its own (first forwards): it is recorded, and the arm
    it ran is planned again, so "off" is not judged by it."""
    ctrl = ChunkSizeController(ChunkControl(candidates=(8, 16)))
    first = ctrl.chunk_size()
    ctrl.observe(first, 50.0 * 1e-4 * TOKENS, TOKENS)  # 50x slower than any arm
    assert ctrl.chunk_size() == first == OFF and len(ctrl.history) == 1
    run(ctrl, {OFF: 1.0, 8: 1.3, 16: 1.3}, 40, random.Random(1))
    assert ctrl.incumbent == OFF


def test_off_is_kept_unless_streaming_beats_it_by_more_than_the_noise_band():
    """Streaming 1% faster, 3% noise: within the band, so "off" stays; 10% faster: beyond it, so it wins."""
    for seed in range(5):
        close = {OFF: 1.0, **{c: 0.99 for c in SIZES}}
        ctrl = ChunkSizeController(ChunkControl())
        run(ctrl, close, 150, random.Random(seed))
        assert ctrl.incumbent == OFF
        clear = {OFF: 1.0, **{c: 0.9 for c in SIZES}}
        ctrl = ChunkSizeController(ChunkControl())
        run(ctrl, clear, 150, random.Random(seed))
        assert ctrl.incumbent in SIZES


def test_off_replaces_a_streaming_incumbent_that_is_not_faster_beyond_the_band():
    ctrl = ChunkSizeController(ChunkControl(explore_period=5))
    rng = random.Random(7)
    run(ctrl, STREAMING_PAYS, 60, rng)
    assert ctrl.incumbent == 16
    equal = {OFF: 1.0, **{c: 1.01 for c in SIZES}}  # streaming stopped paying (1% slower: within the band)
    run(ctrl, equal, 80, rng)
    assert ctrl.incumbent == OFF


def test_hopeless_arms_are_explored_rarely():
    """With the profile saying streaming cannot pay, the chunk sizes are tried once every
    ``hopeless_every`` explorations, not in every one."""

    def streamed(control, seed):
        ctrl = ChunkSizeController(control)
        ctrl.set_profile(COSTLY)
        arms = run(ctrl, STREAMING_COSTS, 200, random.Random(seed))
        assert ctrl.incumbent == OFF
        return streamed_steps(arms[20:])

    # explore_budget=None: the cadence of explorations alone (the budget would thin them further)
    rare = [
        streamed(ChunkControl(explore_period=10, hopeless_every=4, explore_budget=None), s) for s in range(3)
    ]
    every = [
        streamed(ChunkControl(explore_period=10, hopeless_margin=1e9, explore_budget=None), s)
        for s in range(3)
    ]
    # 180 steps: ~16 explorations; hopeless arms enter ~4 of them, once each (the band ends a challenge)
    assert max(rare) <= 8, rare
    assert min(every) >= 25, every  # nothing hopeless: two chunk sizes every exploration


def test_a_hopeless_arm_comes_back_when_the_profile_changes():
    """ "Off" incumbent, streaming hopeless; then the profile says streaming pays (the scorers got costlier)
    and it does: the next exploration tries chunk sizes and one is adopted."""
    control = ChunkControl(explore_period=10, hopeless_every=1000)  # hopeless arms never explored
    ctrl = ChunkSizeController(control)
    ctrl.set_profile(COSTLY)
    rng = random.Random(3)
    arms = run(ctrl, STREAMING_COSTS, 100, rng)
    assert ctrl.incumbent == OFF and streamed_steps(arms[3:]) == 0  # after the first exploration: never
    ctrl.set_profile(PAYS)
    # the "off" arm's time is unchanged, so only the profile can bring streaming back
    landscape = {OFF: 1.0, **{c: STREAMING_PAYS[c] for c in SIZES}}
    arms = run(ctrl, landscape, 40, rng)
    first = next(i for i, a in enumerate(arms) if a != OFF)
    assert first <= control.explore_period + 1
    assert ctrl.incumbent == 16


def test_switches_when_the_profile_changes_halfway():
    """Halfway through, streaming starts to pay (longer responses: more scoring to hide); later it stops
    again. The controller follows both changes, with the profile following the workload."""
    for seed in range(3):
        ctrl = ChunkSizeController(ChunkControl())
        rng = random.Random(seed)
        ctrl.set_profile(COSTLY)
        run(ctrl, STREAMING_COSTS, 100, rng)
        assert ctrl.incumbent == OFF
        ctrl.set_profile(PAYS)
        heavier = {a: 1.6 * v for a, v in STREAMING_PAYS.items()}  # every arm slower, "off" the most
        arms = run(ctrl, heavier, 100, rng)
        assert ctrl.incumbent == 16
        assert arms[-50:].count(16) >= 40
        ctrl.set_profile(COSTLY)
        arms = run(ctrl, STREAMING_COSTS, 100, rng)
        assert ctrl.incumbent == OFF
        assert arms[-50:].count(OFF) >= 45


def test_without_the_off_arm_every_step_streams():
    ctrl = ChunkSizeController(ChunkControl(off=False))
    ctrl.set_profile(COSTLY)
    arms = run(ctrl, STREAMING_COSTS, 60, random.Random(0))
    assert OFF not in arms and OFF not in ctrl.ranking()


def test_a_step_that_ran_another_arm_than_planned_measures_neither():
    """A step is measured for the arm it ran, and only if that is the arm planned: a step that streamed
    when "off" was planned (or the reverse) changes neither arm's measurements nor the plan."""
    ctrl = ChunkSizeController(ChunkControl(explore_budget=None))  # the first exploration runs at once
    planned = ctrl.chunk_size()
    assert planned == OFF  # without a profile, the first exploration measures "off" first
    ctrl.observe(16, 1e9, TOKENS)  # streamed instead, absurdly slow
    assert ctrl.chunk_size() == OFF and ctrl.history[-1].chunk_size == 16
    # the first exploration (off, 16, 8), then confirming steps of the challenger
    run(ctrl, {OFF: 1.0, **{c: 0.5 for c in SIZES}}, 5, random.Random(0), noise=0.0)
    assert ctrl.incumbent in SIZES and not ctrl.exploring  # the absurd step did not count against them
    inc = ctrl.incumbent
    while not ctrl.exploring:
        ctrl.observe(inc, 0.5e-4 * TOKENS, TOKENS)
    planned = ctrl.chunk_size()
    other = OFF if planned != OFF else inc
    ctrl.observe(other, 1e-12, TOKENS)  # absurdly fast, but not what was planned
    assert ctrl.chunk_size() == planned and ctrl.incumbent == inc


@settings(max_examples=150, deadline=None)
@given(
    times=st.lists(st.floats(0.2, 5.0), min_size=6, max_size=6),
    noise=st.floats(0.0, 0.2),
    profile_at=st.sampled_from([None, 0, 30]),
    seed=st.integers(0, 2**16),
)
def test_never_explores_off_and_a_chunk_size_in_the_same_step(times, noise, profile_at, seed):
    """Each step runs exactly one arm -- "off" or one chunk size -- and is measured as that arm alone; an
    unmeasured arm runs only in an exploration step; the incumbent is always a measured arm."""
    landscape = dict(zip((*SIZES, OFF), times, strict=True))
    ctrl = ChunkSizeController(ChunkControl(explore_period=3))
    rng = random.Random(seed)
    measured = set()
    for step in range(80):
        if step == profile_at:
            ctrl.set_profile(COSTLY if times[-1] < min(times[:-1]) else PAYS)
        arm = ctrl.chunk_size()
        assert arm == OFF or arm in SIZES
        assert ctrl.exploring or arm in measured
        n = len(ctrl.history)
        ctrl.observe(arm, landscape[arm] * 1e-4 * TOKENS * max(0.05, 1 + noise * rng.gauss(0, 1)), TOKENS)
        assert len(ctrl.history) == n + 1 and ctrl.history[-1].chunk_size == arm
        measured.add(arm)
        assert ctrl.incumbent is None or ctrl.incumbent in measured


def test_a_streamed_step_that_shows_streaming_hopeless_ends_the_exploration():
    """The run's first profile has no slowdown measured (no step streamed yet), so the cost model ranks
    the chunk sizes first and "off" below them. The first streamed step measures the slowdown (the CPU's
    case): the exploration then spares the other chunk sizes (each a slow step) and measures "off"
    instead, which becomes the incumbent; until the 4th exploration (``hopeless_every``) nothing else
    streams."""
    no_slowdown = dataclasses.replace(COSTLY, slowdown={})
    ctrl = ChunkSizeController(ChunkControl(warmup_steps=0, explore_budget=None))  # no budget to defer it
    ctrl.set_profile(no_slowdown)
    assert OFF not in ctrl.ranking()[:3] and OFF not in ctrl.hopeless()  # streaming looks free
    rng = random.Random(0)
    arms = []
    for _ in range(31):  # the first exploration, then three of 10 steps on the incumbent
        arm = ctrl.chunk_size()
        ctrl.observe(arm, STREAMING_COSTS[arm] * 1e-4 * TOKENS * (1 + 0.03 * rng.gauss(0, 1)), TOKENS)
        arms.append(arm)
        ctrl.set_profile(COSTLY if streamed_steps(arms) else no_slowdown)  # as the profiler measures
    assert arms[0] in SIZES and arms[1] == OFF, arms[:4]  # one chunk size measured, then "off"
    assert ctrl.incumbent == OFF
    assert streamed_steps(arms) == 1, arms  # hopeless arms come back on the 4th exploration only
