"""A step's commit: what happens after the step loop has its batch, and the step's metrics.

``StepStart`` is taken before the loop runs (the step's sequences, their snapshots for a rollback, and the
counters that the metrics are differences of); ``commit_step`` then checks the batch, carries the rest over,
advances the engine's ``StepCounters`` and assembles ``StepMetrics``. It changes nothing outside the
counters and the overcommit buffer, which the caller restores when anything after it fails: the step is
all-or-nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from oppo_engine.cache import KVCacheManager
from oppo_engine.control import OFF
from oppo_engine.model.attention import paged_attention_enabled
from oppo_engine.model.graph import CapturedDecode
from oppo_engine.model.roles import ACTOR
from oppo_engine.model.runner import unwrap_model
from oppo_engine.obs import GpuUtilSampler, StepMetrics
from oppo_engine.obs.gpu import GpuSample
from oppo_engine.sched.overcommit import BatchCut, OvercommitBuffer
from oppo_engine.sched.prompts import PromptQueue
from oppo_engine.sched.quarantine import QuarantineOutcome, describe, run_quarantined
from oppo_engine.sched.results import Rollout, StepResult
from oppo_engine.sched.sequence import SeqSnapshot, Sequence
from oppo_engine.sched.step import StepLoop, StepOutcome


@dataclass(slots=True)
class StepCounters:
    """What the engine counts across steps; a failed step leaves it as it found it (``copy``, then put the
    copy back)."""

    step_index: int = 0  # steps committed
    finished_tokens: int = 0  # response tokens of every sequence finished so far
    finished_seqs: int = 0
    swapped_tokens: dict[str, int] = field(default_factory=dict)  # model -> brought back from host since the
    # last step

    def copy(self) -> StepCounters:
        return dataclasses.replace(self, swapped_tokens=dict(self.swapped_tokens))

    def advance(self) -> None:
        """A step was committed; its metrics keep the swapped tokens counted until now."""
        self.swapped_tokens = {}
        self.step_index += 1

    def length_bias(self, batch: list[Sequence]) -> float | None:
        """Mean response length of ``batch`` over that of every sequence finished so far."""
        if not batch or not self.finished_tokens:
            return None
        mean_batch = sum(len(s.response_ids) for s in batch) / len(batch)
        return mean_batch / (self.finished_tokens / self.finished_seqs)


@dataclass(slots=True)
class StepStart:
    """The step as it began: its sequences (carried ones first) with their snapshots and deferral counts,
    Δ and the chunk size, the engine's counters, and the cache counters its metrics are differences of.
    ``attempt`` and ``probe`` are the quarantine's two runs of the step loop; ``roll_back`` undoes the step.
    """

    seqs: list[Sequence]
    snapshots: list[SeqSnapshot]
    deferred: list[int]
    num_carried: int
    delta: int
    chunk_size: int | str | None
    counters: StepCounters
    t0: float
    cpu0: float  # the process's CPU seconds at the start (time.process_time)
    reused: dict[str, int]
    shared_before: dict[str, int]
    recomputed_before: dict[str, int]
    swapped_before: dict[str, int]

    @classmethod
    def take(
        cls, seqs: list[Sequence], num_carried: int, delta: int, chunk_size, *,
        caches: dict[str, KVCacheManager], loop: StepLoop, counters: StepCounters,
    ) -> StepStart:  # fmt: skip
        recomputed, swapped = kv_counts(loop)
        return cls(
            seqs=seqs,
            snapshots=[s.snapshot() for s in seqs],
            deferred=[s.deferred_steps for s in seqs],
            num_carried=num_carried,
            delta=delta,
            chunk_size=chunk_size,
            counters=counters.copy(),
            t0=loop.clock(),
            cpu0=time.process_time(),
            reused={name: sum(cache.num_tokens(s.seq_id) for s in seqs) for name, cache in caches.items()},
            shared_before={name: cache.shared_tokens for name, cache in caches.items()},
            recomputed_before=recomputed,
            swapped_before=swapped,
        )

    def attempt(
        self, loop: StepLoop, groups: list[list[Sequence]], cut: Callable[[list[Sequence]], BatchCut],
        policy_version: int, chunk_size: int | None,
    ) -> StepOutcome:  # fmt: skip
        """One run of the step loop over ``groups`` (a subset of the step's sequences), its batch chosen by
        ``cut(sequences)``; rolled back if it fails. What the run admitted in the middle belongs to the step
        from then on, and its groups join ``groups`` (in place: the quarantine's retries and probes see them,
        so a culprit admitted mid-step is isolated like any other); a rollback of the whole step gives them
        back to the queue as new sequences of the step."""
        live = [s for g in groups for s in g]
        try:
            return loop.run(
                live, policy_version, cut(live), chunk_size=chunk_size, left_out=self._left_out(live)
            )
        except BaseException:
            groups.extend(groups_of(self._take_admitted(loop)))
            loop.abort(self.seqs, self.snapshots)
            raise
        finally:
            self._take_admitted(loop)

    def _left_out(self, live: list[Sequence]) -> list[Sequence]:
        """The step's sequences outside a run over ``live``: a probe's other groups, quarantined groups.
        They keep the KV the step found them with (a rollback's), which only the run's actor scheduler
        can give up while the run needs the pages (``StepLoop.run``)."""
        ids = {s.seq_id for s in live}
        return [s for s in self.seqs if s.seq_id not in ids]

    def _take_admitted(self, loop: StepLoop) -> list[Sequence]:
        admitted = loop.admitted
        self.seqs += admitted
        self.snapshots += loop.admitted_snapshots
        self.deferred += [0] * len(admitted)
        loop.admitted, loop.admitted_snapshots = [], []
        return admitted

    def probe(
        self, loop: StepLoop, groups: list[list[Sequence]], policy_version: int, chunk_size: int | None
    ) -> None:
        """Run ``groups`` to the end (every sequence finished and scored), then roll back: a quarantine
        probe, to see whether these groups fail alone."""
        live = [s for g in groups for s in g]
        try:
            loop.run(
                live,
                policy_version,
                BatchCut(live, None, None),
                chunk_size=chunk_size,
                commit=False,
                left_out=self._left_out(live),
            )
        finally:
            loop.abort(self.seqs, self.snapshots)

    def roll_back(
        self, loop: StepLoop, buffer: OvercommitBuffer, prompts: PromptQueue, *, committed: bool = False
    ) -> None:
        """Nothing is lost: the step's pages go back, and its sequences (with their seeds) go first in line
        as the step found them; ``committed``: the carry-over of ``commit_step`` is undone too (the caller
        puts ``counters`` back)."""
        if committed:
            for seq, n in zip(self.seqs, self.deferred, strict=True):
                seq.deferred_steps = n
            buffer.carried = []
        loop.abort(self.seqs, self.snapshots)
        buffer.put_back(self.seqs[: self.num_carried])
        prompts.requeued.extendleft(reversed(self.seqs[self.num_carried :]))


def run_step(
    start: StepStart, loop: StepLoop, cut: Callable[[list[Sequence]], BatchCut], policy_version: int, *,
    models: Iterable[torch.nn.Module], gpu: GpuUtilSampler | None, captured: CapturedDecode | None,
) -> tuple[QuarantineOutcome, GpuSample | None]:  # fmt: skip
    """The step loop over ``start``'s sequences under the quarantine (``sched/quarantine.py``), every
    model's paged attention switched on for the whole step (one switch, not one per forward) and the GPU
    sampled: the quarantine's run and the GPU's utilisation over it. A failure propagates after the run
    that raised it was rolled back; the caller gives the step's sequences back."""
    # The chunk controller's "off" arm: this step does not stream (the non-streamed loop).
    streamed = None if start.chunk_size == OFF else start.chunk_size
    if captured is not None:
        captured.start_step()
    loop.timeline.clear()
    if gpu is not None:
        gpu.start()
    try:
        with contextlib.ExitStack() as switches:
            for model in models:
                switches.enter_context(paged_attention_enabled(unwrap_model(model)))
            run = run_quarantined(
                groups_of(start.seqs),
                lambda groups: start.attempt(loop, groups, cut, policy_version, streamed),
                lambda groups: start.probe(loop, groups, policy_version, streamed),
            )
    finally:
        util = gpu.stop() if gpu is not None else None
    return run, util


def kv_counts(loop: StepLoop) -> tuple[dict[str, int], dict[str, int]]:
    """Per model so far: tokens prefilled again below their high-water mark, and tokens whose KV a scorer
    brought back from host after a preemption."""
    recomputed = {ACTOR: loop.actor_sched.recomputed_tokens}
    swapped = {}
    for name, sched in loop.scorer_lane.scheds.items():
        recomputed[name] = sched.recomputed_tokens
        swapped[name] = sched.swapped_tokens
    return recomputed, swapped


def groups_of(seqs: list[Sequence]) -> list[list[Sequence]]:
    """``seqs`` as their groups (a prompt's samples), in order of first appearance."""
    groups: dict[int, list[Sequence]] = {}
    for seq in seqs:
        groups.setdefault(seq.group_id, []).append(seq)
    return list(groups.values())


def whole_groups(num_sequences: int, group: int) -> int:
    """``num_sequences`` rounded up to whole groups of ``group``."""
    return -(-num_sequences // group) * group


def commit_step(
    start: StepStart,
    out: StepOutcome,
    run: QuarantineOutcome,
    *,
    gpu,
    loop: StepLoop,
    caches: dict[str, KVCacheManager],
    counters: StepCounters,
    buffer: OvercommitBuffer | None,
    check_rewards: bool,
    policy_version: int,
    graph_metrics: dict,
) -> StepResult:
    """The work after the step loop (``out``; ``run`` the quarantine's result): the quarantined groups'
    KV goes, then the checks, the carry-over into ``buffer`` (``None`` without overcommit), the counters
    and the metrics.

    ``check_rewards``: the batch's mean reward feeds the Δ controller, so a non-finite reward raises
    ``ValueError`` here, before anything changes.
    """
    # NOTE: not out.end_s: in oppo the actor's forward in flight at the cut (and the lane's pause) end
    # after the batch's last score, and the caller waits for them too.
    t_end = loop.clock()
    env_failed = dict((s.seq_id, error) for s, error in out.env_failed)
    quarantined = [s for q in run.failed for s in q.group] + [s for s in start.seqs if s.seq_id in env_failed]
    loop.discard(quarantined)  # out for good: calls cancelled, KV (carried over, the actor's) freed
    for seq in quarantined:
        for cache in caches.values():
            cache.free(seq.seq_id)
    gone = {s.seq_id for s in quarantined}
    live = [s for s in start.seqs if s.seq_id not in gone]
    batch = out.finished
    if check_rewards and batch:
        bad = next((s for s in batch if not math.isfinite(float(s.final_reward))), None)
        if bad is not None:
            raise ValueError(
                f"reward: a non-finite reward {bad.final_reward!r} (prompt {bad.group_id}, sample "
                f"{bad.sample_index}) cannot feed the overcommit controller; the step is rolled back. Fix "
                "the reward, or call report_reward() to feed the controller yourself"
            )
    rollouts = [Rollout.of(s) for s in batch]
    failed = [Rollout.of(s, error=describe(q.error)) for q in run.failed for s in q.group]
    failed += [Rollout.of(s, error=error) for s, error in out.env_failed]
    env_calls, env_latencies = loop.envs.take_counts()
    if buffer is not None:
        buffer.carry(live, batch)
    counters.finished_tokens += sum(len(s.response_ids) for s in out.finished_all)
    counters.finished_seqs += len(out.finished_all)
    recomputed, swapped = kv_counts(loop)
    for name, n in swapped.items():  # preempted scorer KV that came back from host within the step
        if n > start.swapped_before[name]:
            counters.swapped_tokens[name] = (
                counters.swapped_tokens.get(name, 0) + n - start.swapped_before[name]
            )
    timeline, t0 = loop.timeline, start.t0
    metrics = StepMetrics(
        wall_s=t_end - t0,
        cpu_s=time.process_time() - start.cpu0,
        generation_s=out.generation_end_s - t0,
        exposed_scoring_s=out.end_s - out.generation_end_s,
        tokens_generated=out.tokens_generated,
        rollouts=len(batch),
        chunk_size=start.chunk_size,
        overcommit=start.delta,
        deferred=len(buffer) if buffer is not None else 0,
        pages_used=out.peak_pages,
        lane_busy=timeline.busy_fraction(t0, t_end) if t_end > t0 else {},
        gpu_util=gpu.mean_util_pct if gpu is not None else None,
        handoffs=out.handoffs,
        deferral_histogram=dict(sorted(Counter(s.deferred_steps for s in batch).items())),
        stale_tokens=sum(0 <= v < policy_version for s in batch for v in s.policy_versions),
        length_bias=counters.length_bias(batch),
        recomputed_tokens={m: recomputed[m] - start.recomputed_before[m] for m in recomputed},
        reused_tokens=start.reused,
        swapped_tokens=counters.swapped_tokens,
        shared_tokens={n: c.shared_tokens - start.shared_before[n] for n, c in caches.items()},
        retries=run.retries,
        env_calls=env_calls,
        env_wait_s=out.env_wait_s,
        env_latency_s=latency_percentiles(env_latencies),
        **graph_metrics,
    )
    if loop.admission is not None:  # groups that failed before they had a sequence (served agents)
        failed += [
            Rollout.failed_unstarted(prompt, error, group_id, j)
            for group_id, prompts, errors in loop.admission.take_failed()
            for j, (prompt, error) in enumerate(zip(prompts, errors, strict=True))
        ]
    return StepResult(rollouts, metrics, failed)


def latency_percentiles(latencies: list[float]) -> dict[str, float]:
    """``p50``, ``p90``, ``p99`` and ``max`` of ``latencies`` (nearest rank); empty without any."""
    if not latencies:
        return {}
    ordered = sorted(latencies)
    n = len(ordered)
    rank = lambda q: ordered[min(n - 1, max(0, math.ceil(q * n) - 1))]  # noqa: E731
    return {"p50": rank(0.5), "p90": rank(0.9), "p99": rank(0.99), "max": ordered[-1]}
