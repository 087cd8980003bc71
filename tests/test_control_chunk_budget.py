"""The chunk controller's exploration budget (``ChunkControl.explore_budget``): exploration steps may cost,
beyond the incumbent, at most that fraction of the run's time so far plus one step's misestimate, whatever
the run's length. So a short run on a machine where streaming costs (this CPU) does not stream at all, a
long one still explores, and an arm the cost model predicts to pay is explored at once. Fake clock, exact
numbers, no noise unless stated."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oppo_engine.control import OFF, ChunkControl, ChunkSizeController, SwitchProfile
from oppo_engine.control.chunk import predicted_seconds_per_token

SIZES = (4, 8, 16, 32, 64)
TOKENS = 1000


def first_step(scoring_s: float = 0.2) -> SwitchProfile:
    """What the profiler reports after one unstreamed step (as in test_control_chunk_futile): 100 decode
    iterations of 1 ms, then ``scoring_s`` of scoring; no hand-off line, no slowdown, no tail."""
    return SwitchProfile(
        handoff_s=0.0,
        prefill_s_per_token=scoring_s / 1000,
        decode_iter_s=1e-3,
        slowdown={},
        running_seqs=8.0,
        tail_seqs=0.0,
        tokens_per_step=800.0,
        scored_tokens_per_step=1000.0,
        scoring_s=scoring_s,
    )


# Streaming pays: a 3% slowdown hides 1.5 s of scoring behind a 0.26 s decode (test_control_chunk_off).
PAYS = SwitchProfile(
    handoff_s=1e-3,
    prefill_s_per_token=1e-4,
    decode_iter_s=1e-3,
    slowdown={4: 0.03, 64: 0.03},
    running_seqs=32.0,
    tail_seqs=4.0,
    tokens_per_step=8192.0,
    scored_tokens_per_step=15000.0,
)


def run(ctrl, landscape, steps, profile=None):
    """``steps`` steps: arm a takes ``landscape[a]`` seconds (TOKENS tokens); ``profile`` arrives after the
    first step, as the profiler's after a fresh machine's first (unstreamed) step."""
    arms = []
    for k in range(steps):
        arm = ctrl.chunk_size()
        ctrl.observe(arm, landscape[arm], TOKENS)
        arms.append(arm)
        if k == 0 and profile is not None:
            ctrl.set_profile(profile)
    return arms


COSTLY = {OFF: 1.0, 4: 1.5, 8: 1.4, 16: 1.35, 32: 1.4, 64: 1.45}  # this CPU: every streamed step is slower


def test_a_short_run_where_nothing_predicts_streaming_does_not_stream():
    """The held-out drain's case: a fresh machine, the first step's scoring long enough to explore (nothing
    futile), no slowdown known. A streamed step whose cost nothing predicts is taken at ``hopeless_margin``
    (a quarter) of a step; 3% of the run covers that after 0.25 / 0.03 = 8.33 steps of equal length, so
    the first streamed step is the 10th (after 9 observed), and a run of 9 steps never streams."""
    ctrl = ChunkSizeController(ChunkControl())
    arms = run(ctrl, COSTLY, 12, first_step())
    assert ctrl.futile() == []  # the bound alone would explore at once
    assert arms[:9] == [OFF] * 9, arms
    assert arms[9] in SIZES, arms
    # That step overdraws the account (0.35 or more of a step against 3% of 10): the next two run "off",
    # and what was charged is exactly that one step's excess.
    assert arms[10:] == [OFF, OFF], arms
    assert ctrl.spent == pytest.approx(COSTLY[arms[9]] - 1.0)


def test_without_a_budget_the_same_run_streams_at_once():
    arms = run(ChunkSizeController(ChunkControl(explore_budget=None)), COSTLY, 12, first_step())
    assert arms[0] == OFF and arms[1] in SIZES, arms


def test_an_arm_predicted_to_pay_is_explored_at_once_and_kept():
    """A cost model that predicts streaming pays (the prior on a GPU, or a measured slowdown) makes the
    streamed arms' expected cost negative: the budget defers nothing, and "off", which that model calls
    hopeless, does not run. The first exploration's steps are charged against the arm it adopts."""
    pays = {OFF: 1.0, 4: 0.75, 8: 0.6, 16: 0.5, 32: 0.55, 64: 0.7}
    ctrl = ChunkSizeController(ChunkControl())
    ctrl.set_prior(PAYS)
    assert ctrl.expected_excess(16) < 0
    arms = run(ctrl, pays, 4)  # the warm-up step, then the predicted best and its neighbours
    assert sorted(arms[1:]) == [16, 32, 64], arms
    assert ctrl.incumbent == 16
    assert ctrl.spent == pytest.approx(sum(pays[a] - pays[16] for a in arms[1:]))
    arms += run(ctrl, pays, 40)
    assert ctrl.incumbent == 16 and arms[-10:] == [16] * 10


# A prior under which 16 pays a little and its neighbours cost a little (predicted seconds per token:
# "off" 3.74e-5, 16 3.40e-5, 8 4.18e-5, 32 4.00e-5): the steps below are timed exactly as it predicts.
NARROW = SwitchProfile(
    handoff_s=1e-3,
    prefill_s_per_token=1e-4,
    decode_iter_s=1e-3,
    slowdown={4: 2.0, 8: 0.2, 16: 0.0, 32: 0.2, 64: 2.0},
    running_seqs=32.0,
    tail_seqs=4.0,
    tokens_per_step=8192.0,
    scored_tokens_per_step=500.0,
)


def _predicted_run(budget, steps):
    ctrl = ChunkSizeController(ChunkControl(explore_budget=budget))
    ctrl.set_prior(NARROW)
    landscape = {a: predicted_seconds_per_token(NARROW, a) * TOKENS for a in (OFF, *SIZES)}
    return run(ctrl, landscape, steps), ctrl


def test_with_the_prior_the_first_exploration_is_as_without_a_budget():
    """16 measured and predicted to pay must not wait behind "off": once "off" is measured the steps run
    before it are priced (16 cost nothing), so 32's small predicted cost is affordable at once. Before the
    fix the budgeted run went 16, 16, off, off, off, 32; the unbudgeted one goes 16, 16, off, 32."""
    budgeted, _ = _predicted_run(0.03, 8)
    unbudgeted, _ = _predicted_run(None, 8)
    assert unbudgeted[:4] == [16, 16, OFF, 32]
    assert budgeted[:4] == unbudgeted[:4], budgeted


def test_when_the_rest_of_the_first_exploration_is_unaffordable_what_was_measured_decides():
    """No budget at all: after "off" nothing more is affordable. An arm measured to pay is not deferred
    behind "off": the decision runs on what was measured and its confirming steps follow at once."""
    arms, ctrl = _predicted_run(0.0, 8)
    assert arms[:3] == [16, 16, OFF]
    assert arms[3:6] == [16, 16, 16], arms
    assert ctrl.incumbent == 16


def test_after_a_switch_the_measured_excesses_are_relative_to_the_new_incumbent():
    """The excesses an exploration measured were against the old incumbent ("off"); after 16 replaces
    it they are against 16, so the budget's next estimates price the right difference."""
    landscape = {OFF: 1.0, 4: 0.9, 8: 0.8, 16: 0.6, 32: 0.7, 64: 0.95}
    ctrl = ChunkSizeController(ChunkControl(explore_budget=None, prior="list"))
    arms = run(ctrl, landscape, 12)
    assert ctrl.incumbent == 16 and 8 in arms, arms
    for arm in (8, OFF):
        assert ctrl.expected_excess(arm) == pytest.approx(landscape[arm] / landscape[16] - 1.0)


def test_the_first_streamed_arm_of_an_uninformed_model_is_the_middle_candidate():
    """With no hand-off, tail or slowdown known every chunk size costs the decode alone: the model ties
    them, and ties rank as without a model (the middle candidate, then its neighbours), not smallest
    first (which made the first streamed step always 4)."""
    ctrl = ChunkSizeController(ChunkControl(explore_budget=None))
    ctrl.set_profile(first_step())
    assert [a for a in ctrl.ranking() if a != OFF] == [16, 8, 32, 4, 64]
    assert run(ChunkSizeController(ChunkControl(explore_budget=None)), COSTLY, 2, first_step())[1] == 16


def test_a_long_run_still_explores():
    ctrl = ChunkSizeController(ChunkControl())
    arms = run(ctrl, COSTLY, 300, first_step())
    streamed = sum(a != OFF for a in arms)
    assert ctrl.incumbent == OFF
    assert 3 <= streamed <= math.floor((0.03 * 300 + 0.5) / 0.35), arms  # each costs >= 0.35 of a step


@settings(max_examples=120, deadline=None)
@given(
    slower=st.lists(st.floats(1.05, 3.0), min_size=5, max_size=5),
    budget=st.sampled_from([0.0, 0.01, 0.03, 0.1]),
    profile=st.sampled_from(["none", "first_step", "list"]),
    lengths=st.lists(st.floats(0.2, 5.0), min_size=1, max_size=7),
)
def test_exploration_costs_at_most_the_budget_plus_one_step(slower, budget, profile, lengths):
    """Every arm is slower than "off" by its factor; steps vary in length (``lengths`` cycled, as a drain's
    batches do). After every step, what the controller charged its exploration steps (each step's seconds
    beyond the incumbent's mean time per token) is at most ``explore_budget`` of the time so far plus the
    largest single charge. With steps of one length the charge is exactly the seconds the streamed steps
    cost beyond "off"."""
    control = ChunkControl(explore_budget=budget, prior="list" if profile == "list" else "model")
    ctrl = ChunkSizeController(control)
    factor = dict(zip(SIZES, slower, strict=True))
    excess = elapsed = worst = 0.0
    for k in range(150):
        arm = ctrl.chunk_size()
        base = lengths[k % len(lengths)]
        seconds = base if arm == OFF else base * factor[arm]
        before = ctrl.spent
        ctrl.observe(arm, seconds, TOKENS)
        if k == 0 and profile != "none":
            ctrl.set_profile(first_step())
        excess += seconds - base
        worst = max(worst, ctrl.spent - before)
        elapsed += seconds
        assert ctrl.elapsed == pytest.approx(elapsed)
        assert ctrl.spent <= budget * elapsed + worst + 1e-9, (k, ctrl.spent, elapsed, worst)
        if len(lengths) == 1:
            assert ctrl.spent == pytest.approx(excess, abs=1e-9)
    if budget == 0.0:
        assert excess == 0.0  # nothing is free to explore: nothing streams


def test_prior_is_still_the_twelfth_positional_field_and_the_budget_comes_after_it():
    """``explore_budget`` was added after ``prior``: a positional ``prior`` still lands in ``prior``."""
    control = ChunkControl((4, 8, 16), 10, 3, 3, 2.0, 0.02, 20, True, 0.25, 4, 1, "list")
    assert control.prior == "list" and control.explore_budget == 0.03
    assert (
        ChunkControl((4, 8, 16), 10, 3, 3, 2.0, 0.02, 20, True, 0.25, 4, 1, "list", None).explore_budget
        is None
    )


@pytest.mark.parametrize("budget", [-0.01, 1.5, math.nan, True, "0.03"])
def test_bad_budget_raises_value_error(budget):
    with pytest.raises(ValueError, match="explore_budget"):
        ChunkControl(explore_budget=budget)
