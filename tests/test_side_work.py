"""Side work (``sched/side.py``) is an interface of the step loop, not a feature of the endpoint: a source
written here, with no server, is decoded beside a step's sequences and never becomes part of the step. Its
greedy answers are the HF forward's argmax, the step's rollouts are exactly those of a step without it, a step
with no batch of its own decodes it to the end, one not finished when its step ends goes on in the next with
its tokens kept, a closing engine fails it, and every page comes back."""

from __future__ import annotations

import pytest
from hf_check import hf_logprobs

from oppo_engine import EngineConfig, RolloutEngine, SamplingParams
from oppo_engine.sched.sequence import Sequence
from oppo_engine.sched.side import side_sequence

PROMPTS = [[11, 12, 13, 14], [21, 22, 23]]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)


class GreedySource:
    """A side-work source of the test: prompts decoded greedily, their answers kept."""

    def __init__(self) -> None:
        self.queue: list[list[int]] = []
        self.running: list[Sequence] = []
        self.answers: dict[tuple[int, ...], list[int]] = {}
        self.errors: list[str] = []
        self.forwards = 0
        self.closed = False  # its work is dropped at the next take

    @property
    def in_flight(self) -> bool:
        return bool(self.queue or self.running)

    def take(self) -> tuple[list[Sequence], list[Sequence]]:
        if self.closed:
            dropped, self.running, self.queue = self.running, [], []
            return [], dropped
        new = [side_sequence(self, p, GREEDY, seed=0) for p in self.queue]
        self.queue, self.running = [], self.running + new
        return new, []

    def carried(self) -> list[Sequence]:
        return list(self.running)

    def decoded(self) -> None:
        self.forwards += 1

    def finished(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.answers[tuple(seq.prompt_ids)] = list(seq.response_ids)

    def fail(self, message: str, *, queued: bool) -> list[Sequence]:
        running, self.running = self.running, []
        self.errors += [message] * len(running)
        if queued:
            self.queue = []
        return running


def make_engine(actor, tokenizer, max_new_tokens: int = 24) -> RolloutEngine:
    return RolloutEngine(
        actor, reward=lambda p, r: float(len(r)), tokenizer=tokenizer,
        config=EngineConfig(batch_size=4, mode="sequential", max_model_len=256, page_size=16),
        sampling=SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True, seed=5),
    )  # fmt: skip


def greedy(actor, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(hf_logprobs(actor, ids)[-1].argmax()))
    return ids[len(prompt) :]


def test_a_side_work_source_is_decoded_beside_the_step_and_never_part_of_it(actor, tokenizer):
    reference = make_engine(actor, tokenizer)
    reference.add_prompts(PROMPTS)
    expected = {tuple(r.prompt_ids): (r.response_ids, r.logprobs) for r in reference.step().rollouts}
    reference.close()

    engine = make_engine(actor, tokenizer)
    source = GreedySource()
    engine._loop.add_side_work(source)
    try:
        source.queue = [[7, 8, 9], [30, 31]]
        engine.add_prompts(PROMPTS)
        result = engine.step()
        got = {tuple(r.prompt_ids): (r.response_ids, r.logprobs) for r in result.rollouts}
        assert got.keys() == expected.keys()  # the step's own, none of the source's
        for prompt, (ids, lps) in expected.items():
            assert got[prompt][0] == ids
            assert got[prompt][1] == pytest.approx(lps, abs=1e-5)
        assert source.answers == {
            (7, 8, 9): greedy(actor, [7, 8, 9], 12),
            (30, 31): greedy(actor, [30, 31], 12),
        }
        assert source.forwards > 0 and not source.in_flight
        # a step with nothing of its own decodes the source's work to its end
        source.queue = [[40, 41, 42]]
        result = engine.step()
        assert result.rollouts == [] and source.answers[(40, 41, 42)] == greedy(actor, [40, 41, 42], 12)
        stats = engine.cache_stats()
        assert stats.free_pages == stats.total_pages
    finally:
        engine.close()


def test_side_work_not_finished_in_its_step_goes_on_in_the_next_with_its_tokens(actor, tokenizer):
    engine = make_engine(actor, tokenizer, max_new_tokens=4)  # the step's batch is done after 4 tokens
    source = GreedySource()
    engine._loop.add_side_work(source)
    try:
        source.queue = [[7, 8, 9]]
        engine.add_prompts(PROMPTS)
        engine.step()
        (carried,) = source.running  # unfinished: its tokens kept, its pages given back
        assert 0 < len(carried.response_ids) < GREEDY.max_new_tokens
        stats = engine.cache_stats()
        assert stats.free_pages == stats.total_pages
        engine.step()  # nothing of its own: it goes on, prefilled again, to its end
        assert source.answers == {(7, 8, 9): greedy(actor, [7, 8, 9], 12)} and not source.running
    finally:
        engine.close()


def test_closing_the_engine_fails_the_side_work_in_flight(actor, tokenizer):
    engine = make_engine(actor, tokenizer, max_new_tokens=4)
    source = GreedySource()
    engine._loop.add_side_work(source)
    source.queue = [[7, 8, 9]]
    engine.add_prompts(PROMPTS)
    engine.step()
    assert source.running
    engine.close()
    assert source.errors == ["the engine closed"] and not source.in_flight


def test_a_removed_source_leaves_once_its_work_is_dropped_and_frees_its_pages(actor, tokenizer):
    engine = make_engine(actor, tokenizer, max_new_tokens=4)
    source, other = GreedySource(), GreedySource()
    engine._loop.add_side_work(source)
    engine._loop.add_side_work(other)
    try:
        source.queue = [[7, 8, 9]]
        engine.add_prompts(PROMPTS)
        engine.step()
        assert source.running  # carried to the next step
        source.closed = True
        engine._loop.remove_side_work(source)
        assert engine._loop.side_work == [source, other]  # work in flight: it stays until dropped
        engine.step()  # nothing of its own: the side work is taken, dropped, and the source goes
        assert engine._loop.side_work == [other] and source.answers == {}
        other.queue = [[30, 31]]
        engine.step()
        assert other.answers == {(30, 31): greedy(actor, [30, 31], 12)}
        engine._loop.remove_side_work(other)  # nothing in flight: it goes at once
        assert engine._loop.side_work == []
        stats = engine.cache_stats()
        assert stats.free_pages == stats.total_pages
    finally:
        engine.close()
