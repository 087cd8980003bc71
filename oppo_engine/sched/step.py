"""The step loop: the actor decodes the step's sequences; the scorers score them -- after generation
(``sequential``, ``inter``) or streamed chunk by chunk beside it (``intra``, ``oppo``); with overcommit
(``inter``, ``oppo``) the step ends at the first B finished and scored, and the rest is carried over.
Multi-turn episodes: a sequence whose turn ends waits for its environment (``sched/envs.py``) while the
actor decodes the others, and goes on with the observation's tokens prefilled in a later forward."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch

from oppo_engine.model.actor import ActorWorker
from oppo_engine.model.runner import SeqChunk
from oppo_engine.model.sampler import SampleBatch
from oppo_engine.obs import Timeline
from oppo_engine.sched.envs import RESUME, EnvDriver
from oppo_engine.sched.lanes import DeviceLane, ScorerLane, ordered_with_caller
from oppo_engine.sched.overcommit import BatchCut
from oppo_engine.sched.prefix import shared_prefixes
from oppo_engine.sched.quarantine import model_call
from oppo_engine.sched.runtime import THREADS, Clock, LaneExecutor
from oppo_engine.sched.scheduler import ActorScheduler, ScheduledChunk
from oppo_engine.sched.sequence import SeqSnapshot, SeqStatus, Sequence
from oppo_engine.sched.side import SideWork

ACTOR_LANE = "actor"
_POLL_S = 0.005  # how often an actor short of pages (held by the scorers) looks again
# The longest an actor with only parked sequences waits before it checks the scorer lane for a failure (an
# environment's answer, or a call's expiry, ends the wait at once).
_ENV_POLL_S = 0.5
_STALL_S = 10.0
_TERMINAL = (SeqStatus.FINISHED, SeqStatus.SCORED)


@dataclass(slots=True)
class StepOutcome:
    """What one step produced: its batch in finish order, and when generation and scoring of it ended."""

    finished: list[Sequence] = field(default_factory=list)
    finished_all: list[Sequence] = field(default_factory=list)  # every sequence finishing in the step
    tokens_generated: int = 0
    generation_end_s: float = 0.0
    end_s: float = 0.0
    peak_pages: int = 0
    handoffs: int = 0  # actor -> scorer chunks (one per sequence per hand-off)
    env_failed: list[tuple[Sequence, str]] = field(default_factory=list)  # ended by their environment
    env_wait_s: float = 0.0  # the actor idle because every sequence it holds waits on its environment


class StepLoop:
    """One step of continuous batching on the actor lane, with the scorers on their own lane.

    The step's sequences come in the overcommit buffer's order (carried ones first); its batch is chosen
    by a ``BatchCut`` as they finish (every sequence, without overcommit). ``stream=False`` (sequential,
    inter): the actor decodes until the batch is complete; then the finished sequences are handed to the
    scorers, which run then. ``stream=True`` (intra, oppo): a sequence's prompt goes to the scorers when
    the step starts and its new tokens after every ``chunk_size`` decoded ones (at once when it finishes);
    the scorers prefill them on their worker thread while the actor decodes on, and the actor keeps
    decoding the other sequences until the batch is scored. Sequences not in the batch keep their actor
    pages and (streamed) scorer state for the next step.

    ``envs`` drives the environments of multi-turn episodes: a sequence parked on its environment keeps its
    pages; when every sequence the actor holds is parked, the actor waits for the first answer
    (``StepOutcome.env_wait_s``). A sequence whose environment fails leaves the step with its group
    (``StepOutcome.env_failed``).

    Side work (``add_side_work``, ``sched/side.py``) is decoded beside a committing step's sequences and is
    never part of it; a step with no batch of its own decodes it to the end.

    ``share_prefix_min`` (``EngineConfig.share_prompt_prefix``; 0: off): the prompts of a run that no
    scheduler holds yet (its new ones, and those admitted in its middle, among themselves) are split into
    classes sharing their first ``share_prefix_min`` or more tokens (``sched/prefix.py``), once per sequence,
    before any scheduler sees them; the schedulers share each class's prefix KV.
    """

    def __init__(
        self,
        *,
        actor_sched: ActorScheduler,
        actor: ActorWorker,
        scorer_lane: ScorerLane,
        actor_lane: DeviceLane,
        timeline: Timeline,
        pages_in_use: Callable[[], int],
        envs: EnvDriver,
        share_prefix_min: int = 0,
    ) -> None:
        self.envs = envs
        self.share_prefix_min = share_prefix_min
        self._share_ids = 0  # classes of shared prefixes made so far (never reused: scorers keep theirs)
        self.actor_sched = actor_sched
        self.actor = actor
        self.scorer_lane = scorer_lane
        self.actor_lane = actor_lane
        self.timeline = timeline
        self.pages_in_use = pages_in_use
        self.clock: Clock = time.perf_counter
        self.executor: LaneExecutor = THREADS
        self._in_flight: list[ScheduledChunk] = []  # the actor forward under way: its slots are not written
        self._seqs: list[Sequence] = []  # the run's sequences
        self._live: set[int] = set()  # their ids
        # Admission in the middle of a step: the queue new sequences come from (``take(n, wait=False)``,
        # ``give_back(seqs)``: a PromptQueue); those the last run admitted, with their snapshots, until the
        # step takes them (or a rollback gives them back).
        self.admission = None
        self.admitted: list[Sequence] = []
        self.admitted_snapshots: list[SeqSnapshot] = []
        # Decoded beside the step's sequences, never part of it. NOTE: both lists are replaced, never changed
        # in place: other threads add and remove sources while the actor iterates them.
        self.side_work: list[SideWork] = []
        self._side_leaving: list[SideWork] = []  # removed, gone once they have no work in flight
        self._side_lock = threading.Lock()

    def add_side_work(self, source: SideWork) -> None:
        """Decode ``source``'s sequences beside every committing step from now on (``sched/side.py``)."""
        with self._side_lock:
            self.side_work = [*self.side_work, source]

    def remove_side_work(self, source: SideWork) -> None:
        """``source`` (closed: it takes no new work) leaves the loop once it has no work in flight: the actor
        thread drops what it still decodes (``take``), frees those pages, and then lets it go (safe from any
        thread)."""
        with self._side_lock:
            self._side_leaving = [*self._side_leaving, source]
        self._prune_side()  # at once when it has nothing in flight (an idle engine may never step again)

    def side_in_flight(self) -> bool:
        """Some source has side work queued or decoding (safe from any thread: a flag read)."""
        return any(source.in_flight for source in self.side_work)

    def use_runtime(self, clock: Clock, executor: LaneExecutor) -> None:
        """Read the time from ``clock`` and run the lanes on ``executor`` (this loop's, its scorer lane's and
        its timeline's; the defaults are the real clock and OS threads: see ``sched/runtime.py``)."""
        self.clock, self.executor = clock, executor
        self.timeline.clock = clock
        self.scorer_lane.use_runtime(clock, executor)
        self.envs.pool.use_runtime(clock, executor)

    def run(
        self,
        seqs: list[Sequence],
        policy_version: int,
        cut: BatchCut,
        chunk_size: int | None = None,
        commit: bool = True,
        left_out: Iterable[Sequence] = (),
    ) -> StepOutcome:
        """Generate and score ``seqs`` until ``cut`` has its batch; tokens are tagged with
        ``policy_version``. ``chunk_size`` streams. ``commit=False`` (a quarantine probe, rolled back
        after) keeps the actor KV held for a rollback. ``left_out``: the step's sequences outside this run
        (a probe's other groups, quarantined ones), whose actor KV the run gives up if it is short of
        pages (``ActorScheduler.leave_out``)."""
        stream = chunk_size is not None
        out = StepOutcome()
        lane = self.scorer_lane
        t0 = self.clock()
        self._seqs, self._live = list(seqs), {s.seq_id for s in seqs}
        self.admitted, self.admitted_snapshots = [], []
        self._share_prefixes(seqs)
        capacity = cut.capacity if commit and self.admission is not None else None
        with (
            _probing(self.envs, not commit),
            _lane_threads(stream, self.actor_lane.device),
            ordered_with_caller(self.actor_lane, lane.device_lane),
        ):
            # NOTE: the lane starts after this loop: a worker already running could score a carried
            # sequence between the loop's reads of its status and of what the lane knows.
            for seq in seqs:
                if seq.status is SeqStatus.FAILED:
                    continue  # a sample of its group failed in this loop
                error = self.envs.begin(seq)  # a new episode's environment: made now, reset on a worker
                if error is not None:
                    self._fail(seq, error, cut, out)
                    continue
                if seq.status in _TERMINAL:
                    cut.finished(seq)  # carried over finished: first in finish order
                elif seq.status is SeqStatus.ENV and self.envs.untouchable(seq):
                    continue  # a probe: it waits on an environment the probe never calls
                elif seq.status is SeqStatus.ENV:
                    self.actor_sched.park(seq)  # its environment's call is still under way
                else:
                    self.actor_sched.add(seq)
                if stream and seq.status is not SeqStatus.SCORED and not lane.knows(seq):
                    # What is known goes to the scorers at once: the prompt, and tokens carried over.
                    lane.add(seq)
                    self._hand_off(seq, final=seq.status is SeqStatus.FINISHED, out=out)
            self.actor_sched.leave_out(left_out)
            for source in self.side_work if commit else ():
                for seq in source.carried():
                    self.actor_sched.add(seq)  # side work the last step did not finish: prefilled again
            lane.start(threaded=stream)
            out.generation_end_s = t0
            with self.actor_lane.active():
                drained = self._generate(policy_version, chunk_size, cut, out, capacity, side=commit)
            seqs = self._seqs  # with those admitted in the middle of the step
            if not stream:
                # The scorers see finished groups only (all samples of a prompt together, so they share
                # its prefix; a group not finished is scored in a later step).
                running = {s.group_id for s in seqs if s.status not in _TERMINAL}
                for seq in seqs:
                    if seq.status is SeqStatus.FINISHED and seq.group_id not in running:
                        self._hand_off_rest(seq, out)
            if drained or not (stream or any(lane.knows(s) for s in seqs if s not in cut.batch)):
                lane.finish()
            else:
                if not stream:
                    self._score_batch(cut)
                lane.pause()
        for seq in self.actor_sched.detach_all():  # they keep their pages; the buffer carries them
            if seq.side is not None:  # but side work gives them back, and keeps its tokens
                self.actor_sched.cache.free(seq.seq_id)
                seq.num_computed, seq.status = 0, SeqStatus.WAITING
        for seq in out.finished_all if commit else ():  # the step stands: KV kept for a rollback can go
            self.actor_sched.cache.free(seq.seq_id)
        out.finished = list(cut.batch)
        score_times = [s.score_time for s in cut.batch if s.score_time is not None]
        out.end_s = max([out.generation_end_s, *score_times])
        out.peak_pages = max(out.peak_pages, lane.peak_pages)
        return out

    def abort(self, seqs: list[Sequence], snapshots: list[SeqSnapshot]) -> None:
        """Roll a failed step back: stop the scorer lane and drop every scorer state (re-prefilled later),
        then cut each sequence's tokens and actor KV back to where the step found them; the sequences the
        run admitted go back to the queue (``give_back``), first in line."""
        admitted, self.admitted = self.admitted, []
        seqs, snapshots = [*seqs, *admitted], [*snapshots, *self.admitted_snapshots]
        self.admitted_snapshots = []
        self.scorer_lane.abort()
        self.actor_sched.detach_all()
        cache = self.actor_sched.cache
        self._fail_side("the step that decoded it was rolled back (retry the request)", queued=False)
        # NOTE: a sequence whose KV was dropped in the step and recomputed may hold slots of the forward that
        # failed below its starting count: only the KV before that forward's chunk was written.
        unwritten = {c.seq.seq_id: c.start for c in self._in_flight}
        self._in_flight = []
        for seq, snap in zip(seqs, snapshots, strict=True):
            if seq.episode is not None and seq.episode.changed_since(snap.episode):
                # Its environment moved on in the step: no state of it matches the snapshot's tokens, so the
                # sequence starts over from its prompt with a fresh environment (a retry never calls an
                # environment again on a turn it has answered).
                self.envs.cancel(seq)
                cache.free(seq.seq_id)
                seq.restart_from_prompt()
                continue
            cache.truncate(seq.seq_id, min(snap.num_computed, unwritten.get(seq.seq_id, snap.num_computed)))
            seq.restore(snap, cache.num_tokens(seq.seq_id))
            if not self.envs.rewound(seq):  # its environment's rewound() raised: started over, as above
                self.envs.cancel(seq)
                cache.free(seq.seq_id)
                seq.restart_from_prompt()
        if admitted:
            self.admission.give_back(admitted)

    def discard(self, seqs: list[Sequence]) -> None:
        """``seqs`` leave for good (quarantined, or failed by their environment), between steps: their
        environment calls are cancelled and their pages in every model freed."""
        self.scorer_lane.discard(seqs)
        for seq in seqs:
            self.envs.cancel(seq)
            self.actor_sched.cache.free(seq.seq_id)

    def close(self) -> None:
        """Cancel the environment calls pending and fail the side work (the engine is closing)."""
        self.envs.close()
        self._fail_side("the engine closed", queued=True)

    def _fail_side(self, message: str, *, queued: bool) -> None:
        for source in self.side_work:
            for seq in source.fail(message, queued=queued):
                self.actor_sched.cache.free(seq.seq_id)

    def _hand_off(self, seq: Sequence, *, final: bool, out: StepOutcome) -> None:
        self.executor.unit(ACTOR_LANE, "hand-off")
        seq.num_handed_off = seq.num_tokens
        seq.handed_final = final
        self.scorer_lane.hand_off(seq, seq.num_tokens, final)
        out.handoffs += 1

    def _hand_off_rest(self, seq: Sequence, out: StepOutcome) -> None:
        """A finished sequence's tokens not yet handed off, as its final chunk. A sequence the scorers know
        already was streamed in an earlier step (the chunk controller then switched streaming off)."""
        if not self.scorer_lane.knows(seq):
            self.scorer_lane.add(seq)
        elif seq.handed_final:
            return  # finished in a streamed step: its final chunk is with the scorers already
        self._hand_off(seq, final=True, out=out)

    def _score_batch(self, cut: BatchCut) -> None:
        """A step that did not stream, with streamed sequences carried beyond it: score the batch on the
        lane's worker (the actor is done) and keep the carried ones' scorer state, as a streamed step's
        cut does."""
        lane = self.scorer_lane
        lane.start(threaded=True)
        while not cut.scored():
            lane.check()
            self.executor.sleep(_POLL_S)

    def _generate(
        self,
        policy_version: int,
        chunk_size: int | None,
        cut: BatchCut,
        out: StepOutcome,
        capacity: int | None,
        side: bool = False,
    ) -> bool:
        """Decode until the batch is complete (streamed: and scored); True if the actor ran out of work.
        ``capacity``: admit new sequences while the step holds fewer (failed ones not counted). ``side``:
        decode the side work too, and, in a step with no batch of its own, until it is done."""
        sched = self.actor_sched
        stream = chunk_size is not None
        stalled_since = None
        while not (cut.scored() if stream else cut.determined) or (
            side and cut.size == 0 and self.side_in_flight()
        ):
            self.scorer_lane.check()  # a failed scorer lane fails the step now, not at its end
            if capacity is not None and (not cut.determined or cut.size == 0):  # (empty: side work runs)
                self._admit(capacity, cut, out, stream)
            if side:
                self._take_side()
            if self.envs.waiting():
                self._take_answers(cut, out, chunk_size)
            if not sched.has_work:
                if not sched.parked:
                    return True
                # Every sequence the actor holds waits on its environment: the tool time left exposed.
                t = self.clock()
                self.envs.wait(_ENV_POLL_S)
                out.env_wait_s += self.clock() - t
                continue
            chunks = sched.schedule()
            if not chunks:
                # Streamed, the scorers hold pages they free as they score; deferred frees (a lane's kernels
                # still on them) come back once those finish: wait for them, not forever.
                stalled_since = stalled_since or self.clock()
                waiting_for = stream or sched.cache.arena.pending_pages_for(sched.cache.name) > 0
                if not waiting_for or self.clock() - stalled_since > _STALL_S:
                    raise RuntimeError(
                        "actor scheduler made no progress: the cache cannot hold any waiting sequence"
                    )
                self.executor.sleep(_POLL_S)
                continue
            stalled_since = None
            out.peak_pages = max(out.peak_pages, self.pages_in_use())
            samples = _sample_batch(chunks)
            self._in_flight = chunks
            self.executor.unit(ACTOR_LANE, "forward")
            with (
                self.timeline.span(ACTOR_LANE, "forward", tokens=sum(len(c.token_ids) for c in chunks)),
                model_call(ACTOR_LANE),
            ):
                tokens, logprobs = self.actor.forward(_seq_chunks(chunks), samples)
            self._in_flight = []
            now = self.clock()
            out.tokens_generated += len(tokens)
            for row, tok, lp in zip(samples.rows, tokens, logprobs, strict=True):
                seq = chunks[row].seq
                if sched.append_token(seq, tok, lp, policy_version):
                    if seq.side is not None:
                        sched.remove(seq)  # its pages go back; its source answers it, never trained on
                        seq.side.finished(seq)
                    elif self.envs.hold(seq):
                        sched.hold(seq)  # an agent may still give its reward: it ends with that answer
                    else:
                        self._finished(seq, now, cut, out, stream)
                    continue
                if seq.status is SeqStatus.ENV and self.envs.untouchable(seq):
                    self._set_aside(seq)  # a probe stops at an environment that cannot be rewound
                    continue  # it left the scorers: no hand-off may follow the lane's drop
                elif seq.status is SeqStatus.ENV:
                    self.envs.turn_ended(seq)  # its environment answers while the others decode
                if stream and seq.num_tokens - seq.num_handed_off >= chunk_size and seq.side is None:
                    self._hand_off(seq, final=False, out=out)  # hand the chunk to the scorers
            if self.envs.listening:  # environments that follow their turns token by token
                for seq, error in self.envs.decoded(self._live):
                    if seq.status is not SeqStatus.FAILED:  # (a sample of its group failed just now)
                        self._fail(seq, error, cut, out)
            for source in self.side_work if side else ():
                source.decoded()
        return not (sched.has_work or sched.parked)

    def _set_aside(self, seq: Sequence) -> None:
        """A probe stops ``seq`` at its turn's end (``EnvDriver.untouchable``): it leaves the actor with its
        pages and the scorers, and no longer holds the probe; the probe's rollback puts it back."""
        self.actor_sched.set_aside(seq)
        if self.scorer_lane.knows(seq):
            self.scorer_lane.drop(seq)

    def _take_side(self) -> None:
        """Side work that came since the last forward joins the actor; work no longer wanted leaves; a
        removed source with nothing left in flight goes."""
        for source in self.side_work:
            new, dropped = source.take()
            for seq in dropped:
                self.actor_sched.remove(seq)
            for seq in new:
                self.actor_sched.add(seq)
        self._prune_side()

    def _prune_side(self) -> None:
        """Removed sources with no work in flight leave. NOTE: a sequence a source hands out is always held
        by the actor scheduler (whose step end frees a side sequence's pages), so one that leaves never
        strands pages, whichever thread prunes it."""
        with self._side_lock:
            gone = [source for source in self._side_leaving if not source.in_flight]
            if gone:
                self.side_work = [s for s in self.side_work if s not in gone]
                self._side_leaving = [s for s in self._side_leaving if s not in gone]

    def _admit(self, capacity: int, cut: BatchCut, out: StepOutcome, stream: bool) -> None:
        """Fill the step up to ``capacity`` live sequences from the queue (first requests of served episodes
        that came after the step started; refills of failed groups)."""
        room = capacity - sum(s.status is not SeqStatus.FAILED for s in self._seqs)
        new = self.admission.take(room, wait=False) if room > 0 else []
        if not new:
            return
        self.admitted += new
        self.admitted_snapshots += [s.snapshot() for s in new]
        self._seqs += new
        self._live.update(s.seq_id for s in new)
        cut.admit(new)
        self._share_prefixes(new)
        for seq in new:
            if seq.status is SeqStatus.FAILED:
                continue  # a sample of its group failed just now
            error = self.envs.begin(seq)
            if error is not None:
                self._fail(seq, error, cut, out)
                continue
            self.actor_sched.add(seq)
            if stream:
                self.scorer_lane.add(seq)
                self._hand_off(seq, final=False, out=out)

    def _share_prefixes(self, seqs: list[Sequence]) -> None:
        """Classes of shared prompt prefixes among ``seqs`` not looked at yet (``Sequence.share_len`` None):
        prompts sampled once, that no scorer holds, not side work. Set once: a sequence keeps its class."""
        if not self.share_prefix_min:
            return
        lane = self.scorer_lane
        fresh = [
            s
            for s in seqs
            if s.share_len is None and s.sampling.n == 1 and s.side is None and not lane.knows(s)
        ]
        classes = shared_prefixes([s.prompt_ids for s in fresh], self.share_prefix_min) if fresh else []
        base = self._share_ids
        for seq, (cls, length) in zip(fresh, classes, strict=True):
            seq.share_len = length
            if length:
                seq.share_id = base + cls
        self._share_ids = base + 1 + max((cls for cls, _ in classes), default=-1)

    def _finished(self, seq: Sequence, now: float, cut: BatchCut, out: StepOutcome, stream: bool) -> None:
        seq.finish_time = now
        self.envs.ended(seq)  # an environment that answers someone (an agent) hears how its episode ended
        out.finished_all.append(seq)
        was_determined = cut.determined
        cut.finished(seq)
        if cut.determined and not was_determined:
            out.generation_end_s = now
        if stream:
            self._hand_off(seq, final=True, out=out)

    def _take_answers(self, cut: BatchCut, out: StepOutcome, chunk_size: int | None) -> None:
        """What the environments answered since the last forward: parked sequences resume with their
        observation pending, end, or fail."""
        sched = self.actor_sched
        for answer in self.envs.collect(self._live):
            seq = answer.seq
            if seq.status is SeqStatus.FAILED:
                continue  # a sample of its group failed earlier in this collect: it left the step
            if answer.error is not None:
                self._fail(seq, answer.error, cut, out)
            elif answer.outcome == RESUME:
                sched.resume(seq)
                if chunk_size is not None and seq.num_tokens - seq.num_handed_off >= chunk_size:
                    self._hand_off(seq, final=False, out=out)
            else:
                sched.finish_parked(seq, answer.outcome)
                if self.envs.hold(seq):
                    sched.hold(seq)
                else:
                    self._finished(seq, self.clock(), cut, out, chunk_size is not None)

    def _fail(self, seq: Sequence, error: str, cut: BatchCut, out: StepOutcome) -> None:
        """``seq``'s environment failed: it leaves the step, and so does the rest of its group (groups are
        returned whole), with their calls cancelled and their pages freed."""
        for s in self._seqs:
            if s.group_id != seq.group_id or s.status is SeqStatus.FAILED:
                continue
            self.envs.cancel(s)
            self.actor_sched.remove(s)
            if self.scorer_lane.knows(s):
                self.scorer_lane.drop(s)
            if s in out.finished_all:
                out.finished_all.remove(s)
            if s.episode is not None and s.episode.error is None:
                s.episode.error = f"sample {seq.sample_index} of its group failed: {error}"
            s.status, s.finish_reason = SeqStatus.FAILED, "error"
            out.env_failed.append((s, error if s is seq else s.episode.error))
        cut.drop_group(seq.group_id)


@contextlib.contextmanager
def _lane_threads(threaded: bool, device: torch.device) -> Iterator[None]:
    """CPU thread policy: two busy lanes share the cores, so each runs torch ops on one intra-op thread
    (with torch's default, the two oversubscribe the cores; DESIGN.md, "What a CPU allows"). The thread
    count is process-wide: it is restored when the step ends."""
    if not threaded or device.type != "cpu":
        yield
        return
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


@contextlib.contextmanager
def _probing(envs: EnvDriver, probe: bool) -> Iterator[None]:
    """The environments know a quarantine probe runs (``EnvDriver.probing``) while it does."""
    envs.probing = probe
    try:
        yield
    finally:
        envs.probing = False


def _sample_batch(chunks: list[ScheduledChunk]) -> SampleBatch:
    """What to draw after the chunks that reach their sequence's last token, column by column (no object
    per row: this runs once per forward over every running sequence)."""
    if all(c.samples for c in chunks):  # every decode forward
        rows = list(range(len(chunks)))
        seqs = [c.seq for c in chunks]
    else:
        rows = [i for i, c in enumerate(chunks) if c.samples]
        seqs = [chunks[i].seq for i in rows]
    params = [s.sampling for s in seqs]
    return SampleBatch(
        rows,
        [p.temperature for p in params],
        [p.top_k for p in params],
        [p.top_p for p in params],
        [s.seed for s in seqs],
        [len(s.prompt_ids) + len(s.response_ids) for s in seqs],  # num_tokens: the position drawn
    )


def _seq_chunks(chunks: list[ScheduledChunk]) -> list[SeqChunk]:
    return [SeqChunk(c.seq.seq_id, c.token_ids, c.slots) for c in chunks]
