"""A step rolled back while a turn streams, end to end: the official ``openai`` client over a real 127.0.0.1
socket, the engine's own quarantine (``sched/quarantine.py``) set off by an actor forward that raises (the
failure is injected in the engine's actor forward, the same way tests/test_reliability.py injects one).

- A retried step (one failure): an episode's client gets exactly the tokens of the attempt that commits,
  which are the rollout's; a plain ``/v1`` request (side work, failed by any rollback) gets a clean error.
- A quarantine (a poison prompt that fails every time it decodes, beside an agent's streamed turn): the
  probes that isolate it never stream to the agent nor answer it (``AgentEnv.rewindable = False``), so the
  innocent episode survives and its client gets the committed attempt's exact tokens.

Every page comes back. Mid-stream is checked without racing the clock: the first failure waits until the
client has received content."""

from __future__ import annotations

import threading

import openai
import pytest
from serve_stepper import Stepper

from oppo_engine import EngineConfig, RolloutEngine, SamplingParams
from oppo_engine.serve.episode import AgentEnv

DEADLINE_S = 60.0
FAIL_AT = 8  # response tokens of the failing sequence when its forward raises
MAX_TOKENS = 40
POISON = [7, 7, 7, 7, 7, 7]
QUESTION = [{"role": "user", "content": "what is 12 + 30 ?"}]
COMMON = {"model": "m", "max_tokens": MAX_TOKENS, "temperature": 1.0, "seed": 11}


def make_engine(actor, tokenizer, chunk_size: int | str = "auto") -> RolloutEngine:
    config = EngineConfig(
        batch_size=2, mode="oppo", overcommit=2, max_model_len=256, page_size=16, chunk_size=chunk_size
    )
    return RolloutEngine(
        actor, reward=lambda p, r: 0.0, tokenizer=tokenizer, config=config,
        sampling=SamplingParams(max_new_tokens=64, seed=3),
    )  # fmt: skip


class FailingForward:
    """The engine's actor forward, raising (a retryable actor failure) in a forward where a sequence that
    ``fails(seq)`` has ``FAIL_AT`` response tokens or more: ``times`` times in all (``None``: every time). The
    first failure waits until the client has received content (``seen``)."""

    def __init__(self, engine, fails, times: int | None) -> None:
        self.engine, self.fails, self.times = engine, fails, times
        self.forward = engine._loop.actor.forward
        self.seen, self.raised, self.in_time = threading.Event(), 0, None
        engine._loop.actor.forward = self

    def __call__(self, chunks, specs):
        ids = {c.seq_id for c in chunks}
        for seq in list(self.engine._loop.actor_sched.running):
            start = seq.episode.turn_start if seq.episode is not None else 0
            if seq.seq_id in ids and self.fails(seq) and len(seq.response_ids) - start >= FAIL_AT:
                if self.times is None or self.raised < self.times:
                    if self.raised == 0:
                        self.in_time = self.seen.wait(10.0)
                    self.raised += 1
                    raise RuntimeError("injected actor failure")
        return self.forward(chunks, specs)


def _client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=DEADLINE_S)


def _stream_chat(client, seen: threading.Event) -> tuple[list[int], str, str | None]:
    """A streamed chat turn: its token ids, text and finish reason (``seen`` set at the first content)."""
    ids, text, finish = [], "", None
    stream = client.chat.completions.create(
        stream=True, messages=QUESTION, extra_body={"return_token_ids": True}, **COMMON
    )
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        ids += choice.model_extra.get("token_ids") or []
        text += choice.delta.content or ""
        finish = choice.finish_reason or finish
        if choice.delta.content:
            seen.set()
    return ids, text, finish


def _assert_pages_back(engine) -> None:
    stats = engine.cache_stats()
    assert stats.free_pages == stats.total_pages


def test_a_step_retried_mid_stream_streams_the_committed_attempt_s_exact_tokens(actor, tokenizer):
    engine = make_engine(actor, tokenizer)
    handle = engine.serve()
    episode = handle.open_episode()
    injected = FailingForward(engine, lambda seq: seq.episode is not None, times=1)
    stepper = Stepper(engine)
    client = _client(episode.base_url)
    try:
        ids, text, finish = _stream_chat(client, injected.seen)
        whole = client.chat.completions.create(  # a repeat: the answer the episode keeps
            messages=QUESTION, extra_body={"return_token_ids": True}, **COMMON
        )
        episode.finish(1.0)
        stepper.wait_for(1)
    finally:
        client.close()
        stepper.stop()
    try:
        assert injected.raised == 1 and injected.in_time, "the step did not fail mid-stream"
        assert not stepper.failed
        [rollout] = stepper.rollouts
        prompt = whole.model_extra["prompt_token_ids"]
        assert ids == whole.choices[0].model_extra["token_ids"] == rollout.response_ids[: len(ids)]
        assert list(rollout.prompt_ids) == prompt and len(ids) > FAIL_AT
        assert rollout.response_ids[len(ids) :] == []  # the agent finished after one turn
        assert text == whole.choices[0].message.content and finish == whole.choices[0].finish_reason
        _assert_pages_back(engine)
    finally:
        engine.close()


def test_a_plain_request_whose_step_is_retried_mid_stream_gets_a_clean_error(actor, tokenizer):
    """Side work is failed by any rollback (``sched/side.py``): the client's stream ends in an error, the
    request leaves the engine, and the retried step goes on."""
    engine = make_engine(actor, tokenizer)
    handle = engine.serve()
    injected = FailingForward(engine, lambda seq: seq.side is not None, times=1)
    stepper = Stepper(engine)
    client = _client(f"{handle.url}/v1")
    try:
        with pytest.raises(openai.APIError, match="rolled back"):
            _stream_chat(client, injected.seen)
        assert not handle.evals.in_flight
    finally:
        client.close()
        stepper.stop()
    try:
        assert injected.raised == 1 and injected.in_time
        _assert_pages_back(engine)
    finally:
        engine.close()


class DivergingRetry(FailingForward):
    """``FailingForward`` once, then the retry samples differently from the episode's turn token ``AT`` on
    (each token from there on is replaced by ``other``, an ordinary token other than the first attempt's at
    ``AT``: as a device whose kernels are not deterministic may decode a retry): a rolled-back step whose
    retry diverges at a token that went out long before. ``first``: the turn as the failed attempt had it."""

    AT = 2

    def __init__(self, engine, tokenizer) -> None:
        super().__init__(engine, lambda seq: seq.episode is not None, times=1)
        self.candidates = [tokenizer.convert_tokens_to_ids(t) for t in ("a", "b")]
        self.first: list[int] | None = None
        self.other: int | None = None

    def __call__(self, chunks, batch):
        running = {s.seq_id: s for s in self.engine._loop.actor_sched.running}
        if self.raised == 0:
            for seq in running.values():
                if seq.episode is not None:
                    self.first = seq.response_ids[seq.episode.turn_start :]
        tokens, logprobs = super().__call__(chunks, batch)
        if self.raised:
            tokens = list(tokens)
            for i, row in enumerate(batch.rows):
                seq = running.get(chunks[row].seq_id)
                if seq is not None and seq.episode is not None:
                    if len(seq.response_ids) - seq.episode.turn_start >= self.AT:
                        if self.other is None:
                            self.other = next(t for t in self.candidates if t != self.first[self.AT])
                        tokens[i] = self.other
        return tokens, logprobs


def test_a_retry_that_decodes_differently_a_token_sent_long_before_fails_the_episode_and_sends_no_more(
    actor, tokenizer
):
    """A step fails after the turn's first ``FAIL_AT`` tokens went out; its retry decodes token ``AT`` (sent
    many forwards before) differently. The stream cannot be taken back: the episode fails with
    ``ROLLED_BACK`` as the retry decodes that token (``AgentEnv.decoded``, told of the rollback by
    ``EnvDriver.rewound``), and nothing of the diverged retry goes out. Without the rollback's notice the
    retry's tokens beyond those sent went out, and the turn failed only at its end."""
    from oppo_engine.serve.stream import ROLLED_BACK

    engine = make_engine(actor, tokenizer)
    handle = engine.serve()
    episode = handle.open_episode()
    injected = DivergingRetry(engine, tokenizer)
    stepper = Stepper(engine)
    client = _client(episode.base_url)
    ids: list[int] = []
    try:
        with pytest.raises(openai.APIError, match="rolled back and decoded differently") as raised:
            stream = client.chat.completions.create(
                stream=True, messages=QUESTION, extra_body={"return_token_ids": True}, **COMMON
            )
            for chunk in stream:
                if chunk.choices:
                    ids += chunk.choices[0].model_extra.get("token_ids") or []
                    if chunk.choices[0].delta.content:
                        injected.seen.set()
        assert ROLLED_BACK in str(raised.value)
        stepper.wait_for(1)
    finally:
        client.close()
        stepper.stop()
    try:
        assert injected.raised == 1 and injected.in_time, "the step did not fail mid-stream"
        first = injected.first
        assert len(first) >= FAIL_AT > DivergingRetry.AT and injected.other != first[DivergingRetry.AT]
        assert ids == first[: len(ids)] and len(ids) >= FAIL_AT - 1, "the stream is not the first attempt's"
        [failed] = stepper.failed
        assert ROLLED_BACK in failed.error and not stepper.rollouts
        _assert_pages_back(engine)
    finally:
        engine.close()


@pytest.mark.parametrize("chunk_size", ["auto", 1])
def test_quarantine_probes_never_stream_to_nor_answer_an_agent_and_its_episode_survives(
    actor, tokenizer, monkeypatch, chunk_size
):
    """A poison prompt beside an agent's streamed turn fails every time it decodes: the step is retried,
    then probes isolate it. Before ``rewindable = False``, the probe of the agent's half streamed its turn
    and answered it, and the rollback after the probe then failed the innocent episode. ``chunk_size=1``:
    the probe that sets the agent's sequence aside drops it from the scorer lane, and no hand-off of it may
    follow (before the fix one did, at the same token: a worker taking its inbox between the two re-added
    the sequence, and the lane then waited for it until it stalled)."""
    engine = make_engine(actor, tokenizer, chunk_size)
    posts: list[tuple[int, int, bool]] = []  # (seq id, upto, drop) of each scorer-lane post, in order
    lane = engine._loop.scorer_lane
    post = lane._post

    def recorded_post(item):
        posts.append((item.seq.seq_id, item.upto, item.drop))
        return post(item)

    lane._post = recorded_post
    handle = engine.serve()
    episode = handle.open_episode()
    injected = FailingForward(engine, lambda seq: list(seq.prompt_ids) == POISON, times=None)
    runs: list[bool] = []  # each run of the step loop: committing (True) or a quarantine probe (False)
    run = engine._loop.run

    def recorded_run(*args, commit: bool = True, **kwargs):
        runs.append(commit)
        return run(*args, commit=commit, **kwargs)

    heard: list[bool] = []  # the run each AgentEnv.decoded call came in
    decoded = AgentEnv.decoded

    def recorded_decoded(self, *args):
        heard.append(runs[-1])
        return decoded(self, *args)

    engine._loop.run = recorded_run
    monkeypatch.setattr(AgentEnv, "decoded", recorded_decoded)
    client = _client(episode.base_url)
    got: dict = {}

    def agent() -> None:
        try:
            got["turn"] = _stream_chat(client, injected.seen)
            episode.finish(1.0)
        except BaseException as e:
            got["error"] = e

    thread = threading.Thread(target=agent, daemon=True)
    thread.start()
    stepper = None
    try:
        while episode_state(handle, episode.id) != "generating":  # queued first: one step holds both
            assert thread.is_alive(), got
            threading.Event().wait(0.01)
        engine.add_prompts([POISON], sampling=SamplingParams(max_new_tokens=24, seed=5, ignore_eos=True))
        stepper = Stepper(engine)
        thread.join(DEADLINE_S)
        assert not thread.is_alive()
        stepper.wait_for(2)
    finally:
        if stepper is not None:
            stepper.stop()
        client.close()
    try:
        assert False in runs, "no quarantine probe ran"
        for i, (seq_id, _, drop) in enumerate(posts):
            later = [upto for s, upto, _ in posts[i + 1 :] if s == seq_id]
            if drop and later:
                assert later[0] == 0, "a hand-off of a sequence followed its drop (not its re-add)"
        if chunk_size == 1:
            assert any(drop for _, _, drop in posts), "no probe set the agent's sequence aside"
        assert False not in heard, "a probe's tokens were streamed to the agent"
        assert "error" not in got, got.get("error")
        ids, text, finish = got["turn"]
        [quarantined] = stepper.failed
        assert list(quarantined.prompt_ids) == POISON and "injected actor failure" in quarantined.error
        [rollout] = stepper.rollouts
        assert rollout.finish_reason == "agent_done" and rollout.reward == 1.0
        assert ids == rollout.response_ids and len(ids) > FAIL_AT
        assert injected.in_time
        _assert_pages_back(engine)
    finally:
        engine.close()


def episode_state(handle, episode_id: str) -> str:
    """The served episode's state, read on the serving loop."""
    return handle.run(lambda: handle.episodes[episode_id].state)
