"""The served endpoint's plain ``/v1`` requests as side work of the step loop (``sched/side.py``): decoded
while a step runs, beside its sequences, never part of it. ``add`` and ``cancel`` are safe from any thread;
the rest is the ``SideWork`` interface, called on the actor thread.

An evaluation's seed is its request's, else derived from its id (a salt of its own: it never replays a
prompt's). A streamed one (``add(..., progress=)``) hears of its tokens after every forward that appended
some; its last token comes with ``done``.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from oppo_engine.config import SamplingParams
from oppo_engine.sched.prompts import derive_seed
from oppo_engine.sched.sequence import Sequence
from oppo_engine.sched.side import side_sequence

# ``done(seq, None)`` when ``seq`` finished (``response_ids``, ``logprobs``, ``finish_reason`` read), or
# ``done(None, error)``; called on the actor thread.
EvalDone = Callable[[Sequence | None, str | None], None]
# ``progress(token_ids, logprobs)``: the tokens appended since the last call (not the last one: ``done``).
EvalProgress = Callable[[list[int], list[float]], None]
_SEED_SALT = 0x3C6EF372FE94F82B  # an evaluation's default seed never replays a prompt's


@dataclass(slots=True)
class _Running:
    seq: Sequence
    done: EvalDone
    progress: EvalProgress | None
    eval_id: int
    told: int = 0  # tokens handed to ``progress``


class EvalRequests:
    """The evaluation requests of one server: a ``SideWork`` source (``sched/side.py``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: deque[tuple[int, list[int], SamplingParams, EvalDone, EvalProgress | None]] = deque()
        self._cancelled: set[int] = set()
        self._next = 0
        self.running: dict[int, _Running] = {}  # eval id -> its sequence and callbacks, across steps
        self._streamed: list[_Running] = []  # those of running with a progress callback
        self.on_add: Callable[[], None] | None = None  # called after add (PromptQueue.wake: a waiting take)
        self.closed: str | None = None  # why it takes no more work (``close``)

    def add(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams,
        done: EvalDone,
        progress: EvalProgress | None = None,
    ) -> int:
        """Queue one evaluation (checked by the caller against the vocabulary and ``max_model_len``); returns
        its id, for ``cancel``. ``progress``: stream its tokens as they are decoded. Once closed it fails at
        once (``done(None, why)``)."""
        with self._lock:
            self._next += 1
            eval_id, closed = self._next, self.closed
            if closed is None:
                self._pending.append((eval_id, list(prompt_ids), sampling, done, progress))
        if closed is not None:
            done(None, closed)
            return eval_id
        if self.on_add is not None:
            self.on_add()
        return eval_id

    def cancel(self, eval_id: int) -> None:
        """Drop evaluation ``eval_id`` (its client went away): its pages are freed at the next forward."""
        with self._lock:
            self._cancelled.add(eval_id)

    def close(self, message: str) -> None:
        """Take no more work (the server closes; safe from any thread): the queued evaluations fail with
        ``message`` now; those decoding fail at the next ``take`` (the actor thread drops them and frees their
        pages), and ``StepLoop.remove_side_work`` lets the source go once it has none."""
        with self._lock:
            self.closed = message
            pending, self._pending = list(self._pending), deque()
        for _, _, _, done, _ in pending:
            done(None, message)

    # -- SideWork: the actor thread's side --------------------------------------------------------------

    @property
    def in_flight(self) -> bool:
        """Evaluations queued or decoding."""
        return bool(self.running or self._pending)

    def take(self) -> tuple[list[Sequence], list[Sequence]]:
        """The evaluations queued since the last call, as new sequences, and those cancelled since (closed:
        every one decoding, each failed)."""
        if not (self._pending or self._cancelled or (self.closed and self.running)):
            return [], []
        with self._lock:
            pending, self._pending = list(self._pending), deque()
            cancelled, self._cancelled = self._cancelled, set()
        closing = [self.running.pop(i) for i in list(self.running)] if self.closed else []
        for entry in closing:
            entry.done(None, self.closed)  # a no-op for a request answered already (cancelled)
        dropped = [self.running.pop(i).seq for i in cancelled if i in self.running]
        dropped += [entry.seq for entry in closing]
        seqs = []
        for eval_id, prompt, sampling, done, progress in pending:
            if eval_id in cancelled:
                continue
            seed = sampling.seed if sampling.seed is not None else derive_seed(_SEED_SALT, eval_id)
            seq = side_sequence(self, prompt, sampling, seed)
            self.running[eval_id] = entry = _Running(seq, done, progress, eval_id)
            seqs.append(seq)
            if progress is not None:
                self._streamed.append(entry)
        if dropped or closing:
            self._streamed = [e for e in self._streamed if e.eval_id in self.running]
        return seqs, dropped

    def carried(self) -> list[Sequence]:
        """The evaluations the last step did not finish."""
        return [entry.seq for entry in self.running.values()]

    def decoded(self) -> None:
        """Hand each streamed evaluation its new tokens."""
        for entry in self._streamed:
            ids = entry.seq.response_ids
            if len(ids) > entry.told:
                start, entry.told = entry.told, len(ids)
                entry.progress(ids[start:], entry.seq.logprobs[start:])

    def finished(self, seq: Sequence) -> None:
        """``seq`` has its last token: its requester is answered."""
        eval_id = next((i for i, e in self.running.items() if e.seq is seq), None)
        if eval_id is None:
            return
        entry = self.running.pop(eval_id)
        if entry.progress is not None:
            self._streamed.remove(entry)
        entry.done(seq, None)

    def fail(self, message: str, *, queued: bool) -> list[Sequence]:
        """Every evaluation decoding (``queued``: and queued) fails with ``message``."""
        pending = []
        if queued:
            with self._lock:
                pending, self._pending = list(self._pending), deque()
        running, self.running, self._streamed = list(self.running.values()), {}, []
        for entry in running:
            entry.done(None, message)
        for *_, done, _ in pending:
            done(None, message)
        return [entry.seq for entry in running]
