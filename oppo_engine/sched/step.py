"""The step loop of mode="sequential": generate every sequence of the step, then score them all."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from oppo_engine.model.actor import ActorWorker, SampleSpec
from oppo_engine.model.runner import SeqChunk
from oppo_engine.model.scorer import Scorer
from oppo_engine.obs import Timeline
from oppo_engine.sched.scheduler import ActorScheduler, ScheduledChunk
from oppo_engine.sched.scorer import ScorerScheduler
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


class SequentialStep:
    """Continuous batching of the actor until all of the step's sequences finish, then each scorer in turn
    prefills them (reward, then reference and critic when given).

    Scorers run one after another, so only one scorer holds pages while the actor holds none: each
    completes whatever the arena's size (it holds one sequence in every model). ``pages_in_use`` reports the
    arena's used pages, sampled after each scheduling decision for the step's peak.
    """

    def __init__(
        self,
        *,
        actor_sched: ActorScheduler,
        actor: ActorWorker,
        scorers: list[Scorer],
        max_num_batched_tokens: int,
        timeline: Timeline,
        pages_in_use: Callable[[], int],
    ) -> None:
        self.actor_sched = actor_sched
        self.actor = actor
        self.scorers = scorers
        self.scorer_scheds = [
            ScorerScheduler(s, max_num_batched_tokens=max_num_batched_tokens) if s.cache is not None else None
            for s in scorers
        ]
        self.timeline = timeline
        self.pages_in_use = pages_in_use

    def run(self, seqs: list[Sequence], policy_version: int) -> StepOutcome:
        """Generate, then score, ``seqs``; tokens are tagged with ``policy_version``."""
        out = StepOutcome()
        self._generate(seqs, policy_version, out)
        out.generation_end_s = time.perf_counter()
        self._score(out)
        out.end_s = time.perf_counter()
        return out

    def abort(self) -> None:
        """Free every page the step holds (actor and scorers); the caller requeues the sequences."""
        self.actor_sched.abort_all()
        for sched in self.scorer_scheds:
            if sched is not None:
                sched.abort_all()

    def _generate(self, seqs: list[Sequence], policy_version: int, out: StepOutcome) -> None:
        sched = self.actor_sched
        for seq in seqs:
            sched.add(seq)
        while sched.has_work:
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
                    seq.num_handed_off = seq.num_tokens  # generation is over: every token goes to scoring
                    out.finished.append(seq)

    def _score(self, out: StepOutcome) -> None:
        for scorer, sched in zip(self.scorers, self.scorer_scheds, strict=True):
            if sched is None:  # read once per finished sequence, nothing to prefill
                with self.timeline.span(scorer.name, "score"):
                    for seq in out.finished:
                        result = scorer.finish(seq.seq_id, seq.prompt_ids, seq.response_ids)
                        setattr(seq, scorer.field, result)
                continue
            for seq in out.finished:
                sched.add(seq)
            while sched.has_work:
                chunks = sched.schedule()
                if not chunks:
                    raise RuntimeError(
                        f"{scorer.name} scheduler made no progress: the cache cannot hold a finished sequence"
                    )
                out.peak_pages = max(out.peak_pages, self.pages_in_use())
                with self.timeline.span(scorer.name, "prefill", tokens=sum(len(c.token_ids) for c in chunks)):
                    scorer.prefill(_seq_chunks(chunks))
                for c in chunks:
                    if c.samples:  # the chunk that reaches the last token completes the result
                        setattr(c.seq, scorer.field, sched.complete(c.seq))
        for seq in out.finished:
            seq.status = SeqStatus.SCORED


def _sample_spec(row: int, seq: Sequence) -> SampleSpec:
    p = seq.sampling
    return SampleSpec(row, p.temperature, p.top_k, p.top_p, seq.seed, position=seq.num_tokens)


def _seq_chunks(chunks: list[ScheduledChunk]) -> list[SeqChunk]:
    return [SeqChunk(c.seq.seq_id, c.token_ids, c.slots) for c in chunks]
