"""The endpoint over a real 127.0.0.1 socket, as a vLLM client or the official ``openai`` client sees it: the
routes' shapes, token-in/token-out, a repeat answered the same, and every bad input answered with OpenAI's
error JSON, the right status and ``x-should-retry: false``. A test steps the engine on a thread of its own
with a deadline: a hang fails it."""

from __future__ import annotations

import contextlib
import threading
import time

import httpx2
import openai
import pytest
from serve_stepper import Stepper

from oppo_engine import EngineConfig, RolloutEngine, SamplingParams

KEY = "sekrit"
DEADLINE_S = 60.0


def make_engine(actor, tokenizer, **kw) -> RolloutEngine:
    return RolloutEngine(
        actor, reward=lambda p, r: float(len(r)), tokenizer=tokenizer,
        config=EngineConfig(batch_size=2, mode="oppo", overcommit=2, chunk_size=4, max_model_len=256,
                            page_size=16),
        sampling=SamplingParams(max_new_tokens=32, seed=2), **kw,
    )  # fmt: skip


@pytest.fixture()
def served(actor, tokenizer):
    engine = make_engine(actor, tokenizer)
    handle = engine.serve(api_key=KEY)
    stepper = Stepper(engine)
    client = httpx2.Client(
        base_url=handle.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=DEADLINE_S
    )
    yield engine, handle, stepper, client
    client.close()
    handle.close()  # first: step() waits for the first request of an open episode until it closes
    stepper.stop()
    engine.close()


def open_episode(client) -> tuple[str, str]:
    response = client.post("/v1/episodes", json={"seed": 5})
    assert response.status_code == 200
    body = response.json()
    return body["id"], body["base_url"]


def assert_error(response, status: int, param: str | None = None, text: str | None = None) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["x-should-retry"] == "false"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    if param is not None:
        assert error["param"] == param
    if text is not None:
        assert text in error["message"]
    return error


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"logit_bias": {"5": 1}}, "logit_bias"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"frequency_penalty": 0.5}, "frequency_penalty"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"n": 2}, "n"),
        ({"stream": "yes"}, "stream"),
        ({"stop": ["the answer is"]}, "stop"),
        ({"max_tokens": "four"}, "max_tokens"),
        ({"temperature": "hot"}, "temperature"),
        ({"messages": "hello"}, "messages"),
    ],
)
def test_unsupported_or_mistyped_fields_get_400_naming_the_field(served, change, param):
    _, _, _, client = served
    _, base_url = open_episode(client)
    assert_error(client.post(f"{base_url}/chat/completions", json={**CHAT, **change}), 400, param=param)


def test_bad_input_gets_openai_errors_with_the_right_status(served):
    engine, handle, _, client = served
    _, base_url = open_episode(client)
    # malformed JSON, unknown episode, a prompt past max_model_len (with the numbers), in an episode or not
    bad = client.post(
        f"{base_url}/chat/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert_error(bad, 400)
    assert_error(client.post(f"{handle.url}/episodes/nope/v1/chat/completions", json=CHAT), 404)
    long = {**CHAT, "messages": [{"role": "user", "content": "the answer is 42 . " * 200}]}
    for url in (f"{base_url}/chat/completions", "/v1/chat/completions"):
        error = assert_error(client.post(url, json=long), 400, text="max_model_len=256")
        assert "tokens" in error["message"]
    assert_error(client.post("/v1/completions", json={"prompt": [1, 10**6]}), 400, param="prompt")
    # a body over 8 MiB
    huge = b'{"messages": "' + b"x" * (8 << 20) + b'"}'
    assert_error(client.post(f"{base_url}/chat/completions", content=huge), 413)
    # the API key, on every route
    for method, path in [("GET", "/v1/models"), ("POST", "/v1/episodes"), ("POST", "/tokenize"),
                         ("POST", "/detokenize"), ("POST", "/episodes/x/v1/chat/completions"),
                         ("POST", "/v1/chat/completions")]:  # fmt: skip
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            response = httpx2.request(method, handle.url + path, json={}, headers=headers, timeout=DEADLINE_S)
            assert_error(response, 401)
    stats = engine.cache_stats()
    assert stats.free_pages == stats.total_pages  # nothing of the refused requests holds a page


def test_a_vllm_style_client_gets_token_ids_a_repeat_gets_the_same_answer(served, tokenizer):
    engine, handle, stepper, client = served
    episode_id, base_url = open_episode(client)
    first = {**CHAT, "return_token_ids": True, "logprobs": True}
    response = client.post(f"{base_url}/chat/completions", json=first)
    assert response.status_code == 200, response.text
    body = response.json()
    rendered = client.post(
        "/tokenize", json={"messages": first["messages"], "add_generation_prompt": True}
    ).json()
    assert body["prompt_token_ids"] == rendered["tokens"] and rendered["count"] == len(rendered["tokens"])
    choice = body["choices"][0]
    assert body["object"] == "chat.completion" and choice["message"]["role"] == "assistant"
    assert (
        len(choice["token_ids"]) == len(choice["logprobs"]["content"]) == body["usage"]["completion_tokens"]
    )
    assert client.post("/detokenize", json={"tokens": choice["token_ids"]}).json()[
        "prompt"
    ] == tokenizer.decode(choice["token_ids"])
    # a client's retry of the same request: the same answer, nothing sampled again
    assert client.post(f"{base_url}/chat/completions", json=first).json() == body
    history = [*first["messages"], {"role": "assistant", "content": choice["message"]["content"]}]
    # the agent edited its history: 409 naming the first differing message, never re-tokenised
    edited = [
        *first["messages"],
        {"role": "assistant", "content": "something else"},
        {"role": "user", "content": "?"},
    ]
    assert_error(
        client.post(f"{base_url}/chat/completions", json={**first, "messages": edited}), 409, "messages[1]"
    )
    # the sampling belongs to the episode
    later = {**first, "messages": [*history, {"role": "user", "content": "more"}]}
    assert_error(
        client.post(f"{base_url}/chat/completions", json={**later, "temperature": 0.3}), 400, "temperature"
    )
    second = client.post(f"{base_url}/chat/completions", json=later).json()
    assert second["prompt_token_ids"][: len(body["prompt_token_ids"])] == body["prompt_token_ids"]
    assert client.post(f"/v1/episodes/{episode_id}/finish", json={"reward": 2.5}).status_code == 200
    assert_error(client.post(f"/v1/episodes/{episode_id}/finish", json={"reward": 1}), 409)
    answered = {"role": "assistant", "content": second["choices"][0]["message"]["content"]}
    ended = {**later, "messages": [*later["messages"], answered, {"role": "user", "content": "x"}]}
    assert_error(client.post(f"{base_url}/chat/completions", json=ended), 409, text="has ended")
    stepper.wait_for(1)
    (r,) = stepper.rollouts
    assert r.reward == 2.5 and r.finish_reason == "agent_done"
    assert r.prompt_ids + r.response_ids == second["prompt_token_ids"] + second["choices"][0]["token_ids"]


def test_completions_take_token_ids_and_must_extend_the_episode(served):
    _, _, stepper, client = served
    episode_id, base_url = open_episode(client)
    prompt = [10, 11, 12, 13]
    body = client.post(
        f"{base_url}/completions", json={"prompt": prompt, "max_tokens": 3, "return_token_ids": True}
    )
    choice = body.json()["choices"][0]
    assert choice["prompt_token_ids"] == prompt and 1 <= len(choice["token_ids"]) <= 3
    so_far = prompt + choice["token_ids"]
    assert_error(client.post(f"{base_url}/completions", json={"prompt": [10, 99, 12, 13, 14]}), 409, "prompt")
    nxt = client.post(f"{base_url}/completions", json={"prompt": [*so_far, 20, 21], "return_token_ids": True})
    assert nxt.json()["choices"][0]["prompt_token_ids"] == [*so_far, 20, 21]
    client.post(f"/v1/episodes/{episode_id}/finish", json={})
    stepper.wait_for(1)
    (r,) = stepper.rollouts
    assert r.prompt_ids == prompt and r.response_ids[len(choice["token_ids"]) :][:2] == [20, 21]
    assert r.reward == float(len(r.response_ids))  # finish without a reward: the engine's reward function


def test_models_route_and_an_open_episode_with_the_official_client_over_the_socket(actor, tokenizer):
    engine = make_engine(actor, tokenizer)
    handle = engine.serve()
    stepper = Stepper(engine)
    try:
        with openai.OpenAI(base_url=f"{handle.url}/v1", api_key="x", max_retries=0, timeout=DEADLINE_S) as c:
            assert [m.id for m in c.models.list().data] == [handle.responses.model]
        episode = handle.open_episode(metadata={"task": "hello"}, seed=9)
        assert episode.base_url == f"{handle.url}/episodes/{episode.id}/v1" and len(episode.id) >= 16
        with openai.OpenAI(base_url=episode.base_url, api_key="x", max_retries=0, timeout=DEADLINE_S) as c:
            r = c.chat.completions.create(model="m", messages=CHAT["messages"], max_tokens=5, seed=9)
            assert r.choices[0].finish_reason in ("stop", "length")
            with pytest.raises(openai.BadRequestError):  # the official client raises, never retries a 4xx
                c.chat.completions.create(model="m", messages=CHAT["messages"], max_tokens=5, n=2)
        episode.finish(1.5)
        with pytest.raises(ValueError, match="already finished"):
            episode.finish(1.5)
        stepper.wait_for(1)
        assert stepper.rollouts[0].reward == 1.5
    finally:
        handle.close()
        stepper.stop()
        engine.close()


def test_serve_refuses_what_it_cannot_serve(actor, tokenizer):
    with contextlib.closing(make_engine(actor, None)) as engine, pytest.raises(ValueError, match="tokenizer"):
        engine.serve()
    with contextlib.closing(make_engine(actor, tokenizer)) as engine:
        with pytest.raises(ValueError, match="api_key"):
            engine.serve(host="0.0.0.0")
        with pytest.raises(ValueError, match="process_group"):
            engine._group = type("Group", (), {"check": lambda self: None})()  # a stand-in
            try:
                engine.serve()
            finally:
                engine._group = None
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    with contextlib.closing(make_engine(actor, tokenizer, eos_token_id=im_end)) as engine:
        with pytest.raises(ValueError, match="end-of-turn"):
            engine.serve()


def test_a_server_closed_with_episodes_in_flight_fails_them(actor, tokenizer):
    engine = make_engine(actor, tokenizer)
    handle = engine.serve()
    episode = handle.open_episode()
    errors = []

    def agent() -> None:
        with openai.OpenAI(base_url=episode.base_url, api_key="x", max_retries=0, timeout=DEADLINE_S) as c:
            try:
                c.chat.completions.create(model="m", messages=CHAT["messages"], max_tokens=4)
            except openai.OpenAIError as e:
                errors.append(e)

    t = threading.Thread(target=agent, daemon=True)
    t.start()
    deadline = time.monotonic() + DEADLINE_S
    while engine._prompts._expected and time.monotonic() < deadline:  # its first request is queued
        time.sleep(0.01)
    handle.close()
    t.join(DEADLINE_S)
    assert not t.is_alive() and len(errors) == 1
    result = engine.step()
    assert result.rollouts == [] and len(result.failed) == 1 and "closed" in result.failed[0].error
    stats = engine.cache_stats()
    assert stats.free_pages == stats.total_pages
    engine.close()


def test_on_divergence_restart_ends_the_episode_and_starts_a_new_one_from_the_request(actor, tokenizer):
    engine = make_engine(actor, tokenizer)
    handle = engine.serve(on_divergence="restart")
    stepper = Stepper(engine)
    try:
        episode = handle.open_episode(seed=3)
        url = f"{episode.base_url}/chat/completions"
        first = httpx2.post(url, json={**CHAT, "return_token_ids": True}, timeout=DEADLINE_S).json()
        edited = {**CHAT, "messages": [{"role": "user", "content": "hello again"}], "return_token_ids": True}
        second = httpx2.post(url, json=edited, timeout=DEADLINE_S)
        assert second.status_code == 200, second.text  # a new episode under the same id
        episode.finish(4.0)  # the new one
        stepper.wait_for(2)
    finally:
        handle.close()
        stepper.stop()
        engine.close()
    by_prompt = {tuple(r.prompt_ids): r for r in stepper.rollouts}
    old, new = (
        by_prompt[tuple(first["prompt_token_ids"])],
        by_prompt[tuple(second.json()["prompt_token_ids"])],
    )
    assert old.finish_reason == new.finish_reason == "agent_done"
    assert new.reward == 4.0 and old.reward == float(len(old.response_ids))  # the old: the reward function's


def test_a_client_that_disconnects_mid_turn_fails_its_episode_and_frees_its_pages(actor, tokenizer):
    engine = make_engine(actor, tokenizer)
    handle = engine.serve()
    try:
        episode = handle.open_episode()
        url = f"{episode.base_url}/chat/completions"
        with pytest.raises(httpx2.TimeoutException):  # no step runs: the client gives up and disconnects
            httpx2.post(url, json=CHAT, timeout=0.5)
        deadline = time.monotonic() + DEADLINE_S
        while handle.episodes[episode.id].state != "failed" and time.monotonic() < deadline:
            time.sleep(0.02)
        assert "disconnected" in handle.episodes[episode.id].error
        result = engine.step()  # its environment is refused: its turn is never decoded
        assert result.rollouts == [] and len(result.failed) == 1 and "disconnected" in result.failed[0].error
        assert result.failed[0].response_ids == []
        stats = engine.cache_stats()
        assert stats.free_pages == stats.total_pages
        assert_error(httpx2.post(url, json=CHAT, timeout=DEADLINE_S), 410)
    finally:
        engine.close()


def test_a_streamed_chat_turn_concatenates_to_the_turn_and_carries_prompt_token_ids_first(actor, tokenizer):
    engine = make_engine(actor, tokenizer)
    handle = engine.serve()
    stepper = Stepper(engine)
    try:
        episode = handle.open_episode(seed=1)
        with openai.OpenAI(base_url=episode.base_url, api_key="x", max_retries=0, timeout=DEADLINE_S) as c:
            chunks = list(
                c.chat.completions.create(
                    model="m",
                    messages=CHAT["messages"],
                    max_tokens=5,
                    stream=True,
                    stream_options={"include_usage": True},
                    extra_body={"return_token_ids": True},
                )  # fmt: skip
            )
            # a retry of the same request without streaming: the same turn
            whole = c.chat.completions.create(
                model="m", messages=CHAT["messages"], max_tokens=5, extra_body={"return_token_ids": True}
            )
        first = chunks[0].model_dump()
        assert first["prompt_token_ids"] == whole.model_extra["prompt_token_ids"]
        assert all("prompt_token_ids" not in ch.model_dump() or ch.model_dump()["prompt_token_ids"] is None
                   for ch in chunks[1:])  # fmt: skip
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        assert text == (whole.choices[0].message.content or "")
        ids = [t for ch in chunks if ch.choices for t in ch.choices[0].model_extra.get("token_ids") or []]
        assert ids == whole.choices[0].model_extra["token_ids"]  # token by token (serve/stream.py)
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == whole.choices[
            0
        ].finish_reason
        assert chunks[-1].usage.completion_tokens == len(ids)
        episode.finish(1.0)
        stepper.wait_for(1)
    finally:
        handle.close()
        stepper.stop()
        engine.close()


def test_an_engine_serves_again_after_its_handle_closed(actor, tokenizer):
    with contextlib.closing(make_engine(actor, tokenizer)) as engine:
        first = engine.serve()
        with pytest.raises(RuntimeError, match="already serving"):
            engine.serve()
        first.close()
        first.close()  # idempotent
        second = engine.serve()
        assert httpx2.get(f"{second.url}/v1/models", timeout=DEADLINE_S).status_code == 200
        if second.url != first.url:  # (the OS may hand the same free port out again)
            with pytest.raises(httpx2.ConnectError):
                httpx2.get(f"{first.url}/v1/models", timeout=DEADLINE_S)


def test_a_refused_text_completion_leaves_the_episodes_text_where_it_was(served, tokenizer):
    _, _, stepper, client = served
    episode_id, base_url = open_episode(client)
    first = client.post(
        f"{base_url}/completions", json={"prompt": "hello", "max_tokens": 3, "return_token_ids": True}
    )
    assert first.status_code == 200, first.text
    choice = first.json()["choices"][0]
    so_far = "hello" + choice["text"]
    too_long = client.post(f"{base_url}/completions", json={"prompt": so_far + " word" * 400})
    assert_error(too_long, 400, text="max_model_len")
    nxt = client.post(f"{base_url}/completions", json={"prompt": so_far + " more", "return_token_ids": True})
    assert nxt.status_code == 200, nxt.text  # extends the history as it was before the refusal
    more = tokenizer.encode(" more", add_special_tokens=False)
    expected = choice["prompt_token_ids"] + choice["token_ids"] + more
    assert nxt.json()["choices"][0]["prompt_token_ids"] == expected  # the refused text never reached it
    client.post(f"/v1/episodes/{episode_id}/finish", json={"reward": 1.0})
    stepper.wait_for(1)
    (r,) = stepper.rollouts
    assert r.prompt_ids + r.response_ids[: len(choice["token_ids"]) + len(more)] == expected
