"""An episode opened but never sent a request does not hold ``step()`` back while the step has a batch without
it: the step admits the first requests that come (waiting 50 ms between them), and returns its B finished
episodes. Only a step with nothing else at all waits for it -- until its first request, or its expiry after
``env_timeout_s`` (then it returns the expired episode in ``failed``). Every test has a deadline: a hang
fails it."""

from __future__ import annotations

import time

import pytest

from oppo_engine import EngineConfig, RolloutEngine, SamplingParams

MODES = ["sequential", "intra", "inter", "oppo"]
PROMPT_S = 10.0  # well below env_timeout_s (300 s): a step that waited for the silent episode fails


async def agent(task, client):
    messages = [{"role": "user", "content": f"what is {task} ?"}]
    await client.chat.completions.create(model="m", messages=messages, max_tokens=6)
    return float(task)


@pytest.mark.parametrize("mode", MODES)
def test_a_silent_episode_does_not_hold_back_a_step_that_has_its_batch(actor, tokenizer, mode):
    cfg = {"overcommit": 2} if mode in ("inter", "oppo") else {}
    engine = RolloutEngine(
        actor, reward=lambda p, r: 0.0, tokenizer=tokenizer,
        config=EngineConfig(batch_size=2, mode=mode, max_model_len=256, page_size=16, **cfg),
        sampling=SamplingParams(max_new_tokens=16, seed=1),
    )  # fmt: skip
    handle = engine.serve()
    try:
        silent = handle.open_episode()  # never sends a request
        engine.add_agents(agent, [1, 2, 3, 4])
        rollouts = []
        t0 = time.monotonic()
        while len(rollouts) < 4:
            rollouts += engine.step().rollouts
            assert time.monotonic() - t0 < PROMPT_S, "a step waited for the silent episode"
        assert sorted(r.reward for r in rollouts) == [1.0, 2.0, 3.0, 4.0]
        # Nothing else is left: the next step would wait for the silent episode's first request (or its
        # expiry). Once it finishes without a request, step() returns at once with nothing.
        silent.finish(None)
        t = time.monotonic()
        result = engine.step()
        assert result.rollouts == result.failed == [] and time.monotonic() - t < PROMPT_S
    finally:
        engine.close()


def test_a_step_with_nothing_else_returns_the_silent_episode_in_failed_when_it_expires(actor, tokenizer):
    engine = RolloutEngine(
        actor, reward=lambda p, r: 0.0, tokenizer=tokenizer,
        config=EngineConfig(batch_size=2, mode="oppo", overcommit=2, max_model_len=256, page_size=16,
                            env_timeout_s=1.0),
        sampling=SamplingParams(max_new_tokens=16, seed=1),
    )  # fmt: skip
    handle = engine.serve()
    try:
        handle.open_episode()
        t = time.monotonic()
        result = engine.step()
        waited = time.monotonic() - t
        # it waited for the first request, up to the expiry; the expired episode comes back once, in failed
        if not result.failed:  # expired just after the step stopped waiting: the next step returns it
            result = engine.step()
        assert result.rollouts == [] and len(result.failed) == 1 and "env_timeout_s" in result.failed[0].error
        assert 0.9 <= waited < PROMPT_S
        assert engine.step().failed == []
    finally:
        engine.close()
