"""An episode the engine ended (here: ``length``, its token budget spent) still takes ``finish(reward)`` until
the timeout, and that reward is the rollout's; without it (the timeout, an agent that raises at the 409 or
returns ``None``) the reward function scores the transcript. Every test has a deadline: a hang fails it."""

from __future__ import annotations

import threading
import time

import openai
import pytest

from oppo_engine import EngineConfig, RolloutEngine, SamplingParams

DEADLINE_S = 60.0


def length_reward(prompt, response) -> float:
    return float(len(response))


def make_engine(actor, tokenizer, mode: str = "oppo", **cfg) -> RolloutEngine:
    if mode in ("inter", "oppo"):
        cfg.setdefault("overcommit", 2)
    return RolloutEngine(
        actor, reward=length_reward, tokenizer=tokenizer,
        config=EngineConfig(batch_size=2, mode=mode, max_model_len=256, page_size=16, **cfg),
        sampling=SamplingParams(max_new_tokens=10, seed=9),  # over all turns: the second turn is cut
    )  # fmt: skip


def step_until(engine, n: int) -> tuple[list, list]:
    rollouts, failed = [], []
    deadline = time.monotonic() + DEADLINE_S
    while len(rollouts) + len(failed) < n:
        assert time.monotonic() < deadline, "the episodes did not come back"
        result = engine.step()
        rollouts += result.rollouts
        failed += result.failed
    return rollouts, failed


def talk_until_ended(client) -> list[str]:
    """Turns of 6 tokens until the engine ends the episode (the 409 ``episode_ended``); the finish reasons."""
    messages, reasons = [{"role": "user", "content": "hello"}], []
    for turn in range(5):
        try:
            answer = client.chat.completions.create(model="m", messages=messages, max_tokens=6)
        except openai.ConflictError as e:
            assert "has ended" in str(e)
            return reasons
        reasons.append(answer.choices[0].finish_reason)
        messages += [
            {"role": "assistant", "content": answer.choices[0].message.content},
            {"role": "user", "content": f"more {turn}"},
        ]
    raise AssertionError("the engine never ended the episode")


@pytest.mark.parametrize("mode", ["sequential", "oppo"])
def test_finish_after_the_engine_ended_the_episode_gives_the_rollout_its_reward(actor, tokenizer, mode):
    engine = make_engine(actor, tokenizer, mode)
    handle = engine.serve(end_grace_s=30.0)  # a loaded machine: the finish after the 409 is awaited
    episodes = [handle.open_episode(seed=k) for k in range(2)]
    rewards = [7.5, None]  # the second finishes without a reward: the reward function scores it

    def agent(k: int) -> None:
        url = episodes[k].base_url
        with openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=DEADLINE_S) as client:
            talk_until_ended(client)
        episodes[k].finish(rewards[k])

    threads = [threading.Thread(target=agent, args=(k,), daemon=True) for k in range(2)]
    try:
        for t in threads:
            t.start()
        rollouts, failed = step_until(engine, 2)
        for t in threads:
            t.join(DEADLINE_S)
        assert failed == []
        assert sorted(r.finish_reason for r in rollouts) == ["length", "length"]
        # the finished reward is the rollout's; the one finished with None is the reward function's
        scored = [r for r in rollouts if r.reward != 7.5]
        assert len(scored) == 1 and scored[0].reward == length_reward(None, scored[0].response_ids) != 7.5
        with pytest.raises(ValueError, match="already finished"):
            episodes[0].finish(1.0)
    finally:
        engine.close()


def test_without_finish_the_reward_function_scores_it_after_the_timeout_and_nothing_fails(actor, tokenizer):
    engine = make_engine(actor, tokenizer, env_timeout_s=1.0)
    handle = engine.serve(end_grace_s=None)  # awaited up to 0.9 x env_timeout_s
    episode = handle.open_episode(seed=3)
    with openai.OpenAI(base_url=episode.base_url, api_key="x", max_retries=0, timeout=DEADLINE_S) as client:
        stepper_result = []
        stepper = threading.Thread(target=lambda: stepper_result.append(step_until(engine, 1)), daemon=True)
        stepper.start()
        try:
            assert talk_until_ended(client)[-1] == "length"
            stepper.join(DEADLINE_S)
            ((rollouts, failed),) = stepper_result
            assert failed == [] and len(rollouts) == 1
            r = rollouts[0]
            assert r.finish_reason == "length" and r.reward == length_reward(None, r.response_ids)
        finally:
            engine.close()


def test_an_agent_of_add_agents_returns_the_reward_of_an_episode_the_engine_ended(actor, tokenizer):
    async def agent(task, client):
        messages = [{"role": "user", "content": "hello"}]
        for turn in range(5):
            try:
                answer = await client.chat.completions.create(model="m", messages=messages, max_tokens=6)
            except openai.ConflictError:
                return 100.0 + task  # the engine ended it: the agent still grades it
            messages += [
                {"role": "assistant", "content": answer.choices[0].message.content},
                {"role": "user", "content": f"more {turn}"},
            ]
        raise AssertionError("the engine never ended the episode")

    engine = make_engine(actor, tokenizer)
    engine.serve()
    try:
        engine.add_agents(agent, [0, 1, 2, 3])
        rollouts, failed = step_until(engine, 4)
        assert failed == []
        assert sorted(r.reward for r in rollouts) == [100.0, 101.0, 102.0, 103.0]
        assert {r.finish_reason for r in rollouts} == {"length"}
        stats = engine.cache_stats()
        assert stats.free_pages == stats.total_pages
    finally:
        engine.close()


def test_an_ended_episode_without_finish_holds_no_step_beyond_end_grace_and_a_late_finish_gets_409(
    actor, tokenizer
):
    """A vLLM-style client (one request, never a finish): after the engine ends its episode, finish is awaited
    only serve(end_grace_s=) (0.5 s by default), not 0.9 x env_timeout_s (here 600 s: past the deadline), and
    a finish that comes after is refused, never silently dropped (the reviewer's held4.py)."""
    engine = make_engine(actor, tokenizer, env_timeout_s=600.0)
    handle = engine.serve()
    episodes = [handle.open_episode(seed=k) for k in range(2)]

    def client(episode) -> None:
        with openai.OpenAI(base_url=episode.base_url, api_key="x", max_retries=0, timeout=DEADLINE_S) as c:
            c.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=20)

    threads = [threading.Thread(target=client, args=(e,), daemon=True) for e in episodes]
    try:
        for t in threads:
            t.start()
        rollouts, failed = step_until(engine, 2)
        assert failed == [] and {r.finish_reason for r in rollouts} == {"length"}
        assert [r.reward for r in rollouts] == [length_reward(None, r.response_ids) for r in rollouts]
        with pytest.raises(ValueError, match="not awaited any longer"):
            episodes[0].finish(5.0)
    finally:
        engine.close()


def test_an_agent_is_awaited_past_end_grace_and_its_return_is_the_reward(actor, tokenizer):
    """end_grace_s bounds episodes whose client may never call finish; an agent's return is its finish, so it
    is awaited (up to the timeout) even when it grades slowly."""
    import asyncio

    async def slow_grader(task, client):
        messages = [{"role": "user", "content": "hello"}]
        try:
            await client.chat.completions.create(model="m", messages=messages, max_tokens=20)
            await client.chat.completions.create(
                model="m", messages=[*messages, {"role": "assistant", "content": "x"}], max_tokens=2
            )
        except openai.APIStatusError:
            pass
        await asyncio.sleep(1.0)  # past end_grace_s
        return 50.0 + task

    engine = make_engine(actor, tokenizer, env_timeout_s=60.0)
    engine.serve(end_grace_s=0.1)
    try:
        engine.add_agents(slow_grader, [0, 1])
        rollouts, failed = step_until(engine, 2)
        assert failed == [] and sorted(r.reward for r in rollouts) == [50.0, 51.0]
    finally:
        engine.close()
