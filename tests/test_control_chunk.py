"""ChunkSizeController on synthetic step-time landscapes with a fake clock (no torch, no timing)."""

import random
import subprocess
import sys
from pathlib import Path

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

TOKENS = 1000  # tokens generated per synthetic step


def run(ctrl, landscape, steps, rng, noise=0.0):
    """Drive ``ctrl`` for ``steps`` steps: size c takes landscape(c) s/token, times (1 + noise·N(0, 1))."""
    sizes = []
    for _ in range(steps):
        c = ctrl.chunk_size()
        seconds = landscape(c) * TOKENS * max(0.05, 1.0 + noise * rng.gauss(0.0, 1.0))
        ctrl.observe(c, seconds, TOKENS)
        sizes.append(c)
    return sizes


def switches(ctrl):
    """How many times the incumbent changed over the run (recorded by the caller)."""
    return sum(a != b for a, b in zip(ctrl, ctrl[1:], strict=False))


def make_profile(**overrides):
    values = dict(
        handoff_s=2e-3,
        prefill_s_per_token=1e-4,
        decode_iter_s=5e-3,
        slowdown={4: 0.05, 64: 0.4},
        running_seqs=32.0,
        tail_seqs=8.0,
        tokens_per_step=8192.0,
    )
    values.update(overrides)
    return SwitchProfile(**values)


# --- the cost model ---------------------------------------------------------------------------------------


def test_handoff_cost_favours_large_chunks_and_exposed_tail_favours_small_ones():
    handoff_only = make_profile(prefill_s_per_token=0.0, slowdown={})
    tail_only = make_profile(handoff_s=0.0, slowdown={})
    candidates = (4, 8, 16, 32, 64)
    by_handoff = sorted(candidates, key=lambda c: predicted_seconds_per_token(handoff_only, c))
    by_tail = sorted(candidates, key=lambda c: predicted_seconds_per_token(tail_only, c))
    assert by_handoff == [64, 32, 16, 8, 4]
    assert by_tail == [4, 8, 16, 32, 64]


def test_cost_model_optimum_is_the_square_root_balance_of_handoffs_and_tail():
    # N = tokens / running = 256 iterations; C* = sqrt(N·h / (k·p)) = sqrt(256e-3 / (4 · 2.5e-4)) = 16
    profile = make_profile(
        handoff_s=1e-3,
        prefill_s_per_token=2.5e-4,
        tail_seqs=4.0,
        running_seqs=32.0,
        tokens_per_step=8192.0,
        slowdown={},
    )
    costs = {c: predicted_seconds_per_token(profile, c) for c in (2, 4, 8, 16, 32, 64, 128)}
    assert min(costs, key=costs.get) == 16
    assert costs[8] > costs[16] < costs[32]


def test_interference_moves_the_optimum_to_smaller_chunks():
    flat = make_profile(slowdown={})
    steep = make_profile(slowdown={4: 0.0, 16: 0.05, 64: 0.6})
    candidates = (4, 8, 16, 32, 64)
    best_flat = min(candidates, key=lambda c: predicted_seconds_per_token(flat, c))
    best_steep = min(candidates, key=lambda c: predicted_seconds_per_token(steep, c))
    assert best_steep < best_flat


def test_slowdown_interpolates_in_log_size_and_holds_flat_outside_the_measured_range():
    profile = make_profile(slowdown={8: 0.1, 32: 0.3})
    assert profile.slowdown_at(4) == pytest.approx(0.1)
    assert profile.slowdown_at(16) == pytest.approx(0.2)  # halfway between 8 and 32 in log2
    assert profile.slowdown_at(128) == pytest.approx(0.3)
    assert make_profile(slowdown={}).slowdown_at(16) == 0.0


# --- the online search ------------------------------------------------------------------------------------


def u_shaped_profile():
    """C* = sqrt(N·h / (k·p)) = 32 with N = 256 iterations; 16 and 64 cost 18% more, beyond the noise."""
    return make_profile(
        handoff_s=4e-3, prefill_s_per_token=1.25e-4, decode_iter_s=1e-4, tail_seqs=8.0, slowdown={}
    )


def test_converges_to_the_best_candidate_ranked_by_the_profile():
    profile = u_shaped_profile()
    candidates = (4, 8, 16, 32, 64)
    assert min(candidates, key=lambda c: predicted_seconds_per_token(profile, c)) == 32
    ctrl = ChunkSizeController(ChunkControl(candidates=candidates, off=False))
    ctrl.set_profile(profile)

    # the machine is 1.3x slower than the model says, uniformly: the ranking holds, the level does not
    sizes = run(
        ctrl, lambda c: 1.3 * predicted_seconds_per_token(profile, c), 300, random.Random(0), noise=0.03
    )
    assert ctrl.incumbent == 32
    assert sizes[-100:].count(32) >= 75  # the rest are the periodic explorations of 16 and 64


def test_a_profile_set_before_the_first_step_plans_the_first_exploration():
    profile = u_shaped_profile()
    ctrl = ChunkSizeController(
        ChunkControl(candidates=(4, 8, 16, 32, 64), explore_top=3, off=False, warmup_steps=0)
    )
    ctrl.set_profile(profile)
    sizes = run(ctrl, lambda c: predicted_seconds_per_token(profile, c), 3, random.Random(6))
    assert sizes == ctrl.ranking()[:3] == [32, 16, 64]


def test_measured_step_times_overrule_the_cost_model():
    profile = u_shaped_profile()
    candidates = (4, 8, 16, 32, 64)

    def landscape(c):  # interference from 32 up that the profile missed: 16 is the real best
        return predicted_seconds_per_token(profile, c) * (1.4 if c >= 32 else 1.0)

    for seed in range(3):
        ctrl = ChunkSizeController(ChunkControl(candidates=candidates, off=False))
        ctrl.set_profile(profile)
        run(ctrl, landscape, 100, random.Random(seed), noise=0.03)
        assert ctrl.incumbent == 16


def test_local_search_without_a_profile_walks_to_a_best_candidate_at_the_edge():
    ctrl = ChunkSizeController(ChunkControl(candidates=(4, 8, 16, 32, 64), explore_period=5, off=False))
    landscape = {4: 5.0, 8: 3.0, 16: 2.0, 32: 1.5, 64: 1.2}
    sizes = run(ctrl, lambda c: landscape[c] * 1e-4, 120, random.Random(1), noise=0.02)
    assert ctrl.incumbent == 64
    assert 64 not in sizes[:3]  # the first exploration is around the middle; 64 was reached by descent


def test_reexplores_early_when_the_landscape_shifts():
    control = ChunkControl(candidates=(4, 8, 16, 32, 64), explore_period=50, off=False)
    ctrl = ChunkSizeController(control)
    rng = random.Random(2)
    before = {4: 3.0, 8: 2.0, 16: 1.0, 32: 2.0, 64: 3.0}
    run(ctrl, lambda c: before[c] * 1e-4, 60, rng, noise=0.02)
    assert ctrl.incumbent == 16 and not ctrl.exploring

    after = {4: 3.0, 8: 2.5, 16: 2.0, 32: 1.2, 64: 1.0}  # longer responses: large chunks pay now
    shifted_at = len(ctrl.history)
    first_exploration = None
    for step in range(shifted_at, shifted_at + 150):
        if ctrl.exploring and first_exploration is None:
            first_exploration = step
        run(ctrl, lambda c: after[c] * 1e-4, 1, rng, noise=0.02)
    # the incumbent's own steps reveal the shift: exploration within a drift window, not after 50 steps
    assert first_exploration is not None
    assert first_exploration - shifted_at <= 3 * control.min_samples
    assert ctrl.incumbent == 64


def test_noisy_equal_candidates_do_not_flip_flop():
    """Equal candidates (1% apart, 5% step-to-step noise): the noise rule keeps the incumbent.

    Without the rule (noise_sigmas=0, noise_floor=0) the same runs switch on every lucky step, so this
    test detects a controller that compares single noisy steps.
    """
    landscape = {4: 1.0, 8: 0.995, 16: 1.0, 32: 0.99, 64: 1.0}

    def count_switches(control, seed):
        ctrl = ChunkSizeController(control)
        rng = random.Random(seed)
        incumbents = []
        for _ in range(400):
            run(ctrl, lambda c: landscape[c] * 1e-4, 1, rng, noise=0.05)
            if ctrl.incumbent is not None:
                incumbents.append(ctrl.incumbent)
        return switches(incumbents)

    with_rule = [count_switches(ChunkControl(off=False), seed) for seed in range(5)]
    without_rule = [
        count_switches(ChunkControl(noise_sigmas=0.0, noise_floor=0.0, off=False), seed) for seed in range(5)
    ]
    assert sum(with_rule) <= 2, with_rule
    assert sum(without_rule) >= 20, without_rule


def test_a_difference_beyond_the_noise_switches():
    landscape = {4: 1.0, 8: 0.85, 16: 1.0, 32: 1.0, 64: 1.0}  # 15% better, 3% noise
    ctrl = ChunkSizeController(ChunkControl(candidates=(4, 8, 16, 32, 64), explore_period=10, off=False))
    run(ctrl, lambda c: landscape[c] * 1e-4, 80, random.Random(3), noise=0.03)
    assert ctrl.incumbent == 8


def test_explores_the_top_candidates_once_every_period():
    # noise-free, equal candidates: the schedule alone is visible
    ctrl = ChunkSizeController(
        ChunkControl(
            candidates=(4, 8, 16, 32, 64), explore_period=10, explore_top=3, off=False, warmup_steps=0
        )
    )
    sizes = run(ctrl, lambda c: 1e-4, 3 + 10 + 2 + 10 + 2, random.Random(4))
    # the first exploration is around the middle and keeps the smallest of the equals; each period then
    # tries the incumbent's two neighbours, one step each
    assert sizes[:3] == [16, 8, 32]
    assert ctrl.incumbent == 8
    assert sizes[3:13] == [8] * 10
    assert sizes[13:15] == [4, 16]
    assert sizes[15:25] == [8] * 10
    assert sizes[25:27] == [4, 16]


@settings(max_examples=200, deadline=None)
@given(
    times=st.lists(st.floats(0.1, 10.0), min_size=1, max_size=6),
    noise=st.floats(0.0, 0.3),
    use_profile=st.booleans(),
    period=st.integers(1, 8),
    top=st.integers(1, 6),
    seed=st.integers(0, 2**16),
    off=st.booleans(),
)
def test_only_measured_sizes_run_outside_exploration(times, noise, use_profile, period, top, seed, off):
    candidates = tuple(2 ** (i + 2) for i in range(len(times)))
    ctrl = ChunkSizeController(
        ChunkControl(
            candidates=candidates, explore_period=period, explore_top=min(top, len(candidates)), off=off
        )
    )
    if use_profile:
        ctrl.set_profile(make_profile())
    landscape = dict(zip(candidates, times, strict=True))
    landscape[OFF] = times[len(times) // 2]
    rng = random.Random(seed)
    measured = set()
    shift = 40
    for step in range(80):
        c = ctrl.chunk_size()
        assert c in candidates or (off and c == OFF)
        if not ctrl.exploring:
            assert c in measured, (step, c, measured)
        if ctrl.incumbent is not None:
            assert ctrl.incumbent in measured
        scale = 1.0 if step < shift else landscape[c]  # a landscape shift halfway
        seconds = landscape[c] * scale * 1e-4 * TOKENS * max(0.05, 1 + noise * rng.gauss(0, 1))
        ctrl.observe(c, seconds, TOKENS)
        measured.add(c)


def test_fixed_chunk_size_is_honoured_and_steps_still_recorded():
    ctrl = ChunkSizeController(ChunkControl(), fixed=12)
    run(ctrl, lambda c: 1e-4, 30, random.Random(5))
    assert {record.chunk_size for record in ctrl.history} == {12}
    assert len(ctrl.history) == 30 and ctrl.incumbent == 12 and not ctrl.exploring
    assert ctrl.history[0].seconds_per_token == pytest.approx(1e-4)


def test_steps_without_tokens_are_ignored():
    ctrl = ChunkSizeController(ChunkControl())
    first = ctrl.chunk_size()
    ctrl.observe(first, 0.5, 0)
    assert ctrl.history == [] and ctrl.chunk_size() == first


def test_history_holds_step_size_and_time_per_generated_token():
    ctrl = ChunkSizeController(ChunkControl())
    c = ctrl.chunk_size()
    ctrl.observe(c, 2.0, 500)
    assert ctrl.history == [(0, c, pytest.approx(0.004))]


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(candidates=()),
        dict(candidates=(8, 4)),
        dict(candidates=(4, 4, 8)),
        dict(candidates=(0, 4)),
        dict(candidates=(4.0, 8)),
        dict(explore_period=0),
        dict(explore_top=0),
        dict(explore_top=7),
        dict(explore_top=6, off=False),
        dict(min_samples=1),
        dict(noise_sigmas=-1.0),
        dict(noise_sigmas=float("nan")),
        dict(noise_floor=1.0),
        dict(noise_floor=-0.1),
        dict(noise_window=5),  # < 2 * min_samples
        dict(off=1),
        dict(hopeless_margin=-0.1),
        dict(hopeless_margin=float("inf")),
        dict(hopeless_every=0),
        dict(warmup_steps=-1),
    ],
)
def test_bad_chunk_control_raises_value_error(kwargs):
    with pytest.raises(ValueError, match="ChunkControl"):
        ChunkControl(**kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(handoff_s=-1.0),
        dict(prefill_s_per_token=float("inf")),
        dict(running_seqs=0.0),
        dict(tokens_per_step=0.0),
        dict(slowdown={0: 0.1}),
        dict(slowdown={8: -0.2}),
        dict(scored_tokens_per_step=-1.0),
    ],
)
def test_bad_switch_profile_raises_value_error(kwargs):
    with pytest.raises(ValueError, match="SwitchProfile"):
        make_profile(**kwargs)


@pytest.mark.parametrize(
    "args",
    [(0, 1.0, 10), (8, -1.0, 10), (8, float("nan"), 10), (8, 1.0, -1), ("on", 1.0, 10), (None, 1.0, 10)],
)
def test_bad_observation_raises_value_error(args):
    with pytest.raises(ValueError):
        ChunkSizeController(ChunkControl()).observe(*args)


@pytest.mark.parametrize("fixed", [0, -4, 2.5, True])
def test_bad_fixed_chunk_size_raises_value_error(fixed):
    with pytest.raises(ValueError, match="fixed"):
        ChunkSizeController(ChunkControl(), fixed=fixed)


def test_control_package_imports_no_torch():
    root = Path(__file__).resolve().parents[1]
    code = "import sys, oppo_engine.control; assert 'torch' not in sys.modules, 'torch was imported'"
    subprocess.run([sys.executable, "-c", code], cwd=root, check=True)
