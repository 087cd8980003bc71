"""Evaluation requests: sequences the actor decodes while a step runs, beside the step's own, that are never
part of it -- a served endpoint's plain ``/v1`` requests (``oppo_engine/serve``). They never become a
``Rollout``, never take a place of the batch (B) or of the step's admission (B + Δ), are never handed to the
scorers, and their pages are freed when they finish.

An evaluation sequence has a negative ``seq_id`` (the step's sequences count up from 0, so the two never
share a cache entry). One that has not finished when its step ends keeps its tokens and gives its pages
back; the next step prefills it again and goes on (a policy update in between: its later tokens come from the
new weights, as a carried sequence's under ``retained_kv="reuse"``). A step that is rolled back, or an engine
that closes, fails the evaluations in flight: ``done(None, message)``.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable

from oppo_engine.config import SamplingParams
from oppo_engine.sched.prompts import derive_seed
from oppo_engine.sched.sequence import SeqStatus, Sequence

# ``done(seq, None)`` when ``seq`` finished (``response_ids``, ``logprobs``, ``finish_reason`` read), or
# ``done(None, error)``; called on the actor thread.
EvalDone = Callable[[Sequence | None, str | None], None]
_SEED_SALT = 0x3C6EF372FE94F82B  # an evaluation's default seed never replays a prompt's


class EvalRequests:
    """The evaluation sequences of one engine. ``add`` and ``cancel`` are safe from any thread; the rest is
    the actor thread's (the step loop's)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: deque[tuple[int, list[int], SamplingParams, EvalDone]] = deque()
        self._cancelled: set[int] = set()
        self._next = 0
        self.running: dict[int, tuple[Sequence, EvalDone]] = {}  # seq_id -> (sequence, done), across steps
        self.on_add: Callable[[], None] | None = None  # called after add (PromptQueue.wake: a waiting take)

    def add(self, prompt_ids: list[int], sampling: SamplingParams, done: EvalDone) -> int:
        """Queue one evaluation (checked by the caller against the vocabulary and ``max_model_len``); returns
        its id, for ``cancel``. Its seed is ``sampling.seed``, else derived from its id."""
        with self._lock:
            self._next += 1
            self._pending.append((self._next, list(prompt_ids), sampling, done))
            eval_id = self._next
        if self.on_add is not None:
            self.on_add()
        return eval_id

    def cancel(self, eval_id: int) -> None:
        """Drop evaluation ``eval_id`` (its client went away): its pages are freed at the next forward."""
        with self._lock:
            self._cancelled.add(eval_id)

    def take(self) -> tuple[list[Sequence], list[Sequence]]:
        """``(new, dropped)``: the evaluations queued since the last call, as new sequences (the step loop
        adds them to the actor), and those cancelled since (it takes them out and frees their pages)."""
        if not (self._pending or self._cancelled):
            return [], []
        with self._lock:
            pending, self._pending = list(self._pending), deque()
            cancelled, self._cancelled = self._cancelled, set()
        dropped = [self.running.pop(-i)[0] for i in cancelled if -i in self.running]
        seqs = []
        for eval_id, prompt, sampling, done in pending:
            if eval_id in cancelled:
                continue
            seed = sampling.seed if sampling.seed is not None else derive_seed(_SEED_SALT, eval_id)
            seq = Sequence(-eval_id, -eval_id, prompt, sampling, seed)
            self.running[seq.seq_id] = (seq, done)
            seqs.append(seq)
        return seqs, dropped

    @property
    def in_flight(self) -> bool:
        """Evaluations queued or decoding (a step with no batch of its own decodes them to the end)."""
        return bool(self.running or self._pending)

    def unfinished(self) -> list[Sequence]:
        """The evaluations carried from the last step (their KV was given back: they prefill again)."""
        return [seq for seq, _ in self.running.values()]

    def finished(self, seq: Sequence) -> None:
        """``seq`` has its last token: its requester is answered."""
        entry = self.running.pop(seq.seq_id, None)
        if entry is not None:
            entry[1](seq, None)

    def step_ended(self, seqs: list[Sequence], free: Callable[[int], None]) -> None:
        """The step ended with ``seqs`` (evaluations among the actor's unfinished) still decoding: their
        pages go back, their tokens stay (``free(seq_id)``: the actor cache's)."""
        for seq in seqs:
            free(seq.seq_id)
            seq.num_computed, seq.status = 0, SeqStatus.WAITING

    def fail(self, message: str, free: Callable[[int], None], *, queued: bool = False) -> None:
        """Every evaluation decoding (``queued``: and queued) fails with ``message`` (a step rolled back, a
        close)."""
        pending = []
        if queued:
            with self._lock:
                pending, self._pending = list(self._pending), deque()
        running, self.running = list(self.running.values()), {}
        for seq, done in running:
            free(seq.seq_id)
            done(None, message)
        for _, _, _, done in pending:
            done(None, message)


def is_eval(seq: Sequence) -> bool:
    """``seq`` is an evaluation, not one of the step's sequences."""
    return seq.seq_id < 0
