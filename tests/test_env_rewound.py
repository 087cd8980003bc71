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
