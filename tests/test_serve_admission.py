"""Admission in the middle of a step (DESIGN.md, wave 5): the step loop fills the places it holds free, up to
B + Δ, from the queue -- a served episode's first request that came after the step started, and a refill for
a group that failed -- in every mode; a rollback gives what it admitted back to the queue. Every prompt
still comes back exactly once."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from engine_models import EOS, make_actor, random_prompts
from envs import EnvLog, scripted
from serve_models import chat_actor, chat_tokenizer

from oppo_engine import EngineConfig, RolloutEngine, SamplingParams

MODES = ["sequential", "intra", "inter", "oppo"]
DEADLINE_S = 60.0


def drain(engine, expected):
    rollouts, failed, steps = [], [], []
    deadline = time.monotonic() + DEADLINE_S
    while len(rollouts) + len(failed) < expected:
        assert time.monotonic() < deadline, "the episodes did not come back"
        result = engine.step()
        steps.append(result)
        rollouts += result.rollouts
        failed += result.failed
    return rollouts, failed, steps


@pytest.mark.parametrize("mode", MODES)
def test_a_failed_group_is_refilled_from_the_queue_within_the_step(mode):
    prompts = random_prompts(6, seed=18)
    env = scripted(EnvLog(), fail_on={(prompts[0][0], 1)})
    extra = {"overcommit": 2} if mode in ("inter", "oppo") else {}
    if mode in ("intra", "oppo"):
        extra["chunk_size"] = 4
    engine = RolloutEngine(
        make_actor(), reward=lambda p, r: float(len(r)), env=env, eos_token_id=EOS,
        config=EngineConfig(batch_size=2, mode=mode, max_model_len=160, page_size=8, **extra),
        sampling=SamplingParams(temperature=1.0, max_new_tokens=30, seed=11, turn_stop_token_ids=(9,),
                                max_turn_tokens=6, ignore_eos=True),
    )  # fmt: skip
    engine.add_prompts(prompts)
    first = engine.step()
    # The failed group's place went to the next prompt in the queue: the step still returns B rollouts.
    assert [r.group_id for r in first.failed] == [0]
    assert len(first.rollouts) == 2
    rollouts, failed, _ = drain(engine, 6 - 2 - 1)
    every = sorted(r.group_id for r in first.rollouts + rollouts)
    assert every == [1, 2, 3, 4, 5] and failed == []  # every prompt exactly once
    stats = engine.cache_stats()
    assert stats.free_pages == stats.total_pages
    engine.close()


@pytest.mark.parametrize("mode", ["sequential", "oppo"])
def test_a_first_request_that_comes_during_a_step_is_admitted_into_it(mode):
    tokenizer = chat_tokenizer()
    extra = {"overcommit": 2, "chunk_size": 4} if mode == "oppo" else {}
    engine = RolloutEngine(
        chat_actor(tokenizer), reward=lambda p, r: 0.0, tokenizer=tokenizer,
        config=EngineConfig(batch_size=2, mode=mode, max_model_len=512, page_size=16, **extra),
        sampling=SamplingParams(max_new_tokens=40, seed=3),
    )  # fmt: skip
    handle = engine.serve()
    first_answered = threading.Event()

    async def slow_agent(client):  # keeps the step open: it thinks a while before its second request
        messages = [{"role": "user", "content": "first"}]
        answer = await client.chat.completions.create(model="m", messages=messages, max_tokens=4)
        first_answered.set()
        await asyncio.sleep(0.5)
        messages += [{"role": "assistant", "content": answer.choices[0].message.content}]
        messages += [{"role": "user", "content": "and?"}]
        await client.chat.completions.create(model="m", messages=messages, max_tokens=4)
        return 1.0

    async def late_agent(client):  # its episode opens only once the step is under way
        messages = [{"role": "user", "content": "second"}]
        await client.chat.completions.create(model="m", messages=messages, max_tokens=4)
        return 2.0

    def run(agent, wait=None) -> None:
        if wait is not None:
            assert wait.wait(DEADLINE_S)
        episode = handle.open_episode()

        async def go():
            client = handle.client(handle.episodes[episode.id], in_process=False)
            try:
                episode.finish(await agent(client))
            finally:
                await client.close()

        asyncio.run(go())

    threads = [
        threading.Thread(target=run, args=(slow_agent,), daemon=True),
        threading.Thread(target=run, args=(late_agent, first_answered), daemon=True),
    ]
    threads[0].start()
    deadline = time.monotonic() + DEADLINE_S
    while engine._prompts._expected == 0 and not engine._prompts._pending and time.monotonic() < deadline:
        time.sleep(0.005)  # the slow agent's episode is open
    threads[1].start()
    try:
        result = engine.step()
    finally:
        for t in threads:
            t.join(DEADLINE_S)
        engine.close()
    assert not any(t.is_alive() for t in threads)
    # Without admission in the middle of the step, the step would have held the slow episode alone.
    assert sorted(r.reward for r in result.rollouts) == [1.0, 2.0]
