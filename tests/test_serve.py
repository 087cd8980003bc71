"""``RolloutEngine.serve()``: agents written against the official ``openai`` client drive the engine, and each
conversation is an episode. The properties: what the responses say (``prompt_token_ids``, ``token_ids``,
logprobs) is exactly the ``Rollout``'s; the template suffixes between turns are the only tokens not sampled;
the sampled ids are reused, never re-encoded; the same agents and seeds give the same transcripts in all four
modes, in-process and over a real 127.0.0.1 socket; the log-probs equal one HF forward over the transcript.
Every test has a deadline: a hang fails it."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from types import SimpleNamespace

import pytest
from hf_check import assert_logprobs_equal_hf
from serve_models import add
from transformers.utils import get_json_schema

from oppo_engine import EngineConfig, RolloutEngine, SamplingParams
from oppo_engine.checkpoint import refuse_agents
from oppo_engine.sched.sequence import SeqStatus

MODES = ["sequential", "intra", "inter", "oppo"]
DEADLINE_S = 120.0
TOOLS = [get_json_schema(add)]


def rule_reward(prompt, response) -> float:
    return float(len(response))


def make_engine(actor, tokenizer, mode="oppo", *, batch_size=2, **cfg) -> RolloutEngine:
    if mode in ("inter", "oppo"):
        cfg.setdefault("overcommit", 2)
    if mode in ("intra", "oppo"):
        cfg.setdefault("chunk_size", 4)
    return RolloutEngine(
        actor, reward=rule_reward, tokenizer=tokenizer,
        config=EngineConfig(batch_size=batch_size, mode=mode, max_model_len=1024, page_size=16, **cfg),
        sampling=SamplingParams(max_new_tokens=48, seed=1),
    )  # fmt: skip


def drain(engine: RolloutEngine, expected: int) -> tuple[list, list]:
    """Step until ``expected`` episodes have come back (returned or failed), within the deadline."""
    rollouts, failed = [], []
    deadline = time.monotonic() + DEADLINE_S
    while len(rollouts) + len(failed) < expected:
        assert time.monotonic() < deadline, (
            f"only {len(rollouts) + len(failed)} of {expected} episodes came back"
        )
        result = engine.step()
        rollouts += result.rollouts
        failed += result.failed
    return rollouts, failed


def make_agent(log: dict, *, turns: int = 3, max_tokens: int = 6, tools: bool = False):
    """An agent that chats ``turns`` turns, echoing the history it was given (as the Agents SDK does, with
    ``content=None`` for an empty answer), and records every response under its task."""

    async def agent(task, client):
        messages = [{"role": "user", "content": f"what is {task} + 7 ?"}]
        kwargs = dict(tools=TOOLS) if tools else {}
        for turn in range(turns):
            response = await client.chat.completions.create(
                model="m", messages=messages, max_tokens=max_tokens, logprobs=True, temperature=1.0,
                extra_body={"return_token_ids": True}, **kwargs,
            )  # fmt: skip
            log.setdefault(task, []).append(response.model_dump())
            message = response.choices[0].message
            echoed = {"role": "assistant", "content": message.content or None}
            if message.tool_calls:
                echoed["tool_calls"] = [c.model_dump() for c in message.tool_calls]
            messages.append(echoed)
            if message.tool_calls:
                for call in message.tool_calls:
                    messages.append({"role": "tool", "tool_call_id": call.id, "content": "49"})
            else:
                messages.append({"role": "user", "content": f"and then {turn} ?"})
        return float(task)

    return agent


def run_agents(actor, tokenizer, mode: str, tasks: list[int], *, in_process=True, **agent_kw):
    engine = make_engine(actor, tokenizer, mode)
    handle = engine.serve()
    log: dict = {}
    try:
        engine.add_agents(make_agent(log, **agent_kw), tasks, in_process=in_process)
        rollouts, failed = drain(engine, len(tasks))
    finally:
        engine.close()
    assert not handle.thread.is_alive()
    return rollouts, failed, log


def by_task(rollouts, log) -> dict:
    """Each task's rollout, found by its prompt: the first response's ``prompt_token_ids``."""
    first = {tuple(responses[0]["prompt_token_ids"]): task for task, responses in log.items()}
    return {first[tuple(r.prompt_ids)]: r for r in rollouts}


def test_responses_are_the_rollouts_tokens_and_only_template_suffixes_lie_between_turns(actor, tokenizer):
    rollouts, failed, log = run_agents(actor, tokenizer, "oppo", list(range(6)))
    assert failed == [] and len(rollouts) == 6
    for task, r in by_task(rollouts, log).items():
        responses = log[task]
        tokens = r.prompt_ids + r.response_ids
        p = len(r.prompt_ids)
        assert r.finish_reason == "agent_done" and r.reward == float(task)
        assert len(r.turns) == len(responses) == 3
        rebuilt = list(responses[0]["prompt_token_ids"])
        for k, (response, (start, end)) in enumerate(zip(responses, r.turns, strict=True)):
            choice = response["choices"][0]
            # what the agent was told it sent is the sequence's tokens before the turn, exactly
            assert response["prompt_token_ids"] == tokens[: p + start]
            assert choice["token_ids"] == r.response_ids[start:end]
            assert [c["logprob"] for c in choice["logprobs"]["content"]] == r.logprobs[start:end]
            assert response["usage"]["completion_tokens"] == end - start
            # the tokens between this turn and the next are the template's suffix only: never sampled
            suffix_end = r.turns[k + 1][0] if k + 1 < len(r.turns) else len(r.response_ids)
            assert all(m == 0 for m in r.action_mask[end:suffix_end])
            assert all(m == 1 for m in r.action_mask[start:end])
            assert set(r.policy_versions[end:suffix_end]) <= {-1}
            rebuilt += choice["token_ids"] + r.response_ids[end:suffix_end]
        assert rebuilt == tokens
        # the suffix after a turn cut by max_tokens starts with the end-of-turn token (never sampled)
        for (_, end), response in zip(r.turns[:-1], responses, strict=False):
            if response["choices"][0]["finish_reason"] == "length":
                assert r.response_ids[end] == tokenizer.convert_tokens_to_ids("<|im_end|>")


def test_logprobs_equal_one_hf_forward_over_the_transcript(actor, tokenizer):
    rollouts, failed, _ = run_agents(actor, tokenizer, "oppo", list(range(4)), max_tokens=10)
    assert failed == [] and len(rollouts) == 4
    for r in rollouts:
        assert_logprobs_equal_hf(actor, r.prompt_ids, r.response_ids, r.logprobs, r.action_mask)


def transcripts(rollouts, log) -> dict:
    return {
        task: (tuple(r.prompt_ids), tuple(r.response_ids), tuple(r.action_mask))
        for task, r in by_task(rollouts, log).items()
    }


def test_same_agents_and_seeds_give_the_same_transcripts_in_all_modes_in_process_and_over_http(
    actor, tokenizer
):
    seen = {}
    for mode in MODES:
        for in_process in (True, False):
            rollouts, failed, log = run_agents(actor, tokenizer, mode, list(range(5)), in_process=in_process)
            assert failed == [] and len(rollouts) == 5, (mode, in_process)
            seen[(mode, in_process)] = transcripts(rollouts, log)
    first = next(iter(seen.values()))
    for key, got in seen.items():
        assert got == first, key


def test_sampled_ids_are_reused_even_where_their_text_re_tokenises_to_other_ids(actor, tokenizer):
    rollouts, failed, log = run_agents(actor, tokenizer, "oppo", list(range(6)), max_tokens=12)
    assert failed == []
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    differing = 0
    for task, r in by_task(rollouts, log).items():
        for (start, end), response in zip(r.turns, log[task], strict=True):
            ids = r.response_ids[start:end]
            body = ids[:-1] if ids and ids[-1] == im_end else ids
            text = response["choices"][0]["message"]["content"] or ""
            if tokenizer.encode(text, add_special_tokens=False) != body:
                differing += 1
                assert response["choices"][0]["token_ids"] == ids  # the sampled ids, not a re-encoding
    # The agents sent these turns back as text in their next request, and the episode went on with the
    # sampled ids: a re-encoding server would have trained on other tokens.
    assert differing > 0, "no turn re-tokenised differently: the test proved nothing"


def test_the_chat_templates_end_of_turn_ends_the_turn_not_the_episode(actor, tokenizer):
    rollouts, failed, log = run_agents(actor, tokenizer, "sequential", list(range(6)), max_tokens=40)
    assert failed == []
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert im_end in make_engine(actor, tokenizer).eos_token_ids  # the model's EOS too
    stopped = [
        (r, start, end) for r in rollouts for start, end in r.turns[:-1] if r.response_ids[end - 1] == im_end
    ]
    # each of these turns was followed by the template's suffix and another turn: the episode went on
    assert stopped, "no turn ended on <|im_end|> before another turn: the test proved nothing"


def fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_nothing_leaks_after_close_pages_threads_fds(actor, tokenizer):
    run_agents(actor, tokenizer, "oppo", [0])  # warm up imports and lazily made objects
    threads, files = {t.name for t in threading.enumerate()}, fds()
    engine = make_engine(actor, tokenizer, "oppo")
    engine.serve()
    log: dict = {}
    engine.add_agents(make_agent(log), list(range(4)), in_process=False)
    rollouts, failed = drain(engine, 4)
    stats = engine.cache_stats()
    assert stats.free_pages == stats.total_pages and not failed
    engine.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (
        {t.name for t in threading.enumerate()} - threads or fds() > files
    ):
        time.sleep(0.05)
    assert {t.name for t in threading.enumerate()} - threads == set()
    assert fds() <= files


def test_tool_calls_are_parsed_with_deterministic_ids_and_sent_back(actor, tokenizer):
    # A random model rarely writes a tool call: the parser is checked on its own, then the whole path with a
    # parser that calls ``add`` on every turn (the replaceable parser).
    from oppo_engine.serve import hermes_tool_parser

    assert hermes_tool_parser('hi <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>') == (
        "hi ",  # the text outside the calls as it is (vLLM keeps the text before the first call so)
        [("add", {"a": 1, "b": 2})],
    )
    assert hermes_tool_parser('\n<tool_call>{"name": "add", "arguments": {}}</tool_call>\n') == (
        None,  # only whitespace outside the calls: no content
        [("add", {})],
    )
    assert hermes_tool_parser("<tool_call>{not json}</tool_call>") is None  # returned as text, never dropped
    assert hermes_tool_parser("plain") == ("plain", [])
    engine = make_engine(actor, tokenizer, "oppo")
    engine.serve(tool_parser=lambda text: (text or None, [("add", {"a": 1, "b": len(text)})]))
    log: dict = {}
    try:
        engine.add_agents(make_agent(log, tools=True), [0, 1])
        rollouts, failed = drain(engine, 2)
    finally:
        engine.close()
    assert failed == [] and len(rollouts) == 2
    for responses in log.values():
        for k, response in enumerate(responses):
            choice = response["choices"][0]
            assert choice["message"]["tool_calls"][0]["id"] == f"call_{k}_0"
            assert choice["finish_reason"] in ("tool_calls", "length")


def test_an_agent_that_raises_ends_its_episode_in_failed_with_the_error_named(actor, tokenizer):
    engine = make_engine(actor, tokenizer, "oppo")
    engine.serve()

    async def agent(task, client):
        messages = [{"role": "user", "content": f"task {task}"}]
        await client.chat.completions.create(model="m", messages=messages, max_tokens=4)
        if task == 1:
            raise KeyError("the tool is gone")
        return 1.0

    try:
        engine.add_agents(agent, [0, 1, 2])
        rollouts, failed = drain(engine, 3)
    finally:
        engine.close()
    assert len(rollouts) == 2 and len(failed) == 1
    assert "KeyError" in failed[0].error and "the tool is gone" in failed[0].error


def test_a_silent_agent_fails_its_episode_after_env_timeout_and_then_gets_410(actor, tokenizer):
    import openai

    engine = make_engine(actor, tokenizer, "oppo", env_timeout_s=0.5)
    handle = engine.serve()
    episode = handle.open_episode()
    answers = {}

    async def talk():
        client = handle.client(handle.episodes[episode.id], in_process=False)
        messages = [{"role": "user", "content": "hello"}]
        first = await client.chat.completions.create(model="m", messages=messages, max_tokens=4)
        answers["first"] = first
        await asyncio.sleep(1.5)  # silent past env_timeout_s
        messages += [{"role": "assistant", "content": first.choices[0].message.content}]
        messages += [{"role": "user", "content": "still there?"}]
        try:
            await client.chat.completions.create(model="m", messages=messages, max_tokens=4)
        except openai.APIStatusError as e:
            answers["late"] = e.status_code
        await client.close()

    t = threading.Thread(target=lambda: asyncio.run(talk()), daemon=True)
    t.start()
    try:
        rollouts, failed = drain(engine, 1)
        t.join(DEADLINE_S)
        assert not t.is_alive()
    finally:
        engine.close()
    assert rollouts == [] and len(failed) == 1 and "env_timeout_s" in failed[0].error
    assert answers["late"] == 410


def test_a_rolled_back_step_fails_the_episodes_whose_agents_had_answers(actor, tokenizer):
    import httpx2

    calls = []

    def flaky_reward(prompt, response):  # the first call fails once: the step is retried from its start
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("transient")
        return 1.0

    engine = RolloutEngine(
        actor, reward=flaky_reward, tokenizer=tokenizer,
        config=EngineConfig(batch_size=2, mode="sequential", max_model_len=1024, page_size=16),
        sampling=SamplingParams(max_new_tokens=48, seed=1),
    )  # fmt: skip
    handle = engine.serve()
    log: dict = {}
    try:
        engine.add_agents(make_agent(log, turns=2), [0, 1])
        rollouts, failed = drain(engine, 2)
        # Each agent had its answers before the reward failed: an agent cannot be rewound, so both episodes
        # fail (never silently replayed), and a later request to either gets 410.
        assert rollouts == [] and len(failed) == 2
        assert all("rewound" in f.error for f in failed), [f.error for f in failed]
        for episode in list(handle.episodes.values()):
            url = f"{handle.url}/episodes/{episode.id}/v1/chat/completions"
            body = {"messages": [{"role": "user", "content": "again"}]}
            response = httpx2.post(url, json=body, timeout=DEADLINE_S)
            assert response.status_code == 410 and response.headers["x-should-retry"] == "false"
    finally:
        engine.close()


def test_an_agent_restarted_by_a_diverging_request_gives_its_reward_to_the_new_episode(actor, tokenizer):
    # The agent keeps the id: its reward belongs to the episode now under it, not the one the restart ended
    # (which would leave the new one waiting until env_timeout_s, then failed, its reward lost).
    engine = make_engine(actor, tokenizer, "oppo", env_timeout_s=5.0)
    engine.serve(on_divergence="restart")
    prompts = {}

    async def agent(task, client):
        for k, text in enumerate(["hello", "hello again"]):  # the second does not extend the first
            r = await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": text}], max_tokens=4,
                extra_body={"return_token_ids": True},
            )  # fmt: skip
            prompts[k] = tuple(r.model_dump()["prompt_token_ids"])
        return 7.0

    start = time.monotonic()
    try:
        engine.add_agents(agent, [0])
        rollouts, failed = drain(engine, 2)
    finally:
        engine.close()
    assert failed == [] and time.monotonic() - start < 5.0
    by_prompt = {tuple(r.prompt_ids): r for r in rollouts}
    old, new = by_prompt[prompts[0]], by_prompt[prompts[1]]
    assert new.reward == 7.0 and new.finish_reason == "agent_done"
    assert old.reward == float(len(old.response_ids))  # ended by the restart: the reward function's


def test_closing_the_server_under_a_parked_async_env_step_fails_that_episode_and_step_returns(
    actor, tokenizer
):
    # The serving loop runs the engine's async environment calls; closing it cancels them. The call must
    # complete with an error (its episode in failed), or step() waits for it forever (no timeout once closed).
    parked = threading.Event()

    class Parked:
        def reset(self, prompt_ids):
            pass

        async def step(self, turn_ids):
            parked.set()
            await asyncio.Event().wait()  # never answers

    engine = make_engine(actor, tokenizer, "oppo")
    handle = engine.serve()
    engine.add_prompts(
        [[5, 6, 7, 8]], sampling=SamplingParams(max_new_tokens=24, max_turn_tokens=3, seed=1), envs=[Parked]
    )
    rollouts, failed = [], []

    def trainer() -> None:
        while len(rollouts) + len(failed) < 1:
            result = engine.step()
            rollouts.extend(result.rollouts)
            failed.extend(result.failed)

    t = threading.Thread(target=trainer, daemon=True)
    t.start()
    try:
        assert parked.wait(DEADLINE_S)
        handle.close()
        t.join(30.0)
        assert not t.is_alive(), "step() hung on an environment call its closed loop had cancelled"
    finally:
        if not t.is_alive():
            engine.close()
    assert rollouts == [] and len(failed) == 1 and "CancelledError" in failed[0].error, failed


def test_a_close_whose_loop_does_not_answer_still_gives_the_pool_socket_and_engine_back(
    actor, tokenizer, monkeypatch
):
    import oppo_engine.serve.server as server

    class Stuck:
        def clear(self):
            raise RuntimeError("stuck")  # shut() never reports done: close() times out

    engine = make_engine(actor, tokenizer, "oppo")
    handle = engine.serve()
    pool = engine._loop.envs.pool
    handle._agents = Stuck()
    monkeypatch.setattr(server, "_CLOSE_TIMEOUT_S", 0.5)
    try:
        with pytest.raises(TimeoutError):
            handle.close()
        assert engine._server is None and handle.sock.fileno() == -1
        assert pool.timeout_s is None and pool._own_loop and pool._loop is not handle.loop
    finally:
        handle._uvicorn.should_exit = True
        handle.thread.join(DEADLINE_S)
        engine.close()
    assert not handle.thread.is_alive()


def test_add_agents_from_many_threads_never_gives_two_tasks_one_index(actor, tokenizer, monkeypatch):
    engine = make_engine(actor, tokenizer, "oppo")
    handle = engine.serve()

    class Slow(type(handle)):  # reading the next index yields the thread: the race window made wide
        @property
        def _next_task_index(self):
            value = self._index
            time.sleep(0.001)
            return value

        @_next_task_index.setter
        def _next_task_index(self, value):
            self._index = value

    handle._index = handle.__dict__.pop("_next_task_index")
    monkeypatch.setattr(handle, "__class__", Slow)
    monkeypatch.setattr(handle, "run", lambda fn: None)  # the indices only: no agent starts

    async def agent(task, client):
        return None

    def caller() -> None:
        for _ in range(20):
            handle.add_agents(agent, [0, 1])

    threads = [threading.Thread(target=caller) for _ in range(4)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(DEADLINE_S)
    finally:
        monkeypatch.undo()
        engine.close()
    assert handle._index == 4 * 20 * 2  # no update lost: every task its own index, its own seed


def test_state_dict_refuses_while_agent_episodes_are_in_flight_and_saves_once_they_are_back(actor, tokenizer):
    """An agent cannot be saved, nor restarted from a checkpoint: ``state_dict()`` raises a ``ValueError``
    naming them while agents of ``add_agents`` run and while a served episode has a sequence in the engine
    (queued, or carried between steps), rather than save a state that drops them; once every episode is back
    from ``step()``, it saves, and the state loads."""
    engine = make_engine(actor, tokenizer, "oppo")
    handle = engine.serve()
    try:
        engine.add_agents(make_agent({}, turns=2), [0, 1])
        with pytest.raises(ValueError, match=r"agent episodes are in flight .*2 agents of add_agents"):
            engine.state_dict()
        rollouts, failed = [], []
        while not (rollouts or failed):  # a step that returns some, with the other carried or running
            result = engine.step()
            rollouts, failed = result.rollouts, result.failed
        got = len(rollouts) + len(failed)
        if got < 2:  # the other runs (refused), or is carried finished (saved whole: nothing lost)
            other_finished = any(s.status is SeqStatus.FINISHED for s in engine._buffer.carried)
            if not other_finished:
                with pytest.raises(ValueError, match="agent episodes are in flight"):
                    engine.state_dict()
            more, more_failed = drain(engine, 2 - got)
            rollouts, failed = rollouts + more, failed + more_failed
        assert len(rollouts) == 2 and not failed
        # an episode of open_episode whose first request is queued: a sequence in the engine
        episode = handle.open_episode()
        asked = threading.Thread(target=lambda: _ask_once(episode.base_url), daemon=True)
        asked.start()
        deadline = time.monotonic() + DEADLINE_S
        while handle.run(lambda: handle.episodes[episode.id].state) != "generating":
            assert time.monotonic() < deadline, "the request was not queued"
            time.sleep(0.01)
        with pytest.raises(ValueError, match=r"\(1 with a sequence in the engine, 0 agents"):
            engine.state_dict()
        episode.finish(1.0)  # (answered within the step below, then finished)
        assert len(drain(engine, 1)[0]) == 1
        asked.join(DEADLINE_S)
        state = engine.state_dict()  # nothing in flight: saved
    finally:
        engine.close()
    _load_into_a_fresh_engine(actor, tokenizer, state)


def test_state_dict_saves_a_carried_finished_agent_episode_whole():
    """A finished sequence is saved whole (``save_sequence``: tokens, reward), so a served episode's carried
    beyond the batch (oppo mode) loses nothing: ``refuse_agents`` counts only episodes still under way.
    Before, a carried finished episode (its factory ``rewindable = False``) refused the checkpoint."""

    def factory():
        raise AssertionError("never made")

    factory.rewindable = False
    engine = SimpleNamespace(_server=None)

    def entry(finished: bool) -> dict:
        return {"episode": {"factory": factory}, "finished": finished}

    state = {"carried": [entry(True)], "prompts": {"requeued": [entry(True)], "pending_envs": []}}
    refuse_agents(engine, state)  # finished: nothing to refuse
    state["carried"].append(entry(False))
    with pytest.raises(ValueError, match=r"\(1 with a sequence in the engine, 0 agents"):
        refuse_agents(engine, state)


def test_state_dict_saves_once_every_agent_s_episode_is_back_while_their_clients_close(
    actor, tokenizer, monkeypatch
):
    """An agent whose episode came back from ``step()`` is no longer in flight, though its task still closes
    its client: before, ``agents_in_flight()`` counted the task until it ended, and ``state_dict()`` right
    after the step raised. The client's close is made slow to hold the task open."""
    import openai

    close = openai.AsyncOpenAI.close
    closing = threading.Event()

    async def slow_close(self):
        closing.set()
        await asyncio.sleep(3.0)
        await close(self)

    monkeypatch.setattr(openai.AsyncOpenAI, "close", slow_close)
    engine = make_engine(actor, tokenizer, "oppo")
    handle = engine.serve()
    try:
        engine.add_agents(make_agent({}, turns=1), [0, 1])
        assert handle.agents_in_flight() == 2
        rollouts, failed = drain(engine, 2)
        assert len(rollouts) == 2 and not failed
        deadline = time.monotonic() + 1.0  # (the agents' tasks reach their end on the serving loop)
        while handle.agents_in_flight() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert closing.wait(1.0) and handle.agents_in_flight() == 0
        state = engine.state_dict()  # every episode is back: saved (before: a ValueError)
    finally:
        engine.close()
    _load_into_a_fresh_engine(actor, tokenizer, state)


def _ask_once(base_url: str) -> None:
    import openai

    with openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=DEADLINE_S) as client:
        client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=1.0
        )


def _load_into_a_fresh_engine(actor, tokenizer, state: dict) -> None:
    """A saved state loads into a new engine of the same settings."""
    loaded = make_engine(actor, tokenizer, "oppo")
    try:
        loaded.load_state_dict(state)
    finally:
        loaded.close()
