"""The step loop: the actor decodes the step's sequences; the scorers score them -- after generation
(``mode="sequential"``) or streamed chunk by chunk beside it (``mode="intra"``)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from oppo_engine.model.actor import ActorWorker, SampleSpec
from oppo_engine.model.runner import SeqChunk
from oppo_engine.obs import Timeline
from oppo_engine.sched.lanes import DeviceLane, ScorerLane
from oppo_engine.sched.scheduler import ActorScheduler, ScheduledChunk
from oppo_engine.sched.sequence import SeqStatus, Sequence

ACTOR_LANE = "actor"


@dataclass(slots=True)
class StepOutcome:
    """What one step produced: sequences in finish order, and when generation and scoring ended."""

    finished: list[Sequence] = field(default_factory=list)
    tokens_generated: int = 0
    generation_end_s: float = 0.0
    end_s: float = 0.0
    peak_pages: int = 0
    handoffs: int = 0  # actor -> scorer chunks (one per sequence per hand-off)


class StepLoop:
    """One step of continuous batching on the actor lane, with the scorers on their own lane.

    ``stream=False`` (sequential): every sequence is handed to the scorers once generation is over, and
    they run then. ``stream=True`` (intra-step overlap, OPPO): a sequence's prompt goes to the scorers
    when it is admitted and its new tokens after every ``chunk_size`` decoded ones (at once when it
    finishes); the scorers prefill them on their worker thread while the actor decodes on, so when the
    last sequence ends only its last chunk is left to score.
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
    ) -> None:
        self.actor_sched = actor_sched
        self.actor = actor
        self.scorer_lane = scorer_lane
        self.actor_lane = actor_lane
        self.timeline = timeline
        self.pages_in_use = pages_in_use

    def run(self, seqs: list[Sequence], policy_version: int, chunk_size: int | None = None) -> StepOutcome:
        """Generate and score ``seqs``; tokens are tagged with ``policy_version``. ``chunk_size`` streams."""
        stream = chunk_size is not None
        out = StepOutcome()
        lane = self.scorer_lane
        with _lane_threads(stream, self.actor_lane.device):
            lane.start(threaded=stream)
            for seq in seqs:
                self.actor_sched.add(seq)
                lane.add(seq)
                if stream:  # the prompt is known: the scorers prefill it while the actor does
                    self._hand_off(seq, final=False, out=out)
            with self.actor_lane.active():
                self._generate(policy_version, chunk_size, out)
            out.generation_end_s = time.perf_counter()
            if not stream:
                for seq in out.finished:
                    self._hand_off(seq, final=True, out=out)
            lane.finish()
        for seq in out.finished:
            seq.status = SeqStatus.SCORED
        out.end_s = max(lane.last_score_s, out.generation_end_s)
        out.peak_pages = max(out.peak_pages, lane.peak_pages)
        return out

    def abort(self) -> None:
        """Stop the scorer lane, then free every page the step holds; the caller requeues the sequences."""
        self.scorer_lane.abort()
        self.actor_sched.abort_all()

    def _hand_off(self, seq: Sequence, *, final: bool, out: StepOutcome) -> None:
        seq.num_handed_off = seq.num_tokens
        self.scorer_lane.hand_off(seq, seq.num_tokens, final)
        out.handoffs += 1

    def _generate(self, policy_version: int, chunk_size: int | None, out: StepOutcome) -> None:
        sched = self.actor_sched
        while sched.has_work:
            self.scorer_lane.check()  # a failed scorer lane fails the step now, not at its end
            chunks = sched.schedule()
            if not chunks:
                raise RuntimeError(
                    "actor scheduler made no progress: the cache cannot hold any waiting sequence"
                )
            out.peak_pages = max(out.peak_pages, self.pages_in_use())
            specs = [_sample_spec(i, c.seq) for i, c in enumerate(chunks) if c.samples]
            with self.timeline.span(ACTOR_LANE, "forward", tokens=sum(len(c.token_ids) for c in chunks)):
                tokens, logprobs = self.actor.forward(_seq_chunks(chunks), specs)
            now = time.perf_counter()
            for spec, tok, lp in zip(specs, tokens, logprobs, strict=True):
                seq = chunks[spec.row].seq
                out.tokens_generated += 1
                if sched.append_token(seq, tok, lp, policy_version):
                    seq.finish_time = now
                    out.finished.append(seq)
                    if chunk_size is not None:
                        self._hand_off(seq, final=True, out=out)
                elif chunk_size is not None and seq.num_tokens - seq.num_handed_off >= chunk_size:
                    self._hand_off(seq, final=False, out=out)  # hand the chunk to the scorers


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


def _sample_spec(row: int, seq: Sequence) -> SampleSpec:
    p = seq.sampling
    return SampleSpec(row, p.temperature, p.top_k, p.top_p, seq.seed, position=seq.num_tokens)


def _seq_chunks(chunks: list[ScheduledChunk]) -> list[SeqChunk]:
    return [SeqChunk(c.seq.seq_id, c.token_ids, c.slots) for c in chunks]
