"""The step loop wired to its parts: a cache manager per model over the shared arena, the actor's scheduler
and runner (with captured decode where enabled), the scorers and their lane.

The engine builds this when it is constructed, and again after ``close()`` never: what is built here lives as
long as the arena.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from oppo_engine.cache import KVArena, KVCacheManager
from oppo_engine.config import EngineConfig
from oppo_engine.env.pool import EnvPool
from oppo_engine.model.actor import ActorWorker
from oppo_engine.model.graph import CapturedDecode, graph_enabled
from oppo_engine.model.packed import for_model as packed_for_model
from oppo_engine.model.packed import packed_enabled
from oppo_engine.model.roles import ACTOR, CRITIC, REFERENCE, REWARD
from oppo_engine.model.runner import ModelRunner
from oppo_engine.model.scorer import (
    CriticScorer,
    ReferenceScorer,
    RewardScorer,
    RuleReward,
    RuleScorer,
    Scorer,
)
from oppo_engine.model.warmup import warm_up_models
from oppo_engine.obs import Timeline
from oppo_engine.sched.envs import EnvDriver
from oppo_engine.sched.lanes import ACTOR_PRIORITY, SCORER_PRIORITY, DeviceLane, ScorerLane
from oppo_engine.sched.scheduler import ActorScheduler
from oppo_engine.sched.step import StepLoop

# The streamed scorers, in the order the sequential loop runs them, with the class that drives each.
SCORER_CLASSES: dict[str, type[Scorer]] = {
    REWARD: RewardScorer,
    REFERENCE: ReferenceScorer,
    CRITIC: CriticScorer,
}


@dataclass(slots=True)
class BuiltLoop:
    """The step loop, the cache manager of each model (by role) and the actor's captured decode (or None)."""

    loop: StepLoop
    caches: dict[str, KVCacheManager]
    captured: CapturedDecode | None


def build_step_loop(
    arena: KVArena,
    models: dict[str, torch.nn.Module],
    *,
    config: EngineConfig,
    rule_reward: RuleReward | None,
    max_in_flight: int,
    max_model_len: int,
    vocab_size: int,
    eos_token_ids: tuple[int, ...],
    overcommit: bool,
    device: torch.device,
    timeline: Timeline,
    make_lane: Callable[..., ScorerLane] = ScorerLane,
) -> BuiltLoop:
    """The step loop over ``models`` (by role; the actor under ``ACTOR``) in ``arena``.

    ``rule_reward`` is a reward function scored on the lane (``None``: a reward model among ``models``, or
    a remote one); ``max_in_flight`` is B + Δ_max (and the default number of environment workers);
    ``make_lane`` builds the scorer lane (a remote scorer's lane replaces the local one here, and nowhere in
    the loop). On CUDA the Triton variants are compiled here, once, rather than on two lanes at once in the
    first step.
    """
    actor_cache = KVCacheManager(arena, ACTOR)
    caches = {ACTOR: actor_cache}
    actor_sched = ActorScheduler(
        actor_cache,
        max_num_seqs=max_in_flight,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=max_model_len,
        eos_token_ids=eos_token_ids,
        max_deferrals=config.max_deferrals if overcommit else None,
    )
    backend = config.attention_backend
    scorers: list[Scorer] = [] if rule_reward is None else [RuleScorer(rule_reward)]
    for name, scorer_class in SCORER_CLASSES.items():
        if name in models:
            cache = caches[name] = KVCacheManager(arena, name)
            scorers.append(scorer_class(ModelRunner(models[name], cache, backend=backend)))
    actor_lane = DeviceLane(device, ACTOR_PRIORITY)
    actor_lane.attach(actor_cache)
    actor_runner = ModelRunner(models[ACTOR], actor_cache, backend=backend)
    if packed_enabled(config.packed_weights, device):  # the CPU's packed GEMM weights (model/packed.py)
        actor_runner.packed = packed_for_model(models[ACTOR], max_in_flight)
    captured = None
    if graph_enabled(config.graph, device):  # captured decode (model/graph.py)
        actor_runner.captured = captured = CapturedDecode(
            actor_runner, max_num_seqs=max_in_flight, max_model_len=max_model_len
        )

    def pages_in_use() -> int:
        return arena.num_pages - arena.num_free_pages()

    loop = StepLoop(
        actor_sched=actor_sched,
        actor=ActorWorker(actor_runner),
        scorer_lane=make_lane(
            scorers,
            max_num_batched_tokens=config.max_num_batched_tokens,
            timeline=timeline,
            pages_in_use=pages_in_use,
            device_lane=DeviceLane(device, SCORER_PRIORITY),
        ),
        actor_lane=actor_lane,
        timeline=timeline,
        pages_in_use=pages_in_use,
        envs=EnvDriver(
            EnvPool(config.env_workers or max_in_flight, config.env_timeout_s),
            vocab_size=vocab_size,
            max_model_len=max_model_len,
        ),  # fmt: skip
        share_prefix_min=_share_prefix_min(config),
    )
    if device.type == "cuda":  # compile the Triton variants here, not on two lanes at once
        with torch.cuda.device(device):  # Triton launches on the current device, not the tensors'
            warm_up_models(loop.actor, scorers, max_model_len)
    return BuiltLoop(loop, caches, captured)


def _share_prefix_min(config: EngineConfig) -> int:
    """Fewest leading tokens prompts share across prompts (``EngineConfig.share_prompt_prefix``); 0: off."""
    if not config.share_prompt_prefix:
        return 0
    least = config.shared_prefix_min_tokens
    return config.page_size if least is None else least
