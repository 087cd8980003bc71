"""A client that disconnects while its plain ``/v1`` request (an evaluation: side work of the step loop) is
still being decoded: its sequence leaves the actor at the next forward, its KV pages are freed, and the
step's own sequences come out exactly as in a step without it.

The decode is held at a deterministic point, not raced against the clock: a forward pre-hook on the actor
(the HF model itself, not a stand-in for the engine) blocks the forward in which the evaluation has its
eighth token until the server has seen its client go (or a deadline passes), so the client's disconnect
always lands mid-decode, with 192 of its ``max_tokens`` still to go. Over a real 127.0.0.1 socket.

An episode's client that goes away mid-turn, streamed or not: the episode fails, and its sequence leaves the
actor the same way, at the next forward (``AgentEnv.decoded`` raises), not when its turn would end."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx2
import pytest
from serve_stepper import Stepper

from oppo_engine import EngineConfig, RolloutEngine, SamplingParams

DEADLINE_S = 60.0
GATE_TOKENS = 8  # the evaluation's tokens when its decode is held
MAX_TOKENS = 200
PROMPTS = [[11, 12, 13, 14], [21, 22, 23]]


async def _post_and_leave_when_held(
    http: httpx2.AsyncClient, path: str, body: dict, held: threading.Event, outcome: dict
) -> None:
    """POST ``body``; once the server's decode is ``held``, the client goes away (its connection closed:
    ``outcome["gone"]``). An answer that came first is ``outcome["answer"]``."""
    post = asyncio.ensure_future(http.post(path, json=body))
    while not held.is_set():
        if post.done():
            outcome["answer"] = post.result()
            return
        await asyncio.sleep(0.01)
    post.cancel()
    outcome["gone"] = True


def make_engine(actor, tokenizer) -> RolloutEngine:
    return RolloutEngine(
        actor, reward=lambda p, r: float(len(r)), tokenizer=tokenizer,
        # B = 4 over two prompts: the actor has room (B + Δ sequences) for the evaluation beside them
        config=EngineConfig(batch_size=4, mode="sequential", max_model_len=512, page_size=16),
        # longer than the gate: the step's own sequences are still decoding when the evaluation is dropped
        sampling=SamplingParams(max_new_tokens=24, ignore_eos=True, seed=5),
    )  # fmt: skip


def test_a_client_that_disconnects_mid_evaluation_has_its_sequence_dropped_and_pages_freed(actor, tokenizer):
    reference = make_engine(actor, tokenizer)  # the step's own work, without the evaluation
    reference.add_prompts(PROMPTS)
    expected = {tuple(r.prompt_ids): (r.response_ids, r.logprobs) for r in reference.step().rollouts}
    reference.close()

    engine = make_engine(actor, tokenizer)
    handle = engine.serve()
    cache = engine._caches["actor"]
    seen: dict = {"seq": None, "held_s": None, "in_cache_after": []}
    held = threading.Event()

    def gate(module, args) -> None:
        """On the actor thread, before each forward of the engine's step."""
        if seen["held_s"] is not None:
            seen["in_cache_after"].append(seen["seq"].seq_id in cache)
            return
        running = list(handle.evals.running.values())
        if running and len(running[0].seq.response_ids) >= GATE_TOKENS:
            seen["seq"] = running[0].seq
            held.set()  # the client goes away now
            t0 = time.monotonic()
            while handle.eval_calls and time.monotonic() - t0 < 10.0:  # until the server saw the client go
                time.sleep(0.01)
            seen["held_s"] = time.monotonic() - t0

    outcome: dict = {}

    async def ask() -> None:
        body = {"prompt": [7, 8, 9], "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0.0}
        async with httpx2.AsyncClient(base_url=handle.url, timeout=DEADLINE_S) as http:
            await _post_and_leave_when_held(http, "/v1/completions", body, held, outcome)

    asker = threading.Thread(target=lambda: asyncio.run(ask()), daemon=True)
    hook = actor.register_forward_pre_hook(gate)
    try:
        asker.start()
        deadline = time.monotonic() + DEADLINE_S
        while not handle.evals.in_flight:  # queued: it joins the step below from its first forward
            assert time.monotonic() < deadline
            time.sleep(0.01)
        engine.add_prompts(PROMPTS)
        result = engine.step()
        asker.join(DEADLINE_S)
    finally:
        hook.remove()
    try:
        assert "gone" in outcome, outcome  # the client went away before any answer
        seq = seen["seq"]
        assert seq is not None and seen["held_s"] < 10.0, "the server never saw the client go"
        # dropped mid-decode: it took one more token in the held forward, then left the actor
        assert len(seq.response_ids) == GATE_TOKENS + 1 < MAX_TOKENS
        assert seen["in_cache_after"] and not any(seen["in_cache_after"]), "its pages outlived the drop"
        assert not handle.evals.in_flight and not handle.eval_calls
        # the step's own sequences: exactly what the step without the evaluation produced
        got = {tuple(r.prompt_ids): (r.response_ids, r.logprobs) for r in result.rollouts}
        assert got.keys() == expected.keys()
        for prompt, (ids, lps) in expected.items():
            assert got[prompt][0] == ids
            assert max(abs(a - b) for a, b in zip(got[prompt][1], lps, strict=True)) < 1e-5
        stats = engine.cache_stats()
        assert stats.free_pages == stats.total_pages  # no page leaked
    finally:
        engine.close()


@pytest.mark.parametrize("stream", [False, True])
def test_an_episode_whose_client_disconnects_mid_turn_fails_at_the_next_forward(actor, tokenizer, stream):
    """An episode's turn (``max_tokens`` 200), its client gone while the decode is held at the turn's eighth
    token: the episode fails, and its sequence leaves the actor at the next forward with its pages freed (not
    when its turn ends), in ``StepResult.failed`` with the disconnect named. Streamed, the client closes the
    stream after its first content; not streamed, it closes the connection (the server's disconnect poll)."""
    engine = RolloutEngine(
        actor, reward=lambda p, r: 0.0, tokenizer=tokenizer,
        config=EngineConfig(batch_size=1, mode="oppo", overcommit=1, max_model_len=512, page_size=16),
        sampling=SamplingParams(max_new_tokens=300, seed=5),
    )  # fmt: skip
    handle = engine.serve()
    episode = handle.open_episode()
    cache = engine._caches["actor"]
    seen: dict = {"seq": None, "held_s": None, "in_cache_after": []}
    held = threading.Event()

    def failed() -> bool:
        return handle.run(lambda: handle.episodes[episode.id].state) == "failed"

    def gate(module, args) -> None:
        """On the actor thread, before each forward of the engine's step."""
        if seen["held_s"] is not None:
            seen["in_cache_after"].append(seen["seq"].seq_id in cache)
            return
        running = [s for s in engine._loop.actor_sched.running if s.episode is not None]
        if running and len(running[0].response_ids) >= GATE_TOKENS:
            seen["seq"] = running[0]
            held.set()  # the client goes away now
            t0 = time.monotonic()
            while not failed() and time.monotonic() - t0 < 10.0:  # until the server saw the client go
                time.sleep(0.01)
            seen["held_s"] = time.monotonic() - t0

    outcome: dict = {}
    body = {
        "messages": [{"role": "user", "content": "what is 12 + 30 ?"}],
        "max_tokens": MAX_TOKENS, "temperature": 1.0, "seed": 11, "stream": stream,
    }  # fmt: skip

    async def ask() -> None:
        async with httpx2.AsyncClient(base_url=episode.base_url, timeout=DEADLINE_S) as http:
            if stream:
                async with http.stream("POST", "/chat/completions", json=body) as response:

                    async def read() -> None:
                        async for line in response.aiter_lines():
                            if '"content": "' in line and '"content": ""' not in line:
                                outcome["content"] = True  # streamed mid-turn

                    reader = asyncio.ensure_future(read())
                    while not held.is_set():
                        await asyncio.sleep(0.01)
                    reader.cancel()
                    outcome["gone"] = True  # the stream is closed while the decode is held
                return
            await _post_and_leave_when_held(http, "/chat/completions", body, held, outcome)

    asker = threading.Thread(target=lambda: asyncio.run(ask()), daemon=True)
    hook = actor.register_forward_pre_hook(gate)
    stepper = Stepper(engine)
    try:
        asker.start()
        stepper.wait_for(1)
        asker.join(DEADLINE_S)
    finally:
        hook.remove()
        stepper.stop()
    try:
        assert "gone" in outcome and ("content" in outcome or not stream), outcome
        seq = seen["seq"]
        assert seq is not None and seen["held_s"] < 10.0, "the server never saw the client go"
        # failed mid-turn: it took one more token in the held forward, then left the actor
        assert len(seq.response_ids) == GATE_TOKENS + 1 < MAX_TOKENS
        assert seq.seq_id not in cache and not any(seen["in_cache_after"]), "its pages outlived the failure"
        [lost] = stepper.failed
        assert lost.finish_reason == "error" and "client disconnected" in lost.error
        assert not stepper.rollouts
        stats = engine.cache_stats()
        assert stats.free_pages == stats.total_pages  # no page leaked
    finally:
        engine.close()
