"""What the chunk controller decides on a fresh machine (no calibrated profile, no prior): its first step
runs "off" and the profiler times a decode and the scorers' prefill from that step's own work; the
profile then says whether streaming is worth a step at all. With no slowdown known, the cost model's
price of a chunk size is the least it can ever predict for it, so a chunk size that even then does not
beat "off" by the noise floor is futile: explored only as a hopeless arm. Fake clock, exact numbers."""

import pytest

from oppo_engine.control import OFF, ChunkControl, ChunkSizeController, SwitchProfile

SIZES = (4, 8, 16, 32, 64)


def first_step_profile(handoff_s: float, prefill_s_per_token: float, **overrides) -> SwitchProfile:
    """What the profiler reports after one unstreamed step: 8 sequences, 800 tokens (100 decode iterations
    of 1 ms), 1,000 tokens scored; no slowdown and no tail measured (nothing streamed)."""
    values = dict(
        handoff_s=handoff_s,
        prefill_s_per_token=prefill_s_per_token,
        decode_iter_s=1e-3,
        slowdown={},
        running_seqs=8.0,
        tail_seqs=0.0,
        tokens_per_step=800.0,
        scored_tokens_per_step=1000.0,
    )
    values.update(overrides)
    return SwitchProfile(**values)


# Scoring 1,000 tokens at 2e-5 s each is 0.02 s exposed after a 0.1 s decode; a hand-off costs 10 ms.
SWITCHES = first_step_profile(handoff_s=0.01, prefill_s_per_token=2e-5)
# A 1 ms hand-off, and 1,000 tokens at 2e-4 s each: 0.2 s of scoring to hide behind a 0.1 s decode.
CHEAP = first_step_profile(handoff_s=1e-3, prefill_s_per_token=2e-4)
# A 50 ms hand-off and 0.02 s of scoring: no chunk size can pay for its hand-offs.
EXPENSIVE = first_step_profile(handoff_s=0.05, prefill_s_per_token=2e-5)


def test_a_chunk_size_is_futile_exactly_when_its_least_cost_misses_off_by_the_floor():
    # By hand: off = (0.1 s decode + 0.02 s scoring) / 800 tokens; a chunk size C at least (0.1 s decode +
    # 100 / C hand-offs of 0.01 s) / 800. Futile: that least cost >= off * (1 - noise_floor 0.02).
    ctrl = ChunkSizeController(ChunkControl())
    ctrl.set_profile(SWITCHES)
    limit = (0.1 + 0.02) / 800 * (1 - 0.02)
    least = {c: (0.1 + 100 / c * 0.01) / 800 for c in SIZES}
    assert [c for c in SIZES if least[c] >= limit] == [4, 8, 16, 32]  # 64: 0.1156 s < 0.1176 s
    assert ctrl.futile() == [4, 8, 16, 32]
    assert set(ctrl.futile()) <= set(ctrl.hopeless())
    ctrl.set_profile(first_step_profile(0.01, 2e-5, scored_tokens_per_step=850.0))
    assert ctrl.futile() == list(SIZES)  # 850 tokens scored: off 0.117 s, limit 0.1147 s <= 0.1156 s


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


def test_cheap_prefill_beside_decode_is_explored():
    assert ChunkSizeController(ChunkControl()).ranking()[0] == OFF  # the first step runs "off"
    arms = first_arms(CHEAP, 4)
    assert arms[0] == OFF and any(a in SIZES for a in arms[1:]), arms


def test_an_expensive_switch_is_not_explored_but_every_hopeless_every_th_exploration():
    control = ChunkControl(explore_period=10, hopeless_every=4)
    ctrl = ChunkSizeController(control)
    ctrl.set_profile(EXPENSIVE)
    assert ctrl.futile() == list(SIZES)
    arms = first_arms(EXPENSIVE, 60, control)
    first_streamed = next(i for i, a in enumerate(arms) if a != OFF)
    # explorations 2 and 3 (after 10 steps each on "off") have nothing worth a step; the 4th tries the most
    # promising futile chunk size once (measurements can overrule the model), which loses the tie to "off"
    assert first_streamed >= 30, arms
    assert sum(a != OFF for a in arms) == 1, arms


def test_a_measured_tail_does_not_make_a_chunk_size_futile():
    """A streamed step that measured no slowdown (every actor iteration had a prefill beside it, say) may
    have measured a tail; the bound leaves it out, as it leaves out the slowdown."""
    ctrl = ChunkSizeController(ChunkControl())
    ctrl.set_profile(first_step_profile(0.01, 2e-5, tail_seqs=8.0))
    assert ctrl.futile() == [4, 8, 16, 32]  # as with no tail: 64 is not futile


@pytest.mark.parametrize(
    "control, profile",
    [
        (ChunkControl(), first_step_profile(0.05, 2e-5, slowdown={16: 0.0})),  # a slowdown is known
        (ChunkControl(prior="list"), EXPENSIVE),  # the candidate list, not the model, starts the search
        (ChunkControl(off=False), EXPENSIVE),  # no "off" to lose to
    ],
)
def test_nothing_is_futile_once_a_slowdown_is_known_under_prior_list_or_without_off(control, profile):
    ctrl = ChunkSizeController(control)
    ctrl.set_profile(profile)
    assert ctrl.futile() == []
