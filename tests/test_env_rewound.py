"""An environment's ``rewound`` hook (``Env`` protocol) that raises: its sequence starts over from its prompt
with a fresh environment (a warning names it), the rollback of the step goes on for every other sequence,
nothing is lost and no page leaks."""

import contextlib

import pytest
from engine_models import EOS, make_actor, make_reward, random_prompts
from envs import EnvLog, ScriptedEnv

from oppo_engine import EngineConfig, RolloutEngine, SamplingParams


class _Listening(ScriptedEnv):
    """A scripted environment that listens to the forwards and whose ``rewound`` raises."""

    rewinds = 0

    def decoded(self, response_ids, logprobs, turn_start):
        pass

    def rewound(self, num_response):
        type(self).rewinds += 1
        raise AttributeError("a bug in the environment's rewound")


def test_an_environment_whose_rewound_raises_restarts_its_sequence_and_the_rollback_goes_on():
    log = EnvLog()
    engine = RolloutEngine(
        actor=make_actor(), reward=make_reward(),
        config=EngineConfig(batch_size=4, mode="sequential", page_size=8, max_model_len=64),
        sampling=SamplingParams(temperature=1.0, max_new_tokens=10, seed=7),
        eos_token_id=EOS, env=lambda: _Listening(log, max_latency_s=0.0),
    )  # fmt: skip
    try:
        prompts = random_prompts(4, seed=41)
        engine.add_prompts(prompts)
        forward, calls = engine._loop.actor.forward, [0]

        def fails_once(chunks, specs):  # one transient actor failure: the step is rolled back and retried
            calls[0] += 1
            if calls[0] == 4:
                raise RuntimeError("transient actor failure")
            return forward(chunks, specs)

        engine._loop.actor.forward = fails_once
        back, failed, errors = [], [], []
        for _ in range(6):
            with pytest.warns(RuntimeWarning, match="rewound") if calls[0] < 4 else contextlib.nullcontext():
                result = engine.step()
            back += [tuple(r.prompt_ids) for r in result.rollouts]
            failed += [tuple(f.prompt_ids) for f in result.failed]
            errors += [f.error for f in result.failed]
            if not result.rollouts and not result.failed:
                break
        assert _Listening.rewinds > 0  # the hook ran and raised
        assert sorted(back + failed) == sorted(
            map(tuple, prompts)
        )  # every prompt once, as a rollout or failed
        assert not failed, errors  # restarted, not failed
        stats = engine.cache_stats()
        assert stats.free_pages == stats.total_pages  # no page held
    finally:
        engine.close()


class _Heard(ScriptedEnv):
    """A scripted environment that listens (``decoded``) and has no ``end``: it records the response
    lengths it hears, tagged with the attempt (``phase``: 1 once the step has failed)."""

    phase = 0
    heard: list = []

    def decoded(self, response_ids, logprobs, turn_start):
        type(self).heard.append((type(self).phase, self.prompt, len(response_ids)))


def _listening_run(fail_at: int | None):
    """One sequential step of 4 prompts whose sequences end by ``max_model_len`` at different forwards; the
    actor's forward number ``fail_at`` fails once (the step is rolled back and retried)."""
    engine = RolloutEngine(
        actor=make_actor(), reward=make_reward(),
        config=EngineConfig(batch_size=4, mode="sequential", page_size=8, max_model_len=16),
        sampling=SamplingParams(temperature=1.0, max_new_tokens=14, seed=7),
        eos_token_id=EOS, env=lambda: _Heard(EnvLog(), max_latency_s=0.0),
    )  # fmt: skip
    try:
        engine.add_prompts(random_prompts(4, seed=41, min_len=2, max_len=12))
        forward, calls = engine._loop.actor.forward, [0]

        def fails_once(chunks, specs):
            calls[0] += 1
            if calls[0] == fail_at:
                _Heard.phase = 1
                raise RuntimeError("transient actor failure")
            return forward(chunks, specs)

        engine._loop.actor.forward = fails_once
        result = engine.step()
        stats = engine.cache_stats()
        assert stats.free_pages == stats.total_pages
        return calls[0], result
    finally:
        engine.close()


def test_a_sequence_the_aborted_attempt_ended_listens_again_in_the_retry():
    """An environment with ``decoded`` and no ``end`` whose sequence ended (a length limit) in a step that was
    then rolled back: the retry decodes its turn again, and the environment hears it (it used to stop
    listening for good when the aborted attempt ended it: ``EnvDriver.ended``)."""
    _Heard.phase, _Heard.heard = 0, []
    forwards, first = _listening_run(None)
    ended_early = [
        r for r in first.rollouts if r.finish_reason == "max_model_len" and len(r.response_ids) > 2
    ]
    assert len(ended_early) >= 2  # the premise: sequences end at different forwards, before the last
    _Heard.phase, _Heard.heard = 0, []
    _, retried = _listening_run(forwards)  # the step's last forward fails: every sequence had ended but one
    assert _Heard.phase == 1
    assert [r.response_ids for r in retried.rollouts] == [r.response_ids for r in first.rollouts]
    for r in retried.rollouts:
        if r.finish_reason != "max_model_len":
            continue
        before = [k for phase, prompt, k in _Heard.heard if phase == 0 and prompt == tuple(r.prompt_ids)]
        after = [k for phase, prompt, k in _Heard.heard if phase == 1 and prompt == tuple(r.prompt_ids)]
        # The retry's turn is heard again, to the same end as the aborted attempt's (the old code heard
        # nothing after the rollback). Not always the same list: a fresh-clone CI run under load heard
        # [1..7] in the retry against [3..7] in the attempt (timing: the environments answer on threads).
        assert after and after == sorted(set(after)), (len(r.prompt_ids), before, after)
        assert after[-1] == before[-1], (len(r.prompt_ids), before, after)
