"""Per-step metrics of the rollout engine and their one-line log summary."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

# NOTE: the package name, not __name__, so users configure one logger for everything obs reports.
logger = logging.getLogger("oppo_engine.obs")


@dataclass(slots=True)
class StepMetrics:
    """What one `RolloutEngine.step()` cost and did. Field names are part of the public contract.

    Attributes:
        wall_s: wall-clock seconds of the whole step, from entering `step()` to returning.
        generation_s: seconds the actor spent generating in this step (first to last decoded token).
        exposed_scoring_s: scoring time the overlap failed to hide: from the actor's last token of the
            step to the last score of the step. The sequential mode exposes all of its scoring.
        tokens_generated: tokens the actor sampled in this step, including those of sequences that are
            deferred to the next step.
        rollouts: finished and scored rollouts returned by the step (B, or fewer once prompts run out).
        chunk_size: tokens per sequence decoded between hand-offs to the scorers (C); `"off"` when the
            chunk controller chose not to stream this step (intra then runs as sequential, oppo as inter);
            `None` when the mode never streams (sequential, inter).
        overcommit: extra sequences kept in flight beyond the batch size this step (Δ).
        deferred: unfinished sequences carried over to the next step.
        pages_used: peak number of KV pages in use during the step, all models together.
        lane_busy: lane name -> fraction of `wall_s` that lane was busy (0..1, overlaps counted once).
        gpu_util: mean GPU utilisation in percent over the step, or `None` without NVML.
        handoffs: actor -> scorer hand-offs (one per sequence per chunk of new tokens, the prompt included
            when streaming).
        deferral_histogram: deferral count -> rollouts of the returned batch with that many deferrals.
        stale_tokens: tokens of the returned batch sampled by an older policy than the current one.
        length_bias: mean response length of the returned batch over the mean of every sequence finished
            so far (the first-B cut favours short answers; > 1 would mean long ones); `None` for an empty
            batch.
        recomputed_tokens: model -> tokens prefilled again in this step whose KV had been computed before
            (after a preemption, a policy update, a checkpoint load or a rolled-back step).
        reused_tokens: model -> tokens of retained KV the step's carried-over sequences started with.
        swapped_tokens: model -> tokens whose KV came back from host memory (``resume()``) since the
            last step.
        shared_tokens: model -> prompt tokens whose KV a sequence took from another in this step (pages
            shared, not prefilled): a sample of a group from another sample (``SamplingParams.n > 1``), a
            prompt from another beginning with the same tokens (``EngineConfig.share_prompt_prefix``).
        retries: runs of the step loop after the first within this step: the retry of a failed forward or
            reward, the halving probes that isolate a culprit group, the runs without a quarantined group.
        graph_forwards: the actor's decode-only forwards of this step that ran through a captured graph
            (``EngineConfig.graph``).
        graph_recompiles: graphs compiled (CPU) or captured (CUDA, re-captures included) in this step; a
            run settles into 0 after its first steps.
        graph_fallback: ``None``, or why a decode-only forward of this step ran eager with graphs on.
        env_calls: environment ``step`` calls answered in this step (multi-turn episodes), failures and
            timeouts included.
        env_wait_s: seconds the actor was idle because every sequence it held waited on its environment:
            the tool time the overlap failed to hide.
        env_latency_s: ``p50``, ``p90``, ``p99`` and ``max`` seconds of those calls (from a worker taking the
            call to its answer); empty when there were none.
        cpu_s: CPU seconds the whole process used during the step (``time.process_time``: every thread,
            the scorer lane's and any other work of the process included). Beside ``wall_s`` and the torch
            threads it shows where a slow step's time went on a CPU: ``cpu_s`` well below
            ``threads * wall_s`` is a step that waited for cores (a loaded machine), ``cpu_s`` near it with a
            long ``wall_s`` is threads spinning at OpenMP barriers rather than computing (docs/ppo.md,
            "The first step"). ``None`` where it was not measured.
    """

    wall_s: float
    generation_s: float
    exposed_scoring_s: float
    tokens_generated: int
    rollouts: int
    chunk_size: int | str | None
    overcommit: int
    deferred: int
    pages_used: int
    lane_busy: dict[str, float]
    gpu_util: float | None
    handoffs: int = 0
    deferral_histogram: dict[int, int] = field(default_factory=dict)
    stale_tokens: int = 0
    length_bias: float | None = None
    recomputed_tokens: dict[str, int] = field(default_factory=dict)
    reused_tokens: dict[str, int] = field(default_factory=dict)
    swapped_tokens: dict[str, int] = field(default_factory=dict)
    shared_tokens: dict[str, int] = field(default_factory=dict)
    retries: int = 0
    graph_forwards: int = 0
    graph_recompiles: int = 0
    graph_fallback: str | None = None
    env_calls: int = 0
    env_wait_s: float = 0.0
    env_latency_s: dict[str, float] = field(default_factory=dict)
    cpu_s: float | None = None


def format_step_summary(step_index: int, m: StepMetrics) -> str:
    """One human-readable line summarising step `step_index`."""
    tok_s = m.tokens_generated / m.wall_s if m.wall_s > 0 else 0.0
    chunk = "-" if m.chunk_size is None else str(m.chunk_size)
    busy = " ".join(f"{lane}={frac:.0%}" for lane, frac in sorted(m.lane_busy.items())) or "-"
    gpu = "n/a" if m.gpu_util is None else f"{m.gpu_util:.0f}%"
    return (
        f"step {step_index}: wall {m.wall_s:.3f}s gen {m.generation_s:.3f}s "
        f"exposed-scoring {m.exposed_scoring_s:.3f}s | {m.rollouts} rollouts {m.tokens_generated} tok "
        f"({tok_s:.1f} tok/s) | C={chunk} overcommit={m.overcommit} deferred={m.deferred} "
        f"pages={m.pages_used} | busy {busy} | gpu {gpu}"
    )


def log_step(step_index: int, m: StepMetrics) -> None:
    """Log the summary of step `step_index` at INFO on the `oppo_engine.obs` logger."""
    # NOTE: guard so the f-string work is skipped in training loops that leave INFO off.
    if logger.isEnabledFor(logging.INFO):
        logger.info("%s", format_step_summary(step_index, m))
