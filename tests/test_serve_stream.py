"""Token-by-token streaming of plain ``/v1`` requests (``stream: true``), with the official ``openai`` client
over a real 127.0.0.1 socket: the chunks concatenate to the non-streamed answer for the same seed (text,
token ids, log-probs), ``prompt_token_ids`` comes in the first chunk only, the finish reason in the last,
and content reaches the client while the turn is still being decoded.

"While it is decoded" is checked without racing the clock: a forward pre-hook on the actor (the HF model,
not a stand-in for the engine) holds the forward in which the request has its tenth token until the client
has received a chunk with content, or a deadline passes; a turn delivered whole never reaches the client
before its end, so the hold would time out."""

from __future__ import annotations

import threading
import time

import openai
import pytest
from hf_check import assert_logprobs_equal_hf
from serve_models import RecordedServing
from serve_stepper import Stepper

from oppo_engine import EngineConfig, RolloutEngine, SamplingParams
from oppo_engine.serve.stream import TextDeltas

DEADLINE_S = 60.0
HOLD_AT = 10  # tokens of the streamed request when its decode is held
MAX_TOKENS = 40


def make_engine(actor, tokenizer, max_len: int = 256) -> RolloutEngine:
    return RolloutEngine(
        actor, reward=lambda p, r: 0.0, tokenizer=tokenizer,
        config=EngineConfig(batch_size=2, mode="oppo", overcommit=2, max_model_len=max_len, page_size=16),
        sampling=SamplingParams(max_new_tokens=24, seed=3),
    )  # fmt: skip


class Hold:
    """Holds the forward in which the streamed turn (the only sequence decoding) has ``HOLD_AT`` tokens until
    ``seen`` is set."""

    def __init__(self, engine) -> None:
        self.engine, self.seen, self.held, self.in_time = engine, threading.Event(), False, None

    def __call__(self, module, args) -> None:
        for seq in list(self.engine._loop.actor_sched.running):
            start = seq.episode.turn_start if seq.episode is not None else 0
            if not self.held and len(seq.response_ids) - start >= HOLD_AT:
                self.held = True
                self.in_time = self.seen.wait(10.0)


def chat_chunks(client, hold: Hold, **kwargs) -> list:
    chunks = []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        chunks.append(chunk)
        if chunk.choices and chunk.choices[0].delta.content:
            hold.seen.set()
    return chunks


def _close_without_leak(engine) -> None:
    """Every page is back; the engine is closed whatever the check says."""
    try:
        stats = engine.cache_stats()
        assert stats.free_pages == stats.total_pages
    finally:
        engine.close()


def _client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=DEADLINE_S)


def _long_stream(client: openai.OpenAI):
    """A streamed plain completion of 200 tokens (``ignore_eos``): still decoding after its first chunk."""
    return client.completions.create(
        model="m", prompt=[5, 17, 42, 99], max_tokens=200, stream=True, extra_body={"ignore_eos": True}
    )


@pytest.mark.parametrize("where", ["plain", "episode"])
@pytest.mark.parametrize("kind", ["chat", "completions"])
def test_streamed_chunks_concatenate_to_the_answer_and_arrive_mid_turn(actor, tokenizer, kind, where):
    """A plain request, and an episode's turn: the non-streamed answer to compare with is the same request
    again (for an episode, a retry: the same turn)."""
    engine = make_engine(actor, tokenizer)
    handle = engine.serve()
    stepper = Stepper(engine)
    episode = handle.open_episode() if where == "episode" else None  # its seed: the request's
    base_url = episode.base_url if episode is not None else f"{handle.url}/v1"
    client = _client(base_url)
    hold = Hold(engine)
    # a plain request decodes all MAX_TOKENS; an episode's turn (no ignore_eos) may end at its end of turn
    extra = {"return_token_ids": True} | ({"ignore_eos": True} if episode is None else {})
    hook = actor.register_forward_pre_hook(hold)
    common = {"model": "m", "max_tokens": MAX_TOKENS, "temperature": 1.0, "seed": 11}
    try:
        if kind == "chat":
            args = dict(messages=[{"role": "user", "content": "what is 12 + 30 ?"}], logprobs=True,
                        extra_body=extra)  # fmt: skip
            chunks = chat_chunks(client, hold, stream_options={"include_usage": True}, **common, **args)
            whole = client.chat.completions.create(**common, **args)
        else:
            args = dict(prompt=[5, 17, 42, 99], logprobs=1, extra_body=extra)
            chunks = []
            for chunk in client.completions.create(stream=True, stream_options={"include_usage": True},
                                                   **common, **args):  # fmt: skip
                chunks.append(chunk)
                if chunk.choices and chunk.choices[0].text:
                    hold.seen.set()
            whole = client.completions.create(**common, **args)
        if episode is not None:
            episode.finish(1.0)
            stepper.wait_for(1)
    finally:
        hook.remove()
        client.close()
        stepper.stop()
    try:
        assert hold.held and hold.in_time, "no content reached the client before the turn ended"
        choices = [c.choices[0] for c in chunks if c.choices]
        dumps = [c.model_dump() for c in chunks]
        ids_per_chunk = [ch.model_extra.get("token_ids") or [] for ch in choices]
        assert sum(bool(ids) for ids in ids_per_chunk) > 1  # token by token, not one chunk
        ids = [t for chunk_ids in ids_per_chunk for t in chunk_ids]
        # the finish reason in the last chunk only; the usage after it
        assert [ch.finish_reason for ch in choices] == [None] * (len(choices) - 1) + [
            whole.choices[0].finish_reason
        ]
        assert chunks[-1].usage.completion_tokens == len(ids) > HOLD_AT
        assert episode is not None or len(ids) == MAX_TOKENS
        if kind == "chat":
            prompt = whole.model_extra["prompt_token_ids"]
            assert dumps[0]["prompt_token_ids"] == prompt
            assert all(d.get("prompt_token_ids") is None for d in dumps[1:])
            assert choices[0].delta.role == "assistant"
            text = "".join(ch.delta.content or "" for ch in choices)
            assert text == whole.choices[0].message.content
            lps = [lp.logprob for ch in choices if ch.logprobs for lp in ch.logprobs.content]
            want = [lp.logprob for lp in whole.choices[0].logprobs.content]
            tokens = [lp.token for ch in choices if ch.logprobs for lp in ch.logprobs.content]
            assert tokens == [lp.token for lp in whole.choices[0].logprobs.content]
        else:
            prompt = whole.choices[0].model_extra["prompt_token_ids"]
            assert choices[0].model_extra["prompt_token_ids"] == prompt == [5, 17, 42, 99]
            assert all(ch.model_extra.get("prompt_token_ids") is None for ch in choices[1:])
            assert "".join(ch.text for ch in choices) == whole.choices[0].text
            lps = [lp for ch in choices if ch.logprobs for lp in ch.logprobs.token_logprobs]
            want = whole.choices[0].logprobs.token_logprobs
            offsets = [o for ch in choices if ch.logprobs for o in ch.logprobs.text_offset]
            assert offsets == whole.choices[0].logprobs.text_offset
        assert ids == whole.choices[0].model_extra["token_ids"]  # the same seed: the same tokens
        assert lps == pytest.approx(want, abs=1e-5)
        assert_logprobs_equal_hf(actor, prompt, ids, lps)
        stats = engine.cache_stats()
        assert stats.free_pages == stats.total_pages
    finally:
        engine.close()


def test_a_streamed_client_that_goes_away_drops_its_request(actor, tokenizer):
    """A streamed request whose client closes the stream mid-turn: its sequence leaves the actor (the
    response generator's cleanup cancels it) and every page comes back."""
    engine = make_engine(actor, tokenizer)
    handle = engine.serve()
    stepper = Stepper(engine)
    client = _client(f"{handle.url}/v1")
    try:
        stream = _long_stream(client)
        first = next(iter(stream))
        assert first.choices[0].finish_reason is None
        stream.close()  # the client goes away mid-turn
        deadline = time.monotonic() + DEADLINE_S
        while handle.evals.in_flight or handle.eval_calls:
            assert time.monotonic() < deadline, "the request outlived its client"
            time.sleep(0.01)
    finally:
        client.close()
        stepper.stop()
    _close_without_leak(engine)


@pytest.mark.parametrize("text", ["naïve café ✓ 日本語 🙂", "what is 12 + 30 ? the answer is 42 ."])
def test_text_deltas_concatenate_to_the_decoded_text_and_never_split_a_character(tokenizer, text):
    ids = tokenizer(text)["input_ids"]
    deltas = TextDeltas(tokenizer)
    parts = [deltas.push([t]) for t in ids[:-1]]
    parts.append(deltas.final(ids))
    assert "".join(parts) == tokenizer.decode(ids, skip_special_tokens=True) == text
    assert not any("\ufffd" in p for p in parts)
    if len(text.encode()) > len(text):  # multi-byte characters: some byte tokens were held back
        assert "" in parts[:-1]


def test_text_deltas_of_arbitrary_tokens_concatenate_to_the_whole_decode(tokenizer):
    """Random ids (specials, and byte tokens that never form valid UTF-8, included): pushed one or three at a
    time, the deltas and the final rest are the whole decode."""
    import random

    rng = random.Random(0)
    for step in (1, 3):
        ids = [rng.randrange(len(tokenizer)) for _ in range(300)]
        deltas = TextDeltas(tokenizer)
        parts = [deltas.push(ids[i : i + step]) for i in range(0, len(ids), step)]
        parts.append(deltas.final(ids))
        assert "".join(parts) == tokenizer.decode(ids, skip_special_tokens=True)


def test_a_streamed_turn_that_omits_the_episodes_tools_still_comes_with_its_tool_calls(actor, tokenizer):
    """An episode opened with ``tools`` keeps them; a later request may omit them. Its streamed turn is then a
    tool turn all the same: one chunk with the parsed ``tool_calls`` and the finish reason of the non-streamed
    answer (a raw ``<tool_call>`` text with finish ``stop`` would make the agent's next request,
    built from the stream, diverge from the history: 409)."""
    engine = make_engine(actor, tokenizer, max_len=1024)  # the template renders the tools at length
    handle = engine.serve(tool_parser=lambda text: (text or None, [("add", {"a": 1, "b": len(text)})]))
    stepper = Stepper(engine)
    episode = handle.open_episode()
    client = _client(episode.base_url)
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    common = {"model": "m", "max_tokens": 6, "temperature": 1.0, "seed": 11}
    try:
        messages = [{"role": "user", "content": "what is 12 + 30 ?"}]
        first = client.chat.completions.create(messages=messages, tools=tools, **common).choices[0].message
        assert first.tool_calls
        messages += [
            first.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": "42"},
        ]
        chunks = list(client.chat.completions.create(messages=messages, stream=True, **common))  # no tools
        whole = client.chat.completions.create(messages=messages, **common).choices[0]  # a retry: the same
        deltas = [c.choices[0] for c in chunks if c.choices]
        calls = [call for d in deltas for call in d.delta.tool_calls or []]
        assert [c.function.name for c in calls] == [c.function.name for c in whole.message.tool_calls]
        assert [c.id for c in calls] == [c.id for c in whole.message.tool_calls]
        assert deltas[-1].finish_reason == whole.finish_reason in ("tool_calls", "length")
        assert calls and all(d.finish_reason is None for d in deltas[:-1])
        assert "".join(d.delta.content or "" for d in deltas) == (whole.message.content or "")
        # the agent's next request, built from what it streamed, extends the history
        streamed = {"role": "assistant", "content": whole.message.content,
                    "tool_calls": [c.model_dump(exclude={"index"}) for c in calls]}  # fmt: skip
        messages += [streamed, {"role": "tool", "tool_call_id": calls[0].id, "content": "1"}]
        client.chat.completions.create(messages=messages, **common)
        episode.finish(1.0)
        stepper.wait_for(1)
    finally:
        client.close()
        handle.close()  # first: a step waits for an open episode's next request until it closes
        stepper.stop()
    _close_without_leak(engine)


def test_a_closed_server_leaves_the_step_loop_and_frees_its_requests_pages(actor, tokenizer):
    """serve(); close() with a streamed request decoding; serve(): the step loop polls one side-work source,
    the new server's; the closed one's request was dropped (not decoded on), and every page comes back."""
    engine = make_engine(actor, tokenizer)
    first = engine.serve()
    stepper = Stepper(engine)
    client = _client(f"{first.url}/v1")
    try:
        stream = _long_stream(client)
        chunks = iter(stream)
        assert next(chunks).choices[0].finish_reason is None  # decoding
        first.close()
        with pytest.raises(openai.APIError, match="the server closed"):
            list(chunks)
        second = engine.serve()
        deadline = time.monotonic() + DEADLINE_S
        while engine._loop.side_work != [second.evals] or first.evals.in_flight:
            assert time.monotonic() < deadline, "the closed server's requests are still decoded"
            time.sleep(0.01)
        with openai.OpenAI(base_url=f"{second.url}/v1", api_key="unused", max_retries=0) as again:
            extra = {"ignore_eos": True}
            answer = again.completions.create(model="m", prompt=[5, 17], max_tokens=4, extra_body=extra)
            assert answer.choices[0].finish_reason == "length"  # the new server's requests are decoded
        assert engine._loop.side_work == [second.evals]
    finally:
        client.close()
        first.close()
        stepper.stop()
    _close_without_leak(engine)


def test_a_retried_turn_streams_only_tokens_beyond_those_sent_and_fails_if_they_differ():
    """``AgentEnv.decoded`` after a rolled-back step: the retry's tokens at the positions already sent come
    again and are not sent twice; a retry that decoded one of them differently fails the episode (a chunk
    cannot be taken back), and nothing more goes out."""
    from oppo_engine.serve.episode import AgentEnv
    from oppo_engine.serve.stream import ROLLED_BACK

    served = RecordedServing()
    env = AgentEnv(served)
    lps = [-0.5] * 10
    env.decoded([9, 9, 1, 2, 3], lps, turn_start=2)  # an earlier turn, then this one's first 3 tokens
    env.rewound(3)  # rolled back to the turn's first token, retried: the same tokens so far
    env.decoded([9, 9, 1, 2], lps, turn_start=2)
    env.decoded([9, 9, 1, 2, 3, 4], lps, turn_start=2)
    assert served.calls == [("on_tokens", [1, 2, 3], lps[2:5]), ("on_tokens", [4], lps[5:6])]
    served.calls.clear()
    env.rewound(3)
    env.decoded([9, 9, 1, 7, 3, 4, 5], lps, turn_start=2)  # retried differently at a token that went out
    assert served.calls == [("fail", ROLLED_BACK)]
    env.decoded([9, 9, 1, 2, 3, 4, 5, 6, 7], lps, turn_start=7)  # the next turn streams from its start
    assert served.calls[-1] == ("on_tokens", [6, 7], lps[7:9])


def test_a_turn_whose_last_forward_differs_from_what_was_streamed_ends_in_an_error(tokenizer):
    """The turn's last forward never reaches ``decoded`` (the turn ends in it): ``TokenStream`` checks the
    whole turn against the tokens it sent, and sends an error (and fails the episode), never a last chunk
    that would not concatenate to the answer."""
    import asyncio
    import json
    from types import SimpleNamespace

    from oppo_engine.serve.requests import TurnRequest
    from oppo_engine.serve.stream import ROLLED_BACK, TokenStream

    server = SimpleNamespace(tokenizer=tokenizer, responses=SimpleNamespace(model="m"))
    fields = ("completions", "m", None, [5, 6], None, 8, None, None, None, (), False, False, "k")
    req = TurnRequest(*fields, stream=True)
    gone: list[str] = []

    async def events(turn: list[int]) -> list[str]:
        queue = asyncio.Queue()
        for event in (("tokens", [40, 41], [-1.0, -1.0]), ("done", turn, [-1.0] * len(turn), turn, "length")):
            queue.put_nowait(event)
        return [e async for e in TokenStream(server, req, "e-0", [5, 6], queue, gone.append).events()]

    same = asyncio.run(events([40, 41, 42]))
    assert same[-1] == "data: [DONE]\n\n" and gone == []
    differs = asyncio.run(events([40, 43, 42]))
    assert gone == [ROLLED_BACK] and "[DONE]" not in differs[-1]
    assert json.loads(differs[-1][len("data: ") :])["error"]["message"] == ROLLED_BACK


class _CleanUpTokenizer:
    """A tokenizer whose decode is not prefix-stable: it cleans up the space before a full stop (as HF's
    ``clean_up_tokenization_spaces``), so a space that went out alone is rewritten once a "." follows it. It
    counts the ids it decodes."""

    pieces = ["a", ".", " b", " c", " "]

    def __init__(self) -> None:
        self.decoded = 0

    def decode(self, ids, skip_special_tokens=False) -> str:
        self.decoded += len(ids)
        return "".join(self.pieces[i] for i in ids).replace(" .", ".")


def test_text_deltas_move_on_and_never_resend_text_when_a_decode_rewrites_what_went_out():
    tokenizer = _CleanUpTokenizer()
    deltas = TextDeltas(tokenizer)
    assert deltas.push([0]) == "a"
    assert deltas.push([4]) == " "
    assert deltas.push([1]) == "."  # " ." decodes as ".": what is new goes out, and the window moves on
    n = 400
    for _ in range(n):
        assert deltas.push([3]) == " c"
    assert deltas.read - deltas.prefix <= 2  # the window stays short: linear, not quadratic
    assert tokenizer.decoded < 10 * n
    ids = [0, 4, 1, *[3] * n]
    whole = tokenizer.decode(ids)
    sent = deltas.sent
    assert sent == "a ." + " c" * n and whole == "a." + " c" * n
    assert deltas.final(ids) == ""  # the text of every token went out: nothing again
    deltas.sent = sent
    assert deltas.final([*ids, 2]) == " b"  # only the text of the tokens beyond those
    deltas = TextDeltas(tokenizer)
    deltas.push([4])
    assert deltas.final([0, 1]) == "a."  # other tokens than those pushed: beyond the text the two share


TOOL_TURNS = [
    'I will add them.\n<tool_call>\n{"name": "add", "arguments": {"a": 12, "b": 30}}\n</tool_call>',
    '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>\n<tool_call>{"name": "add", "arguments": '
    '{"b": 2}}</tool_call>\n',  # two calls, only whitespace outside them: no content
    '  lead <tool_call>{"name": "add", "arguments": {}}</tool_call> between <tool_call>{"name": "add", '
    '"arguments": {"a": 3}}</tool_call> tail ',
    "before <tool_call>{not json}</tool_call> after",  # does not parse: the whole turn is text
    'text <tool_call>{"name": "add", "arguments": {}}',  # never closed: text
    "no call at all, then a partial tag <tool_ca",
    "\n\n",
    "naïve café ✓ 🙂 <tool_call>" + '{"name": "add", "arguments": {"a": 42}}</tool_call>',
]


@pytest.mark.parametrize("per_push", [1, 3])
@pytest.mark.parametrize("text", TOOL_TURNS)
def test_streamed_tool_calls_concatenate_to_the_non_streamed_message(tokenizer, text, per_push):
    """A chat turn with tools, streamed by ``TokenStream`` with the default Hermes parser, token by token (or
    three at a time): the content deltas concatenate to the non-streamed ``content`` (the text outside the
    calls; the whole text when a call does not parse), the ``delta.tool_calls`` are the non-streamed
    ``tool_calls`` (with their ``index``), the finish reason is the same, and text before a call that is
    surely content goes out before the turn ends."""
    import asyncio
    import json
    from types import SimpleNamespace

    from oppo_engine.serve import hermes_tool_parser
    from oppo_engine.serve.requests import TurnRequest
    from oppo_engine.serve.responses import Responses
    from oppo_engine.serve.stream import TokenStream

    responses = Responses(tokenizer, "m", hermes_tool_parser)
    server = SimpleNamespace(tokenizer=tokenizer, responses=responses)
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    fields = ("chat", "m", [{"role": "user", "content": "hi"}], None, tools, 64, None, None, None, (), False)
    req = TurnRequest(*fields, True, "k", stream=True)
    ids = tokenizer(text)["input_ids"]
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    turn = [*ids, tokenizer.convert_tokens_to_ids("<|im_end|>")]  # stopped at the end of turn

    async def chunks() -> list[dict]:
        queue = asyncio.Queue()
        for i in range(0, len(ids), per_push):
            queue.put_nowait(("tokens", ids[i : i + per_push], [-1.0] * len(ids[i : i + per_push])))
        queue.put_nowait(("done", turn, [-1.0] * len(turn), ids, "stop"))
        stream = TokenStream(server, req, "e-3", [5, 6], queue, print, tools=True, turn=3)
        events = [e async for e in stream.events()]
        assert events[-1] == "data: [DONE]\n\n"
        return [json.loads(e[len("data: ") :]) for e in events[:-1]]

    choices = [c["choices"][0] for c in asyncio.run(chunks())]
    message, finish = responses.chat_message(text, True, 3, "stop")
    content = "".join(c["delta"].get("content") or "" for c in choices)
    assert content == (message["content"] or "")
    calls = [call for c in choices for call in c["delta"].get("tool_calls", [])]
    assert calls == [{"index": i, **call} for i, call in enumerate(message.get("tool_calls", []))]
    assert [c["finish_reason"] for c in choices] == [None] * (len(choices) - 1) + [finish]
    assert [t for c in choices for t in c["token_ids"]] == turn
    parsed = hermes_tool_parser(text)
    if parsed is not None and parsed[1]:
        assert finish == "tool_calls" and calls[0]["id"] == "call_3_0"
    before = text.split("<tool_call>")[0]
    if before.strip() and "<tool_call>" in text:  # surely content: it went out before the last chunk
        assert "".join(c["delta"].get("content") or "" for c in choices[:-1]) == before


@pytest.mark.parametrize("where", ["plain", "episode"])
def test_a_turn_with_tools_streams_token_by_token_with_the_default_parser(actor, tokenizer, where):
    """Over the socket, with the official client: a chat turn with ``tools`` (the default Hermes parser, which
    streams) comes token by token, not whole, and its chunks concatenate to the non-streamed answer of the
    same seed (content, tool calls, token ids, finish reason)."""
    engine = make_engine(actor, tokenizer, max_len=1024)  # the template renders the tools at length
    handle = engine.serve()
    stepper = Stepper(engine)
    episode = handle.open_episode() if where == "episode" else None
    client = _client(episode.base_url if episode is not None else f"{handle.url}/v1")
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    ask = dict(model="m", messages=[{"role": "user", "content": "what is 12 + 30 ?"}], tools=tools,
               max_tokens=MAX_TOKENS, temperature=1.0, seed=11,
               extra_body={"return_token_ids": True})  # fmt: skip
    try:
        chunks = list(client.chat.completions.create(stream=True, **ask))
        whole = client.chat.completions.create(**ask).choices[0]  # an episode's: a retry, the same turn
        if episode is not None:
            episode.finish(1.0)
            stepper.wait_for(1)
    finally:
        client.close()
        stepper.stop()
    try:
        deltas = [c.choices[0] for c in chunks if c.choices]
        ids = [t for d in deltas for t in d.model_extra.get("token_ids") or []]
        assert sum(bool(d.model_extra.get("token_ids")) for d in deltas) > 1  # token by token, not whole
        assert ids == whole.model_extra["token_ids"]
        assert "".join(d.delta.content or "" for d in deltas) == (whole.message.content or "")
        calls = [c.model_dump(exclude={"index"}) for d in deltas for c in d.delta.tool_calls or []]
        assert calls == [c.model_dump() for c in whole.message.tool_calls or []]
        assert deltas[-1].finish_reason == whole.finish_reason
    finally:
        _close_without_leak(engine)
