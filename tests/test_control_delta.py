"""DeltaController on synthetic reward curves: rising, plateau, noisy, outliers (no torch)."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oppo_engine.control import DeltaControl, DeltaController, fit_slope


def explicit(**kwargs) -> DeltaControl:
    """The controller's settings with explicit init/max (the engine resolves the None defaults from B)."""
    return DeltaControl(**{"init": 16, "max": 64, **kwargs})


def trajectory(rewards, control=None, **kwargs):
    """Δ after each reward is fed."""
    ctrl = DeltaController(control if control is not None else explicit(**kwargs))
    deltas = []
    for reward in rewards:
        ctrl.observe_reward(reward)
        deltas.append(ctrl.delta())
    return deltas


def steps(deltas, init):
    return [b - a for a, b in zip([init, *deltas], deltas, strict=False)]


def test_fit_slope_is_the_least_squares_slope_with_its_standard_error():
    assert fit_slope([1.0, 3.0, 5.0, 7.0]) == (pytest.approx(2.0), pytest.approx(0.0, abs=1e-12))
    # y = (0, 0, 0, 0, 1): slope 0.2, residual SS 0.4 on 3 dof, Sxx 10 -> se = sqrt(0.4 / 3 / 10)
    slope, stderr = fit_slope([0.0, 0.0, 0.0, 0.0, 1.0])
    assert slope == pytest.approx(0.2)
    assert stderr == pytest.approx((0.4 / 3 / 10) ** 0.5)
    assert fit_slope([2.0, 1.0]) == (pytest.approx(-1.0), 0.0)


def test_rising_reward_grows_delta_gradually_to_max():
    control = explicit(init=16, max=64, inc=4, window=5)
    deltas = trajectory([0.1 * t for t in range(25)], control)
    assert deltas[:4] == [16] * 4  # nothing moves before the window is full
    assert all(step == 4 for step in steps(deltas, 16)[4:16])
    assert deltas[15:] == [64] * 10


def test_reward_plateau_shrinks_delta_to_min():
    deltas = trajectory([2.0] * 20, explicit(init=16, min=0, dec=4, window=5))
    assert deltas[:4] == [16] * 4
    assert deltas[4:8] == [12, 8, 4, 0]
    assert deltas[8:] == [0] * 12


def test_overcommit_switches_itself_off_when_reward_converges():
    rewards = [0.1 * t for t in range(20)] + [2.0] * 30  # learning, then converged
    deltas = trajectory(rewards, explicit(init=16, min=0, max=64, inc=4, dec=4, window=5))
    assert max(deltas[:20]) == 64
    assert deltas[-10:] == [0] * 10
    assert all(abs(step) <= 4 for step in steps(deltas, 16))


def test_noisy_flat_reward_keeps_delta_bounded_and_mostly_off():
    control = explicit(init=16, min=0, max=64, inc=4, dec=4, window=5)
    for seed in range(5):
        rng = random.Random(seed)
        deltas = trajectory([1.0 + 0.1 * rng.gauss(0.0, 1.0) for _ in range(200)], control)
        assert all(0 <= d <= 64 for d in deltas)
        assert all(abs(step) <= 4 for step in steps(deltas, 16))
        # a rise must stand out of the noise to grow Δ: on a flat curve it stays near min
        assert sum(deltas[50:]) / len(deltas[50:]) <= 4, deltas


def test_noisy_rising_reward_still_grows_delta():
    for seed in range(5):
        rng = random.Random(seed)
        deltas = trajectory([0.05 * t + 0.05 * rng.gauss(0.0, 1.0) for t in range(40)], explicit())
        assert max(deltas) == 64 and deltas[-1] >= 56, deltas


def test_one_outlier_moves_delta_one_bounded_step_at_a_time_and_only_while_in_the_window():
    control = explicit(init=32, min=0, max=64, inc=4, dec=4, window=5)
    for clean, at, value in (
        ([1.0] * 40, 12, 50.0),  # a spike on a plateau
        ([0.1 * t for t in range(40)], 15, -100.0),  # a collapse during learning
    ):
        noisy = list(clean)
        noisy[at] = value
        clean_path, noisy_path = trajectory(clean, control), trajectory(noisy, control)
        assert all(abs(step) <= 4 for step in steps(noisy_path, 32))
        gap = [abs(a - b) for a, b in zip(clean_path, noisy_path, strict=True)]
        assert max(gap) <= control.window * 4
        leaves_window = at + control.window
        recovered = leaves_window + max(gap) // 4
        assert noisy_path[recovered:] == clean_path[recovered:]


def test_significance_zero_is_the_papers_literal_positive_slope_rule():
    rewards = [1.0 + 1e-6 * t + (1e-3 if t % 2 else 0.0) for t in range(12)]  # tiny rise under a zig-zag
    literal = trajectory(rewards, explicit(init=16, significance=0.0))
    tested = trajectory(rewards, explicit(init=16, significance=1.0))
    slopes = [fit_slope(rewards[t - 4 : t + 1])[0] for t in range(4, 12)]
    assert literal[4:] == [16 + sum(4 if s > 0 else -4 for s in slopes[: i + 1]) for i in range(8)]
    assert tested[-1] < literal[-1]


def test_alg1_steps_by_a_quarter_of_delta_at_least_one():
    rising = trajectory([0.1 * t for t in range(12)], explicit(init=16, max=64, rule="alg1"))
    assert rising[3:] == [16, 20, 25, 31, 38, 47, 58, 64, 64]
    falling = trajectory([1.0] * 22, explicit(init=64, min=0, rule="alg1"))
    assert falling[3:] == [64, 48, 36, 27, 21, 16, 12, 9, 7, 6, 5, 4, 3, 2, 1, 0, 0, 0, 0]
    from_zero = trajectory([0.1 * t for t in range(14)], explicit(init=0, max=64, rule="alg1"))
    assert from_zero[3:] == [0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 12]


@settings(max_examples=300, deadline=None)
@given(
    rewards=st.lists(st.floats(-1e3, 1e3, allow_nan=False), min_size=1, max_size=60),
    bounds=st.tuples(st.integers(0, 40), st.integers(0, 40), st.integers(0, 40)).map(sorted),
    inc=st.integers(0, 10),
    dec=st.integers(0, 10),
    window=st.integers(3, 8),
    rule=st.sampled_from(["slope", "alg1"]),
    significance=st.floats(0.0, 3.0),
)
def test_delta_stays_in_bounds_and_moves_one_bounded_step(
    rewards, bounds, inc, dec, window, rule, significance
):
    low, init, high = bounds
    control = explicit(
        init=init, min=low, max=high, inc=inc, dec=dec, window=window, rule=rule, significance=significance
    )
    deltas = trajectory(rewards, control)
    previous = init
    for i, delta in enumerate(deltas):
        assert low <= delta <= high
        if i < window - 1:
            assert delta == init
        if rule == "alg1":
            assert abs(delta - previous) <= max(1, previous // 4)
        else:
            assert -dec <= delta - previous <= inc
        previous = delta


def test_fixed_delta_is_honoured_and_rewards_still_recorded():
    ctrl = DeltaController(explicit(), fixed=7)
    for t in range(10):
        ctrl.observe_reward(0.1 * t)
        assert ctrl.delta() == 7
    assert [record.reward for record in ctrl.history] == pytest.approx([0.1 * t for t in range(10)])
    assert [record.delta for record in ctrl.history] == [7] * 10


def test_history_records_reward_slope_and_chosen_delta():
    ctrl = DeltaController(explicit(window=3))
    for reward in (0.0, 1.0, 2.0):
        ctrl.observe_reward(reward)
    assert ctrl.history[:2] == [(0, 0.0, None, 16), (1, 1.0, None, 16)]
    assert ctrl.history[2] == (2, 2.0, pytest.approx(1.0), 20)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(init=-1),
        dict(min=-1),
        dict(min=10, max=5, init=7),
        dict(init=70, max=64),
        dict(init=2, min=4),
        dict(inc=-1),
        dict(dec=1.5),
        dict(window=2),  # needs 3 for a standard error when significance > 0
        dict(window=1, significance=0.0),
        dict(rule="pid"),
        dict(significance=-1.0),
        dict(significance=float("inf")),
        dict(init=True),
    ],
)
def test_bad_delta_control_raises_value_error(kwargs):
    with pytest.raises(ValueError, match="DeltaControl"):
        DeltaControl(**kwargs)


def test_window_of_two_is_allowed_with_the_literal_rule():
    assert trajectory([0.0, 1.0, 2.0], explicit(window=2, significance=0.0)) == [16, 20, 24]


@pytest.mark.parametrize("reward", [float("nan"), float("inf"), None, "1.0"])
def test_non_finite_or_non_numeric_reward_raises_value_error(reward):
    with pytest.raises(ValueError, match="reward"):
        DeltaController(explicit()).observe_reward(reward)


@pytest.mark.parametrize("fixed", [-1, 2.0, True])
def test_bad_fixed_delta_raises_value_error(fixed):
    with pytest.raises(ValueError, match="fixed"):
        DeltaController(explicit(), fixed=fixed)
