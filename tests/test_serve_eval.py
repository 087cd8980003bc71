"""Requests to the plain ``/v1`` URL (no episode): served for evaluation, never trained on. With the official
``openai`` client over a real 127.0.0.1 socket, while agents' episodes run: the response is what the engine
sampled (greedy: the HF forward's argmax at every position; log-probs equal the HF forward's), ``step()``
returns only the episodes' rollouts, B of them per step, and every page comes back. Every test has a
deadline: a hang fails it."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx2
import openai
import pytest
from hf_check import assert_logprobs_equal_hf, hf_logprobs
from serve_stepper import Stepper

from oppo_engine import EngineConfig, RolloutEngine, SamplingParams

DEADLINE_S = 60.0
B = 2


def make_engine(actor, tokenizer, mode: str = "oppo") -> RolloutEngine:
    extra = {"overcommit": 2} if mode in ("inter", "oppo") else {}
    return RolloutEngine(
        actor, reward=lambda p, r: float(len(r)), tokenizer=tokenizer,
        config=EngineConfig(batch_size=B, mode=mode, max_model_len=256, page_size=16, **extra),
        sampling=SamplingParams(max_new_tokens=24, seed=3),
    )  # fmt: skip


async def chatty_agent(task, client):
    messages = [{"role": "user", "content": f"what is {task} + 7 ?"}]
    for turn in range(2):
        answer = await client.chat.completions.create(model="m", messages=messages, max_tokens=6)
        messages += [
            {"role": "assistant", "content": answer.choices[0].message.content},
            {"role": "user", "content": f"and then {turn} ?"},
        ]
    return float(task)


@pytest.mark.parametrize("mode", ["sequential", "oppo"])
def test_a_plain_v1_request_is_served_beside_the_episodes_and_never_trained_on(actor, tokenizer, mode):
    engine = make_engine(actor, tokenizer, mode)
    handle = engine.serve()
    stats = engine.cache_stats()
    tasks = list(range(6))
    engine.add_agents(chatty_agent, tasks)
    stepper = Stepper(engine)
    client = openai.OpenAI(base_url=f"{handle.url}/v1", api_key="unused", max_retries=0, timeout=DEADLINE_S)
    try:
        messages = [{"role": "user", "content": "what is 12 + 30 ?"}]
        greedy = client.chat.completions.create(
            model="m", messages=messages, max_tokens=12, temperature=0.0, logprobs=True,
            extra_body={"return_token_ids": True},
        )  # fmt: skip
        sampled = client.completions.create(
            model="m", prompt=[5, 17, 42, 99], max_tokens=10, temperature=1.0, seed=7, logprobs=1,
            extra_body={"return_token_ids": True},
        )  # fmt: skip
        deadline = time.monotonic() + DEADLINE_S
        while stepper.count() < len(tasks):
            assert time.monotonic() < deadline and not stepper.errors, stepper.errors
            time.sleep(0.01)
    finally:
        client.close()
        stepper.stop()
    try:
        # the chat answer: the template's render of the messages, then the greedy continuation, exactly
        prompt = greedy.model_extra["prompt_token_ids"]
        ids = greedy.choices[0].model_extra["token_ids"]
        assert prompt == tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        assert 0 < len(ids) <= 12
        logp = hf_logprobs(actor, prompt + ids)
        assert ids == logp[len(prompt) - 1 : -1].argmax(-1).tolist()
        lps = [c.logprob for c in greedy.choices[0].logprobs.content]
        assert_logprobs_equal_hf(actor, prompt, ids, lps)
        # the sampled completion: its log-probs are the behaviour log-probs of the HF forward (temperature 1)
        choice = sampled.choices[0]
        assert choice.model_extra["prompt_token_ids"] == [5, 17, 42, 99]
        assert_logprobs_equal_hf(
            actor, [5, 17, 42, 99], choice.model_extra["token_ids"], choice.logprobs.token_logprobs
        )
        # step() returned the episodes only, B per step, each once; no rollout is an evaluation's
        rollouts = [r for result in stepper.results for r in result.rollouts]
        assert all(len(result.rollouts) + len(result.failed) <= B for result in stepper.results)
        assert sorted(r.reward for r in rollouts) == [float(t) for t in tasks]
        assert all(r.finish_reason == "agent_done" for r in rollouts)
        assert not any(r.prompt_ids in (prompt, [5, 17, 42, 99]) for r in rollouts)
        after = engine.cache_stats()
        assert after.free_pages == stats.free_pages == after.total_pages
    finally:
        engine.close()


def test_a_step_with_no_batch_of_its_own_decodes_the_evaluations_to_the_end(actor, tokenizer):
    engine = make_engine(actor, tokenizer)
    handle = engine.serve()
    answers = []

    def ask(k: int) -> None:
        with httpx2.Client(base_url=handle.url, timeout=DEADLINE_S) as http:
            answers.append(
                http.post(
                    "/v1/completions",
                    json={"prompt": [7, 8, 9 + k], "max_tokens": 16, "seed": k, "return_token_ids": True},
                ).json()
            )

    threads = [threading.Thread(target=ask, args=(k,), daemon=True) for k in range(3)]
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + DEADLINE_S
        while len(handle.evals.running) + len(handle.evals._pending) < 3:  # all three queued
            assert time.monotonic() < deadline, "the evaluations were not queued"
            time.sleep(0.01)
        result = engine.step()  # ONE step, nothing to train on: it decodes the evaluations to their end
        assert result.rollouts == [] and result.failed == [] and not handle.evals.in_flight
        for t in threads:
            t.join(DEADLINE_S)
        assert len(answers) == 3
        for answer in answers:
            choice = answer["choices"][0]
            assert choice["finish_reason"] in ("stop", "length") and choice["token_ids"]
        stats = engine.cache_stats()
        assert stats.free_pages == stats.total_pages
    finally:
        engine.close()


def test_an_evaluation_whose_client_goes_away_is_dropped_and_its_pages_freed(actor, tokenizer):
    engine = make_engine(actor, tokenizer)
    handle = engine.serve()

    async def go_away() -> None:
        async with httpx2.AsyncClient(base_url=handle.url) as http:
            with pytest.raises(httpx2.TimeoutException):
                await http.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 8}, timeout=0.3)

    try:
        asyncio.run(go_away())
        deadline = time.monotonic() + DEADLINE_S
        while handle.eval_calls:  # the server saw the client go
            assert time.monotonic() < deadline
            time.sleep(0.05)
        engine.step()
        assert not handle.evals.in_flight
        stats = engine.cache_stats()
        assert stats.free_pages == stats.total_pages
    finally:
        engine.close()


async def one_turn_agent(task, client):
    messages = [{"role": "user", "content": f"what is {task} ?"}]
    await client.chat.completions.create(model="m", messages=messages, max_tokens=4)
    return float(task)


def long_greedy_prompt(actor, tokenizer, stops: set[int], length: int) -> list[int]:
    """A prompt whose greedy continuation has no stop token in its first ``length`` tokens (found with HF)."""
    for k in range(40):
        prompt = [5 + k, 17, 42, 99]
        ids = list(prompt)
        for _ in range(length):
            ids.append(int(hf_logprobs(actor, ids)[-1].argmax()))
            if ids[-1] in stops:
                break
        else:
            return prompt
    pytest.skip("no prompt decodes this long greedily on this model")


def test_an_episode_that_comes_while_an_empty_step_decodes_an_evaluation_joins_that_step(actor, tokenizer):
    engine = RolloutEngine(
        actor, reward=lambda p, r: 0.0, tokenizer=tokenizer,
        config=EngineConfig(batch_size=1, mode="sequential", max_model_len=256, page_size=16),
        sampling=SamplingParams(max_new_tokens=8, seed=3),
    )  # fmt: skip
    handle = engine.serve()
    prompt = long_greedy_prompt(actor, tokenizer, set(engine.eos_token_ids) | {handle.turn_end}, 120)
    answers, results = [], []

    def ask() -> None:
        with httpx2.Client(base_url=handle.url, timeout=DEADLINE_S) as http:
            body = {"prompt": prompt, "max_tokens": 120, "temperature": 0.0, "return_token_ids": True}
            answers.append(http.post("/v1/completions", json=body).json())

    asker = threading.Thread(target=ask, daemon=True)
    try:
        asker.start()
        deadline = time.monotonic() + DEADLINE_S
        while not handle.evals.in_flight:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        stepper = threading.Thread(target=lambda: results.append(engine.step()), daemon=True)
        stepper.start()  # nothing to train on: it would decode the evaluation to its end
        time.sleep(0.05)
        engine.add_agents(one_turn_agent, [5])  # comes while that step runs: it joins it
        stepper.join(DEADLINE_S)
        (result,) = results
        assert [r.reward for r in result.rollouts] == [5.0]
        while not answers:  # the evaluation goes on in the next steps
            assert time.monotonic() < deadline
            engine.step()
            time.sleep(0.01)
        asker.join(DEADLINE_S)
        assert len(answers[0]["choices"][0]["token_ids"]) == 120
    finally:
        engine.close()


def test_an_evaluation_is_not_held_back_by_an_opened_episode_that_sends_nothing(actor, tokenizer):
    """A step with nothing to train on waits for an opened episode's first request, but not while it has
    evaluations to decode: they are answered while the silent episode is still open (without the fix they
    waited for its expiry, env_timeout_s)."""
    engine = RolloutEngine(
        actor, reward=lambda p, r: 0.0, tokenizer=tokenizer,
        config=EngineConfig(batch_size=2, mode="oppo", overcommit=2, max_model_len=256, page_size=16,
                            env_timeout_s=20.0),
        sampling=SamplingParams(max_new_tokens=16, seed=1),
    )  # fmt: skip
    handle = engine.serve()
    silent = handle.open_episode()
    answers = []

    def ask() -> None:
        with httpx2.Client(base_url=handle.url, timeout=DEADLINE_S) as http:
            answers.append(http.post("/v1/completions", json={"prompt": [7, 8, 9], "max_tokens": 4}).json())

    asker = threading.Thread(target=ask, daemon=True)
    try:
        asker.start()
        deadline = time.monotonic() + DEADLINE_S
        while not handle.evals.in_flight:  # the request is queued
            assert time.monotonic() < deadline
            time.sleep(0.01)
        result = engine.step()  # nothing to train on: it decodes the evaluation to its end
        assert result.rollouts == [] and result.failed == [] and not handle.evals.in_flight
        assert handle.episodes[silent.id].state == "open"  # long before the silent one expires
        asker.join(DEADLINE_S)
        assert answers[0]["choices"][0]["finish_reason"] in ("stop", "length")
    finally:
        engine.close()


@pytest.mark.parametrize("kind", ["chat", "text"])
def test_an_evaluation_whose_rendered_prompt_leaves_the_vocabulary_is_refused(tokenizer, kind):
    """An actor with a smaller vocabulary than the tokenizer's: a text or chat prompt that renders to an id
    outside it gets 400, as an episode's prompt does, and is never decoded."""
    from serve_models import chat_actor

    small = chat_actor(tokenizer)
    small.resize_token_embeddings(64)
    engine = RolloutEngine(
        small, reward=lambda p, r: 0.0, tokenizer=tokenizer,
        config=EngineConfig(batch_size=1, mode="sequential", max_model_len=256, page_size=16),
        sampling=SamplingParams(max_new_tokens=4, seed=3),
    )  # fmt: skip
    handle = engine.serve()
    text = "zzz yyy xxx www"
    assert max(tokenizer(text)["input_ids"]) >= 64
    if kind == "chat":
        route, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": text}]}
    else:
        route, body = "/v1/completions", {"prompt": text}
    try:
        with httpx2.Client(base_url=handle.url, timeout=DEADLINE_S) as http:
            answer = http.post(route, json={**body, "max_tokens": 2})
        assert answer.status_code == 400 and "outside the vocabulary" in answer.text, answer.text
        assert not handle.evals.in_flight
    finally:
        engine.close()
