"""The baselines users run today, as arms of a plan, priced by the same cost model (never engine modes:
the engine's step loop has no branch for them).

``"trl"``: a TRL-like PPO step -- what the OPPO paper's baseline most likely was (TRL's older
``PPOTrainer``, the StackLLaMA example). Each assumption is one of :data:`TRL_ASSUMPTIONS` (written into
``plan.json`` and ``docs/twin.md``).

``"sync"``: a synchronous engine as verl's synchronous PPO runs: the engine's ``sequential`` mode (a
captured, continuously batched decode, then the scorers, then the update, in series) plus verl's forward
that recomputes the old log-probs; the rollout replicas' refresh (weight resharding) is already in every
mode's update. :data:`SYNC_ASSUMPTIONS` lists what is added and what is omitted.

Both are predictions. The paper is a comparison, never an input.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from oppo_engine.sim.cost import Batch, CostModel, training_flops
from oppo_engine.sim.shapes import ModelShape

# HF transformers' host time per decode step of ``generate`` (eager: no CUDA graphs), what a step takes
# beyond the twin's own eager forward. From the one fixed-batch HF-eager measurement found
# (bench/published.py, row "hf-eager-h100-qwen7b-b1", a source row): Qwen2.5-7B, bf16 SDPA, batch 1,
# context 2048 on an H100 SXM5 decodes at 27% of its memory floor (weights + KV over peak bandwidth),
# 16.97 ms a step; the twin's eager forward of that step is 6.02 ms (roofline h100; 5.49 ms before its
# elementwise kernels paid a floor each, when this was 11.5 ms): 10.95 ms of host time.
# arxiv.org/html/2605.30571. ``tests/sim/test_baselines.py`` re-derives it from the row.
HF_STEP_HOST_S = 10.95e-3

TRL_MINI_BATCH = 4  # ``_generate_batched``'s default batch_size: prompts per generate call
TRL_EPOCHS = 4  # TRL PPOConfig.ppo_epochs

TRL_ASSUMPTIONS = (
    "AutoModelForCausalLMWithValueHead: the critic is a value head on the actor's body, not a second model "
    "(its forward gives log-probs and values; one body is trained)",
    f"_generate_batched left-pads mini-batches of {TRL_MINI_BATCH} prompts (its default) and decodes each "
    "until its longest response ends, on HF's dynamic KV cache: eager forwards, no captured graphs, "
    f"HF's per-step host time ({HF_STEP_HOST_S * 1e3:.1f} ms, sim/baselines.py: HF_STEP_HOST_S)",
    "ZeRO-3: the actor's weights are all-gathered for every forward of generation, and for every forward "
    "and backward of the update",
    "scoring after generation: the reward model scores every rank's batch, padded, on the scoring GPU (7+1) "
    "or on the rank's own GPU (colocated)",
    "then the log-prob-and-value forward of the actor and the reference forward, each over the rank's "
    "batch padded to its longest row",
    f"then {TRL_EPOCHS} PPO epochs (TRL's default) over minibatches padded to their longest row, no "
    "activation checkpointing",
)
SYNC_ASSUMPTIONS = (
    "the engine's 'sequential' mode: a captured, continuously batched decode (vLLM-class), then the "
    "scorers, then the update, in series",
    "added: verl's forward that recomputes the old log-probs (one actor forward over the batch, packed)",
    "included already: the rollout replicas' refresh after the update (weight resharding: one all-gather "
    "of the trained weights)",
    "omitted: the rollout engine's sleep/wake (freeing and re-allocating its KV cache and weights around "
    "the update): no measurement of it was found",
)


def hf_decode_s(cost: CostModel, shape: ModelShape, contexts: Sequence[int]) -> float:
    """One HF-eager decode step of ``len(contexts)`` left-padded rows, every row attending over the
    longest context (the dynamic cache is padded): the twin's eager forward plus HF's host time."""
    rows = len(contexts)
    width = max(contexts)
    work = cost.forward(shape, Batch(tuple((1, width) for _ in range(rows)), rows, rows), captured=False)
    return work.alone_s + HF_STEP_HOST_S


def _forward_s(cost: CostModel, shape: ModelShape, lengths: Sequence[int]) -> float:
    """One eager forward over ``lengths`` padded to the longest."""
    if not lengths:
        return 0.0
    width = max(lengths)
    rows = len(lengths)
    return cost.forward(
        shape, Batch(tuple((width, width) for _ in range(rows)), rows), captured=False
    ).alone_s


def trl_step(setting, steps: int = 4) -> dict:
    """Seconds of one TRL-like PPO step (:data:`TRL_ASSUMPTIONS`) of ``setting``, the mean of ``steps``
    steps of the setting's length draws, by phase: ``generation_s`` (the slowest rank), ``scoring_s``,
    ``forwards_s``, ``update_s`` and ``s_per_step``."""
    from oppo_engine.model.roles import ACTOR, REFERENCE, REWARD  # noqa: PLC0415

    s = setting
    cost, actor = s.cost, s.shapes[ACTOR]
    gather = cost.source.collective_s(actor.weight_bytes, s.training_gpus)  # one ZeRO-3 all-gather
    totals: dict[str, list[float]] = {k: [] for k in ("generation_s", "scoring_s", "forwards_s", "update_s")}
    for step in range(steps):
        per_rank = []
        group = s.group_size
        prompts = s.per_rank // group
        for rank in range(s.ranks):  # the prompts and lengths the engine's ranks draw (sim/twin.py: _feed)
            idx = [(step * prompts + i) * s.ranks + rank for i in range(prompts)]
            per_rank.append(
                [(s.prompt_lengths[g], s.lengths[g * group + j]) for g in idx for j in range(group)]
            )
        gen, fwd, score, shares = [], [], 0.0, []
        for rows in per_rank:
            t = 0.0
            for i in range(0, len(rows), TRL_MINI_BATCH):
                mb = rows[i : i + TRL_MINI_BATCH]
                pad = max(p for p, _ in mb)
                t += _forward_s(cost, actor, [pad] * len(mb)) + gather
                for k in range(1, max(r for _, r in mb)):
                    t += hf_decode_s(cost, actor, [pad + k] * len(mb)) + gather
            gen.append(t)
            lengths = [p + r for p, r in rows]
            if REWARD in s.shapes:
                score += _forward_s(cost, s.shapes[REWARD], lengths)
            f = _forward_s(cost, actor, lengths) + gather  # log-probs and values: one body
            if REFERENCE in s.shapes:
                f += _forward_s(cost, s.shapes[REFERENCE], lengths) + gather
            fwd.append(f)
            shares.append(lengths)
        if s.placement != "7+1":  # each rank scores its own batch on its own GPU
            score /= s.ranks
        size = s.minibatch_size
        minibatches = [[r[i : i + size] for r in shares] for i in range(0, s.per_rank, size)]
        update = cost.update([actor], minibatches, gpus=s.training_gpus, epochs=TRL_EPOCHS)
        totals["generation_s"].append(max(gen))
        totals["scoring_s"].append(score)
        totals["forwards_s"].append(max(fwd))
        totals["update_s"].append(update)
    out = {k: statistics.fmean(v) for k, v in totals.items()}
    out["s_per_step"] = sum(out.values())
    return out


def recompute_forward_s(setting, rows: Sequence[int]) -> float:
    """verl's old-log-prob forward (:data:`SYNC_ASSUMPTIONS`): one actor forward over every rank's share of
    ``rows`` (prompt + response lengths), packed, at the training MFU, the slowest rank's."""
    from oppo_engine.model.roles import ACTOR  # noqa: PLC0415

    s = setting
    shares = [list(rows[r :: s.ranks]) for r in range(s.ranks)]
    flops = max(training_flops(s.shapes[ACTOR], share, 1.0, packed=True) for share in shares)
    return s.cost.source.training_s(flops)


__all__ = [
    "HF_STEP_HOST_S",
    "SYNC_ASSUMPTIONS",
    "TRL_ASSUMPTIONS",
    "hf_decode_s",
    "recompute_forward_s",
    "trl_step",
]
