"""Lanes: a work queue, the thread that feeds it and, on CUDA, its stream.

The actor's lane is the thread that calls ``step()`` (on CUDA: a high-priority stream). The scorers share
one lane: their schedulers, a queue of hand-offs from the actor, and -- when streaming -- a worker thread
(on CUDA: a low-priority stream) that prefills what has been handed off while the actor decodes on. On the
CPU a lane is just the thread: torch releases the GIL inside its ops, so two lanes overlap.

Neither lane waits for the other on the hot path: the actor hands tokens over (Python ints, so no
cross-stream event orders their data) and goes on; the scorer lane waits only for hand-offs. The actor
waits for the scorer lane once, at the end of the step. Pages flow through the arena, whose reserves keep
either lane from starving the other, and whose deferred frees keep a page from being reused before the
freeing lane's kernels on it are done.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from oppo_engine.cache.manager import KVCacheManager
from oppo_engine.model.runner import SeqChunk
from oppo_engine.model.scorer import Scorer
from oppo_engine.obs import Timeline
from oppo_engine.sched.quarantine import model_call
from oppo_engine.sched.runtime import THREADS, Clock, LaneExecutor, LaneThread
from oppo_engine.sched.scorer import ScorerScheduler
from oppo_engine.sched.sequence import SeqStatus, Sequence

# CUDA stream priorities: lower is higher; out-of-range values map to the device's extremes.
ACTOR_PRIORITY, SCORER_PRIORITY = -5, 0
_POLL_S = 0.005  # how often a scorer lane short of pages looks again (a hand-off wakes it at once)
_STALL_S = 10.0


class DeviceLane:
    """Where a lane's kernels go: a CUDA stream of the given priority, or nothing on the CPU."""

    def __init__(self, device: torch.device, priority: int) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device, priority=priority) if device.type == "cuda" else None

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Issue the block's kernels on this lane's stream (this thread's current device and stream)."""
        if self.stream is None:
            yield
            return
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            yield

    def free_event(self):
        """An event after this lane's kernels so far: pages freed now are reusable once it completes."""
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def attach(self, cache: KVCacheManager) -> None:
        """Run ``cache``'s model on this lane: its frees pend behind this lane's events (CUDA), and the
        lane's models take back each other's pending pages without waiting (one stream orders them)."""
        cache.arena.set_lane(cache.name, self)
        if self.stream is not None:
            cache.free_event = self.free_event

    def wait_for(self, stream) -> None:
        """Order this lane's later kernels after the work issued on ``stream`` so far (the caller's: the
        weights ``optimizer.step()`` or an FSDP gather just wrote there may still be in flight)."""
        if self.stream is not None and stream is not None and stream != self.stream:
            self.stream.wait_stream(stream)


@contextlib.contextmanager
def ordered_with_caller(*lanes: DeviceLane) -> Iterator[None]:
    """A step's stream order with the thread that calls ``step()``: every lane starts after the work issued
    on the caller's current stream so far (weights written by ``optimizer.step()``, an FSDP gather), and
    that stream continues after the lanes' work (the trainer reuses what the step touched). CPU: nothing."""
    device = lanes[0].device
    if device.type != "cuda":
        yield
        return
    caller = torch.cuda.current_stream(device)
    for lane in lanes:
        lane.wait_for(caller)
    try:
        yield
    finally:
        for lane in lanes:
            if lane.stream is not None and lane.stream != caller:
                caller.wait_stream(lane.stream)


@dataclass(slots=True)
class _HandOff:
    seq: Sequence
    upto: int
    final: bool
    drop: bool = False  # the sequence left the step (its environment failed): forget it


class ScorerLane:
    """The scorers' lane. The actor thread calls ``add``, ``hand_off`` and ``finish``; the work runs on a
    worker thread when ``threaded`` (streaming), else inline in ``finish`` (sequential).

    A sequence is scored once every scorer has read its result (its status becomes ``SCORED``);
    ``scored`` lists the sequences in that order and ``last_score_s`` is when the last one was. An
    exception in the lane is kept and raised in the actor thread (``check``/``finish``) with its original
    traceback; ``abort`` stops and joins the worker before any page is freed.

    Sequences outlive a step here: ``pause`` stops the worker at a step's cut and keeps every unscored
    sequence's pages, progress and pending hand-offs for the next step (the overcommit buffer carries them).
    Between steps (the worker stopped) the actor thread may ``rescore`` a sequence in some scorers.
    """

    _LANE = "scorer"
    stall_s = _STALL_S  # idle this long after the actor is done, with sequences unscored: a failure

    def __init__(
        self,
        scorers: list[Scorer],
        *,
        max_num_batched_tokens: int,
        timeline: Timeline,
        pages_in_use: Callable[[], int],
        device_lane: DeviceLane,
    ) -> None:
        self.scorers = scorers
        self.scheds = {
            s.name: ScorerScheduler(s, max_num_batched_tokens=max_num_batched_tokens)
            for s in scorers
            if s.cache is not None
        }
        self.timeline = timeline
        self.pages_in_use = pages_in_use
        self.device_lane = device_lane
        for sched in self.scheds.values():
            device_lane.attach(sched.cache)
        self.clock: Clock = time.perf_counter
        self.executor: LaneExecutor = THREADS
        self._cond = threading.Condition()
        self._inbox: list[_HandOff] = []
        self._closing = False
        self._stop = False
        self._thread: LaneThread | None = None
        self._pending: dict[int, int] = {}  # seq_id -> scorers still to read
        self._added: dict[int, Sequence] = {}  # added and not yet scored (the actor thread's view)
        self.error: BaseException | None = None
        self.scored: list[Sequence] = []
        self.last_score_s = 0.0
        self.peak_pages = 0

    def use_runtime(self, clock: Clock, executor: LaneExecutor) -> None:
        """Read the time from ``clock`` and run the worker on ``executor`` (between steps only)."""
        self.clock, self.executor = clock, executor
        self._cond = executor.condition()

    # -- the actor thread's side -----------------------------------------------------------------------

    def start(self, threaded: bool) -> None:
        """Begin a step; ``threaded`` runs the scorers beside the actor on a worker thread. Sequences carried
        from the last step (and their untaken hand-offs) are kept."""
        self._closing, self._stop = False, False
        self.scored, self.error, self.last_score_s, self.peak_pages = [], None, 0.0, 0
        self._thread = None
        if threaded:
            self._thread = self.executor.start(self._run, "oppo-scorer-lane")

    def add(self, seq: Sequence) -> None:
        """A sequence to score: its tokens will be handed off as the actor produces them."""
        self._added[seq.seq_id] = seq
        self._post(_HandOff(seq, 0, False))

    def knows(self, seq: Sequence) -> bool:
        """``seq`` was added and is not scored yet (nor dropped by ``abort``)."""
        return seq.seq_id in self._added

    def hand_off(self, seq: Sequence, upto: int, final: bool) -> None:
        """Hand the chunk to the scorers: tokens ``[0, upto)`` of ``seq`` are theirs to prefill."""
        self._post(_HandOff(seq, upto, final))

    def drop(self, seq: Sequence) -> None:
        """Forget ``seq`` (its environment ended it): the lane frees its pages and state in order with the
        hand-offs before, and no longer waits for it."""
        self._added.pop(seq.seq_id, None)
        self._post(_HandOff(seq, 0, False, drop=True))

    def discard(self, seqs: list[Sequence]) -> None:
        """Forget ``seqs`` now, hand-offs not yet taken included; only between steps (the worker stopped)."""
        ids = {s.seq_id for s in seqs}
        if not ids:
            return
        self._inbox = [h for h in self._inbox if h.seq.seq_id not in ids]
        for seq in seqs:
            self._added.pop(seq.seq_id, None)
            self._pending.pop(seq.seq_id, None)
            for sched in self.scheds.values():
                sched.drop(seq)

    def check(self) -> None:
        """Raise the lane's exception, if it has one."""
        if self.error is not None:
            raise self.error

    def finish(self) -> None:
        """No more hand-offs this step: wait until every sequence is scored (or the lane failed)."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        if self._thread is None:
            self._run()
        else:
            self._wait_for_worker()
        self.check()

    def pause(self) -> None:
        """Stop and join the worker between two of its rounds, keeping every sequence's state; raise the
        lane's exception, if it has one."""
        self._join()
        self.check()

    def abort(self) -> None:
        """Stop and join the worker, then free every scorer page and state (a failed step: the sequences
        are rolled back and prefilled again from their first token)."""
        self._join()
        # The caller's stream stopped waiting for this lane's at the step's end, before the worker stopped:
        # what the worker issued after that must come first too (the pages freed below may go elsewhere).
        stream = self.device_lane.stream
        if stream is not None:
            torch.cuda.current_stream(self.device_lane.device).wait_stream(stream)
        for sched in self.scheds.values():
            sched.abort_all()
        self._pending.clear()
        self._inbox.clear()
        self._added.clear()

    def rescore(self, seq: Sequence, names: list[str]) -> None:
        """Score ``seq`` again in the scorers ``names`` from its first token (a trained scorer after a policy
        update), keeping the others' results and pages. Only between steps (the worker stopped)."""
        names = [n for n in names if n in self.scheds]
        if not names:
            return
        if seq.seq_id not in self._added:
            if seq.status is not SeqStatus.SCORED:
                return  # the scorers have not seen it yet (inter): they will start from its first token
            # Already scored: it needs these scorers once more.
            seq.status = SeqStatus.FINISHED
            self._added[seq.seq_id] = seq
            self._pending[seq.seq_id] = 0
        for name in names:
            sched = self.scheds[name]
            if seq in sched:
                sched.restart(seq)
            elif seq.seq_id in self._pending:  # this scorer had read its result already
                sched.add(seq)
                sched.hand_off(seq, seq.num_tokens, final=True)
                self._pending[seq.seq_id] += 1
            # else: the add is still in the inbox, so this scorer has not started on it

    def _join(self) -> None:
        self._request_stop()
        self._wait_for_worker()

    def _request_stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()

    def _wait_for_worker(self) -> None:
        """Wait until the worker has left ``_run``, even across interrupts, then re-raise the first: an
        interrupt stops the worker at its next round, and no page is freed under it (the executor's
        ``join`` waits for the worker's own exit signal: see ``sched/runtime.py``)."""
        interrupt: BaseException | None = None
        while self._thread is not None:
            try:
                self._thread.join()
                self._thread = None
            except BaseException as e:
                interrupt = interrupt or e
                self._request_stop()
        if interrupt is not None:
            raise interrupt

    def _post(self, item: _HandOff) -> None:
        with self._cond:
            self._inbox.append(item)
            self._cond.notify()

    # -- the lane's own side ---------------------------------------------------------------------------

    def _run(self) -> None:
        idle_after_close = 0.0
        try:
            with self.device_lane.active():
                while True:
                    with self._cond:
                        if self._stop:
                            return
                        inbox, self._inbox = self._inbox, []
                        closing = self._closing
                    if inbox:
                        self.executor.unit(self._LANE, "take")
                    self._take(inbox)
                    if self._round():
                        idle_after_close = 0.0
                        continue
                    if closing and not self._pending:
                        return
                    if closing and not inbox:
                        # The actor is done and holds no pages, so only deferred frees can still be on
                        # their way; a lane idle for long after that can never progress: fail, not hang.
                        idle_after_close += _POLL_S
                        if idle_after_close > self.stall_s:
                            raise RuntimeError(
                                f"scorer lane made no progress for {self.stall_s:.0f} s with "
                                f"{len(self._pending)} sequences unscored: the cache cannot hold them"
                            )
                    with self._cond:
                        if not self._inbox and not self._stop and self._closing == closing:
                            # Nothing handed off yet, or pages short until the actor frees some.
                            self._cond.wait(timeout=_POLL_S if self._pending else None)
        except BaseException as e:  # surfaced in the actor thread, with its traceback
            self.error = e

    def _take(self, inbox: list[_HandOff]) -> None:
        dropped = {h.seq.seq_id for h in inbox if h.drop}
        if dropped:
            for h in [h for h in inbox if h.drop]:
                self._pending.pop(h.seq.seq_id, None)
                for sched in self.scheds.values():
                    sched.drop(h.seq)
            inbox = [h for h in inbox if h.seq.seq_id not in dropped]
        for h in inbox:
            seq = h.seq
            if seq.seq_id not in self._pending:
                self._pending[seq.seq_id] = len(self.scorers)
                for sched in self.scheds.values():
                    sched.add(seq)
            for sched in self.scheds.values():
                sched.hand_off(seq, h.upto, h.final)
        finals = [h.seq for h in inbox if h.final]
        for scorer in self.scorers:
            if scorer.cache is None and finals:  # read once, now that the sequences are whole: one pass
                with self.timeline.span(scorer.name, "score"):
                    with model_call(scorer.name):  # the reward's own failure: retried, or quarantined
                        raw = scorer.call_batch([(s.prompt_ids, s.response_ids) for s in finals])
                    results = scorer.check_batch(raw, len(finals))  # a bad result: raised at once
                for seq, result in zip(finals, results, strict=True):
                    self._completed(seq, scorer, result)

    def _round(self) -> bool:
        """One forward per scorer that has tokens to prefill; True if any ran."""
        worked = False
        for name, sched in self.scheds.items():
            for seq in sched.complete_without_forward():
                self._completed(seq, sched.scorer, sched.complete(seq))
                worked = True
            chunks = sched.schedule()
            if not chunks:
                continue
            worked = True
            self.executor.unit(self._LANE, f"{name} forward")
            self.peak_pages = max(self.peak_pages, self.pages_in_use())
            with (
                self.timeline.span(name, "prefill", tokens=sum(len(c.token_ids) for c in chunks)),
                model_call(name),
            ):
                sched.scorer.prefill([SeqChunk(c.seq.seq_id, c.token_ids, c.slots) for c in chunks])
            for c in chunks:
                if c.samples:  # the chunk that reaches the last token completes the result
                    self._completed(c.seq, sched.scorer, sched.complete(c.seq))
        return worked

    def _completed(self, seq: Sequence, scorer: Scorer, result) -> None:
        setattr(seq, scorer.field, result)
        self._pending[seq.seq_id] -= 1
        if self._pending[seq.seq_id] == 0:
            del self._pending[seq.seq_id]
            self.scored.append(seq)
            self.last_score_s = seq.score_time = self.clock()
            seq.status = SeqStatus.SCORED
            self._added.pop(seq.seq_id, None)
