"""The chunk controller's "off" arm in the engine: a step it does not stream runs no scorer work while the
actor decodes, so ``intra`` is then exactly ``sequential`` and ``oppo`` exactly ``inter``; switching
between "off" and streaming from step to step (carried sequences the scorers streamed before an "off"
step included) changes no number and leaks no page."""

from __future__ import annotations

import pytest
from engine_models import make_actor, make_reward, random_prompts
from test_intra import assert_same_rollouts, make_engine
from test_ppo_scorers import make_critic, make_reference

from oppo_engine import SamplingParams
from oppo_engine.control import OFF, ChunkControl
from oppo_engine.sched.sequence import SeqStatus


@pytest.fixture(scope="module")
def models():
    return dict(actor=make_actor(), reward=make_reward(), reference=make_reference(), critic=make_critic())


class ScriptedArms:
    """Stands in for the chunk controller: the arms of successive steps, cycled (the loop is under test)."""

    def __init__(self, arms):
        self.arms, self.step, self.history = list(arms), 0, []

    def chunk_size(self):
        return self.arms[self.step % len(self.arms)]

    def observe(self, arm, seconds, tokens):
        assert arm == self.chunk_size()
        self.history.append(arm)
        self.step += 1

    def set_profile(self, profile):
        pass


def _overlaps(a, b) -> bool:
    return a.start_s < b.end_s and b.start_s < a.end_s


def long_tailed(n: int, seed: int):
    """Prompts with requested lengths from 3 to 40 tokens (the test actor never says EOS): under overcommit
    the long ones are carried unfinished, their prefix streamed."""
    prompts = random_prompts(n, seed=seed)
    lengths = [3 + (7 * i) % 11 if i % 4 else 40 for i in range(n)]
    return prompts, [SamplingParams(temperature=1.0, max_new_tokens=n) for n in lengths]


def run_recording(engine, prompts, sampling):
    """Every step to exhaustion; per step its arm, the unfinished sequences it carried that the scorers know
    (streamed), and whether a scorer forward overlapped an actor forward."""
    engine.add_prompts(prompts, sampling)
    rollouts, steps = [], []
    while True:
        result = engine.step()
        if not result.rollouts:
            break
        rollouts.extend(result.rollouts)
        spans = engine.timeline.spans()
        actor = [s for s in spans if s.lane == "actor"]
        scorer = [s for s in spans if s.lane != "actor" and s.name == "prefill"]
        overlap = any(_overlaps(a, s) for a in actor for s in scorer)
        lane = engine._loop.scorer_lane
        streamed_unfinished = sum(
            lane.knows(s) and s.status not in (SeqStatus.FINISHED, SeqStatus.SCORED)
            for s in engine._buffer.carried
        )
        steps.append((result.metrics.chunk_size, streamed_unfinished, overlap))
    return sorted(rollouts, key=lambda r: prompts.index(r.prompt_ids)), steps


@pytest.mark.parametrize(
    ("mode", "base", "cfg"),
    [
        ("intra", "sequential", {}),
        ("oppo", "inter", {"overcommit": 4}),
        ("oppo", "sequential", {"overcommit": 6}),
    ],
)
def test_off_steps_run_no_scorer_work_beside_the_actor_and_change_no_number(models, mode, base, cfg):
    prompts, sampling = long_tailed(22, seed=5)
    want, _ = run_recording(
        make_engine(models, base, **({} if base == "sequential" else cfg)), prompts, sampling
    )
    engine = make_engine(models, mode, **cfg)
    # off after a streamed step: sequences streamed in one step and carried into an "off" one
    engine._chunk_control = ScriptedArms([4, OFF, OFF, 2, OFF])
    got, steps = run_recording(engine, prompts, sampling)
    assert_same_rollouts(got, want)
    arms = [arm for arm, _, _ in steps]
    assert OFF in arms and 4 in arms
    assert not any(overlap for arm, _, overlap in steps if arm == OFF)
    if mode == "oppo":
        # some "off" step took over unfinished sequences streamed (and carried) by the step before
        assert any(
            arm == OFF and prev_arm != OFF and carried
            for (prev_arm, carried, _), (arm, _, _) in zip(steps, steps[1:], strict=False)
        ), steps
    stats = engine.cache_stats()
    assert stats.free_pages == stats.total_pages  # everything scored and returned: no page leaked
    engine.close()


def test_chunk_size_metric_is_off_for_a_step_the_controller_did_not_stream(models):
    # nothing hopeless or futile, no budget: the first exploration measures "off" and both sizes, whatever
    # the profile says
    control = ChunkControl(candidates=(4, 8), hopeless_margin=1e9, prior="list", explore_budget=None)
    engine = make_engine(models, "intra", chunk=control)
    engine.add_prompts(random_prompts(30, seed=1))
    metrics = [engine.step().metrics for _ in range(5)]
    arms = [m.chunk_size for m in metrics]
    assert arms[0] == OFF and OFF in arms[1:] and {4, 8} <= set(arms)
    for m in metrics:
        if m.chunk_size == OFF:
            assert m.handoffs == m.rollouts  # one final hand-off per sequence, after the actor
        else:
            assert m.handoffs > m.rollouts  # prompt, chunks and the final one
    assert [r.chunk_size for r in engine.chunk_history] == arms
    engine.close()


def test_sequential_and_inter_report_no_chunk_size(models):
    for mode in ("sequential", "inter"):
        engine = make_engine(models, mode)
        engine.add_prompts(random_prompts(6, seed=2))
        assert engine.step().metrics.chunk_size is None
        engine.close()


@pytest.mark.parametrize("noise_floor, futile", [(0.0, False), (0.9, True)])
def test_a_fresh_engine_decides_whether_to_stream_from_its_first_steps_profile(
    models, monkeypatch, tmp_path, noise_floor, futile
):
    """No calibrated profile and no table GPU (a fresh machine): no prior; the first step runs "off", its
    profile reaches the controller: the scorers' busy time ``T`` of that step, and no hand-off/per-token
    line (each scorer ran one whole-batch forward: one token count). Every chunk size is futile exactly
    when ``T <= noise_floor * (N*d + T)``: never at a floor of 0 (the scorers did work), and at 0.9 unless
    the scoring took over 9 times the decode (14 decode iterations against one forward per scorer)."""
    monkeypatch.setenv("OPPO_ENGINE_PROFILES", str(tmp_path))  # where no profile was ever written
    # explore_budget=None: what the bound decides, the budget aside (test_a_fresh_engine_streams_no_step...)
    chunk = ChunkControl(noise_floor=noise_floor, explore_budget=None)
    engine = make_engine(models, "oppo", batch_size=4, chunk=chunk)
    ctrl = engine._chunk_control
    assert ctrl.prior is None and ctrl.model() is None
    engine.add_prompts(random_prompts(40, seed=5))
    assert engine.step().metrics.chunk_size == OFF
    profile = ctrl.model()
    assert profile is not None and profile.slowdown == {}
    assert profile.scoring_s > 0 and profile.handoff_s == 0.0  # no line through one token count
    assert profile.prefill_s_per_token == pytest.approx(profile.scoring_s / profile.scored_tokens_per_step)
    decode = profile.tokens_per_step / profile.running_seqs * profile.decode_iter_s
    assert (profile.scoring_s <= noise_floor * (decode + profile.scoring_s)) == futile, (profile, decode)
    if futile:
        assert ctrl.futile() == list(ChunkControl().candidates)
        arms = [engine.step().metrics.chunk_size for _ in range(5)]
        assert arms == [OFF] * 5, arms  # the first exploration is "off" alone, then the incumbent "off"
    else:
        assert ctrl.futile() == []
        hopeful = [a for a in ctrl.ranking() if a not in ctrl.hopeless()]
        assert ctrl.chunk_size() in hopeful[: ChunkControl().explore_top] and ctrl.chunk_size() != OFF
    engine.close()


def test_a_fresh_engine_streams_no_step_before_the_budget_covers_one(models, monkeypatch, tmp_path):
    """A fresh machine (no prior) and nothing streamed yet: a streamed step's cost is taken at
    ``hopeless_margin`` of the mean step, and the budget covers it once ``explore_budget`` of the run's
    time does: ``0.25 * E / n <= 0.03 * E`` first at ``n = 9`` steps, whatever the steps took. The 9 steps
    before run "off" -- ``inter`` exactly; the 10th may stream."""
    monkeypatch.setenv("OPPO_ENGINE_PROFILES", str(tmp_path))  # where no profile was ever written
    engine = make_engine(models, "oppo", batch_size=4, chunk=ChunkControl(noise_floor=0.0))
    engine.add_prompts(random_prompts(48, seed=6))
    arms = [engine.step().metrics.chunk_size for _ in range(9)]
    ctrl = engine._chunk_control
    assert arms == [OFF] * 9 and ctrl.spent == 0.0, arms
    assert ctrl.futile() == [] and all(ctrl.expected_excess(c) == 0.25 for c in ChunkControl().candidates)
    engine.close()
