"""A compact PPO trainer (InstructGPT / TRL style) whose rollouts come from a ``RolloutEngine``.

One ``step()``: the engine returns ``batch_size`` rollouts with the behaviour log-probs, the reference's
log-probs and the critic's values streamed while the actor decoded; the trainer turns them into
KL-penalised rewards and GAE advantages, runs ``epochs`` passes of clipped policy and value losses over
minibatches, and calls ``engine.update_policy()`` once, after the last optimizer step.

Under overcommit (engine modes ``inter``/``oppo``) a rollout may hold tokens sampled by an older policy
(``Rollout.policy_versions``). By default their old log-probs are recomputed with the current actor before
the update (``PPOConfig.off_policy="recompute"``: the ratio starts at 1, as in on-policy PPO, at the cost
of one no-grad forward of the batch when any token is stale); ``"truncated_is"`` keeps the behaviour
log-probs and truncates the importance ratio instead. The critic's values are always current: the engine
recomputes a carried sequence's values after ``update_policy()``.

With ``process_group=`` it runs data-parallel (one trainer per rank, under ``torchrun``): FSDP2-sharded
actor and critic, frozen reward and reference replicated, one engine per rank over its share of the
prompts; advantages over the global batch and rank-major minibatches (``ppo/ranks.py``), so W ranks
train exactly as one rank over the same global batch.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from oppo_engine.config import EngineConfig, SamplingParams
from oppo_engine.engine import RolloutEngine
from oppo_engine.model.support import text_config
from oppo_engine.ppo import core, ranks
from oppo_engine.ppo.batch import RolloutBatch, canonical_order, collate
from oppo_engine.ppo.config import PPOConfig
from oppo_engine.sched.results import StepResult

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class PPOStepStats:
    """What one PPO step did: the batch's mean score, KL to the reference, losses, staleness, times."""

    step: int
    reward: float  # mean reward-model score of the batch
    kl: float  # mean per-sequence sum of log pi_old - log pi_ref
    policy_loss: float
    value_loss: float
    clipfrac: float
    approx_kl: float
    response_len: float
    stale_tokens: int  # tokens sampled by an older policy than the one being updated
    rollout_s: float  # engine.step()
    update_s: float  # everything after it
    rollout: StepResult  # this rank's
    grad_norm: float = float("nan")  # the actor's gradient norm before clipping, mean over minibatches


def _check_one_label(model: nn.Module, role: str) -> None:
    labels = getattr(model.config, "num_labels", None)
    if labels != 1 or not isinstance(getattr(model, "score", None), nn.Module):
        raise ValueError(
            f"{role} must be a sequence-classification model with one label (a `score` head), got "
            f"{type(model).__name__} with num_labels={labels}"
        )


class PPOTrainer:
    """PPO on ``actor`` (causal LM) and ``critic`` (one-label value model), against a frozen ``reference``
    (causal LM) and a frozen ``reward`` model (one label), all HF models sharing ``tokenizer``'s vocabulary.

    ``prompts`` (token-id lists) are cycled. A rollout the engine quarantined (``StepResult.failed``) is
    logged as a warning and left out of the update. ``engine_config`` picks the engine's mode and cache; its
    ``batch_size`` must be ``config.batch_size``. Bad input raises ``ValueError`` here, before any work.

    ``process_group`` (a torch.distributed group; ``None``: a single process) makes it data-parallel: every
    rank builds its trainer with the same models and prompts; ``actor`` and ``critic`` must be FSDP2-sharded
    over the group's ranks (``ranks.shard_model``; on GPUs the FSDP mesh runs NCCL and
    ``process_group`` is best a gloo group over the same ranks, ``ranks.exchange_group()``: it carries
    small objects and sums, and its timeouts raise); ``batch_size`` and ``minibatch_size`` count this rank's
    rows. ``__init__``, ``step()``, ``train()`` and ``close()`` are collective. Prompt ``i`` of the cycled
    list is sampled with the seed ``ranks.prompt_seed(config.seed, i)`` however many ranks there are.
    """

    def __init__(
        self,
        actor: nn.Module,
        critic: nn.Module,
        reference: nn.Module,
        reward: nn.Module,
        tokenizer,
        prompts: Sequence[Sequence[int]],
        config: PPOConfig | None = None,
        engine_config: EngineConfig | None = None,
        process_group=None,
    ) -> None:
        self.config = cfg = config or PPOConfig()
        self.group = process_group
        self.rank, self.world_size = ranks.group_rank_size(process_group)
        engine_config = engine_config or EngineConfig(batch_size=cfg.batch_size)
        if engine_config.batch_size != cfg.batch_size:
            raise ValueError(
                f"engine_config.batch_size={engine_config.batch_size} differs from PPOConfig.batch_size="
                f"{cfg.batch_size}: one engine step is one PPO batch"
            )
        vocab = int(text_config(actor).vocab_size)
        if len(tokenizer) > vocab:
            raise ValueError(
                f"tokenizer has {len(tokenizer)} tokens but the actor's vocabulary only {vocab}: the "
                "tokenizer and the model do not belong together"
            )
        if tokenizer.eos_token_id is None or tokenizer.pad_token_id is None:
            raise ValueError("tokenizer needs an eos_token and a pad_token")
        _check_one_label(reward, "reward")
        _check_one_label(critic, "critic")
        _check_sharding(actor, critic, reference, reward, self.world_size)
        prompts = [[int(t) for t in p] for p in prompts]
        if not prompts:
            raise ValueError("prompts is empty")
        # NOTE: checked here, as the engine would: prompts are handed to it a step at a time.
        bad = next((i for i, p in enumerate(prompts) if not p or not all(0 <= t < vocab for t in p)), None)
        if bad is not None:
            raise ValueError(
                f"prompts[{bad}] is empty or holds a token id outside the actor's vocabulary [0, {vocab})"
            )
        settings = dict(config=dataclasses.asdict(cfg), prompts=hash(tuple(map(tuple, prompts))))
        ranks.check_same_on_ranks(settings, process_group)
        for model in (reference, reward):
            model.requires_grad_(False)
        self.actor, self.critic, self.reference, self.reward = actor, critic, reference, reward
        self.tokenizer = tokenizer
        self._sampling = SamplingParams(
            temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens, seed=cfg.seed
        )
        self.engine = RolloutEngine(
            actor=actor,
            reward=reward,
            reference=reference,
            critic=critic,
            config=engine_config,
            sampling=self._sampling,
            eos_token_id=tokenizer.eos_token_id,
            process_group=process_group,
        )
        # The engine resolves max_model_len (None: the models' limit), so the check reads its value.
        longest = max(len(p) for p in prompts)
        if longest + cfg.max_new_tokens > self.engine.max_model_len:
            self.engine.close()
            raise ValueError(
                f"a prompt of {longest} tokens plus max_new_tokens={cfg.max_new_tokens} exceeds "
                f"max_model_len={self.engine.max_model_len}"
            )
        self._prompts = ranks.rank_prompts(
            prompts, rank=self.rank, world_size=self.world_size, block=cfg.batch_size
        )
        self._queued = 0  # prompts handed to the engine and not yet returned by a step
        self._queue_target = cfg.batch_size + _overcommit_bound(engine_config)
        self._feed_engine()
        self.device = next(actor.parameters()).device
        self.actor_optim = torch.optim.AdamW(actor.parameters(), lr=cfg.lr)
        self.critic_optim = torch.optim.AdamW(critic.parameters(), lr=cfg.critic_lr)
        self.steps = 0

    # ------------------------------------------------------------------ one PPO step

    def step(self) -> PPOStepStats:
        """One PPO step: one ``engine.step()`` of ``batch_size`` rollouts, the update over them, then
        ``engine.update_policy()``. Quarantined rollouts are logged as warnings and left out of the update
        (``RuntimeError`` if none is left)."""
        cfg = self.config
        t0 = time.perf_counter()
        self._feed_engine()
        result = self.engine.step()
        self._queued -= len(result.rollouts) + len(result.failed)
        t1 = time.perf_counter()
        for r in result.failed:  # quarantined by the engine: logged, and the update goes on without them
            logger.warning(
                "PPO step %d: rollout of prompt %s left out: %s", self.steps + 1, r.prompt_ids, r.error
            )
        # The global batch (rank-major, then canonical), on every rank: a no-op on one rank.
        rollouts = ranks.gather_rollouts(result.rollouts, self.group)
        if not rollouts:
            raise RuntimeError(
                f"PPO step {self.steps + 1}: the engine returned no rollout ({len(result.failed)} "
                "quarantined): there is nothing to train on"
            )
        batch = collate(canonical_order(rollouts), self.tokenizer.pad_token_id, self.device)
        if cfg.release_memory:
            self.engine.release_memory()
        try:
            stats = self._update(batch)
        finally:
            if cfg.release_memory:
                self.engine.resume()
        self.engine.update_policy()  # once, after the last optimizer step of the epochs
        self.steps += 1
        return PPOStepStats(
            step=self.steps, rollout_s=t1 - t0, update_s=time.perf_counter() - t1, rollout=result, **stats
        )

    def _feed_engine(self) -> None:
        """Top the engine's queue up to the most prompts one step can take (B plus the largest Δ), each
        with the seed of its global position; what a step does not take stays queued, in order."""
        missing = self._queue_target - self._queued
        if missing <= 0:
            return
        items = list(itertools.islice(self._prompts, missing))
        seeds = [ranks.prompt_seed(self.config.seed, g) for g, _ in items]
        self.engine.add_prompts(
            [ids for _, ids in items], sampling=[dataclasses.replace(self._sampling, seed=s) for s in seeds]
        )
        self._queued += len(items)

    def _my_rows(self, rows: torch.Tensor) -> tuple[torch.Tensor, float]:
        """This rank's share of the global ``rows`` (cut into ``W`` consecutive slices, rank-major) and its
        loss weight. FSDP needs every rank in every forward: a rank whose slice is empty (a short last
        chunk) runs the first row with weight 0."""
        if self.world_size == 1:
            return rows, 1.0
        mine = torch.tensor_split(rows, self.world_size)[self.rank]
        return (mine, 1.0) if len(mine) else (rows[:1], 0.0)

    def old_logprobs(self, batch: RolloutBatch) -> torch.Tensor:
        """The log-probs the PPO ratio is taken against. Tokens sampled by the current policy keep their
        behaviour log-probs; with ``off_policy="recompute"`` the stale ones (sampled before the last
        ``update_policy()``) get the current actor's, so the update starts on-policy."""
        stale = (batch.versions < self.engine.policy_version) & (batch.mask > 0)
        if self.config.off_policy != "recompute" or not stale.any():
            return batch.logprobs
        # Only the rows with stale tokens, in chunks of similar length, each trimmed to its longest row
        # (exact: right padding, causal model): under long-tailed lengths the padded batch is mostly padding.
        # Data-parallel ranks split each chunk's rows and sum what they computed.
        fresh = torch.zeros_like(batch.logprobs)
        rows = stale.any(1).nonzero().flatten()
        lengths = batch.attention_mask.sum(1)
        chunk = self.config.minibatch_size * self.world_size
        with torch.no_grad():
            for idx in rows[torch.argsort(lengths[rows], stable=True)].split(chunk):
                mine, weight = self._my_rows(idx)
                width = int(lengths[mine].max())
                ids, mask = batch.input_ids[mine, :width], batch.attention_mask[mine, :width]
                logprobs = core.token_logprobs(self.actor, ids, mask, self.config.temperature)
                if weight:
                    fresh[mine, : width - 1] = logprobs
        ranks.all_reduce_sum(fresh, self.group)
        return torch.where(stale, fresh, batch.logprobs)

    def _update(self, batch: RolloutBatch) -> dict:
        cfg = self.config
        mask = batch.mask
        stale = int(((batch.versions < self.engine.policy_version) & (mask > 0)).sum())
        old_logprobs = self.old_logprobs(batch)
        rewards, kl = core.kl_penalized_rewards(
            batch.scores, old_logprobs, batch.ref_logprobs, mask, cfg.kl_coef
        )
        advantages, returns = core.gae(rewards, batch.values, mask, cfg.gamma, cfg.lam)
        if cfg.whiten_advantages:  # NOTE: over the global batch, which every rank holds
            advantages = core.masked_whiten(advantages, mask)
        truncation = cfg.is_truncation if cfg.off_policy == "truncated_is" else None
        g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + self.steps)
        names = ("policy_loss", "value_loss", "clipfrac", "approx_kl")
        sums = torch.zeros(len(names), dtype=torch.float64, device=self.device)  # this rank's shares
        grad_norm = 0.0
        n_minibatches = 0
        lengths = batch.attention_mask.sum(1)
        for _ in range(cfg.epochs):
            for minibatch in self._minibatches(lengths, g):
                minibatch = minibatch.to(self.device)
                count = mask[minibatch].sum()  # the whole minibatch's tokens, over every rank's share
                idx, weight = self._my_rows(minibatch)
                width = int(lengths[idx].max())  # NOTE: right-padded rows: trimming is exact (causal)
                mb = batch.select(idx).trim(width)
                old, adv, ret = (t[idx, : width - 1] for t in (old_logprobs, advantages, returns))
                m = mb.mask
                new_logprobs = core.token_logprobs(
                    self.actor, mb.input_ids, mb.attention_mask, cfg.temperature
                )
                pg_loss, clipfrac, approx_kl = core.policy_loss(
                    new_logprobs, old, adv, m, cfg.clip_range, truncation, count
                )
                new_values = core.token_values(self.critic, mb.input_ids, mb.attention_mask)
                vf_loss = core.value_loss(new_values, mb.values, ret, m, cfg.clip_range_value, count)
                self.actor_optim.zero_grad(set_to_none=True)
                self.critic_optim.zero_grad(set_to_none=True)
                # FSDP averages the ranks' gradients: scaled by W, the average is the minibatch loss's.
                ((pg_loss + cfg.value_coef * vf_loss) * (weight * self.world_size)).backward()
                norm = nn.utils.clip_grad_norm_(self.actor.parameters(), cfg.max_grad_norm)
                nn.utils.clip_grad_norm_(self.critic.parameters(), cfg.max_grad_norm)
                self.actor_optim.step()
                self.critic_optim.step()
                sums += weight * torch.stack([pg_loss, vf_loss, clipfrac, approx_kl]).detach().double()
                grad_norm += float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
                n_minibatches += 1
        ranks.all_reduce_sum(sums, self.group)
        return dict(
            reward=float(batch.scores.mean()),
            kl=float(kl.sum(1).mean()),
            response_len=float(mask.sum(1).mean()),
            stale_tokens=stale,
            grad_norm=grad_norm / n_minibatches,
            **dict(zip(names, (sums / n_minibatches).tolist(), strict=True)),
        )

    def _minibatches(self, lengths: torch.Tensor, g: torch.Generator) -> list[torch.Tensor]:
        """One epoch's minibatches of global row indices (``W * minibatch_size`` rows each): random, or
        (``group_by_length``) rows of similar length together, the minibatches in random order. Every
        rank draws the same ones (``g`` is seeded alike)."""
        size = self.config.minibatch_size * self.world_size
        if not self.config.group_by_length:
            return list(torch.randperm(len(lengths), generator=g).split(size))
        order = torch.argsort(lengths.cpu(), stable=True).split(size)
        return [order[i] for i in torch.randperm(len(order), generator=g).tolist()]

    def train(self, steps: int, callback=None) -> list[PPOStepStats]:
        """``steps`` PPO steps; ``callback(stats)`` after each."""
        history = []
        for _ in range(steps):
            history.append(self.step())
            if callback is not None:
                callback(history[-1])
        return history

    def close(self) -> None:
        """Close the trainer's engine (its KV arena); the models stay the caller's."""
        self.engine.close()


def _check_sharding(actor, critic, reference, reward, world_size: int) -> None:
    """ValueError unless the trained models are FSDP2-sharded exactly when there are several ranks, and the
    frozen ones never are."""
    for model, role in ((reference, "reference"), (reward, "reward")):
        if ranks.is_sharded(model):
            raise ValueError(f"{role}: a frozen model is replicated on every rank, never sharded")
    for model, role in ((actor, "actor"), (critic, "critic")):
        sharded = ranks.is_sharded(model)
        if world_size > 1 and not sharded:
            raise ValueError(
                f"{role}: data-parallel PPO on {world_size} ranks trains FSDP2-sharded models (gradients "
                "are reduced by FSDP): shard it with oppo_engine.ppo.ranks.shard_model"
            )
        if world_size > 1 and ranks.shard_count(model) != world_size:
            raise ValueError(
                f"{role} is sharded over {ranks.shard_count(model)} ranks, process_group has "
                f"{world_size}: FSDP averages gradients over its mesh, which must be the group's ranks"
            )
        if world_size == 1 and sharded and ranks.shard_count(model) > 1:
            raise ValueError(
                f"{role} is sharded over {ranks.shard_count(model)} ranks: pass process_group= "
                "(the same group) so that rollouts, advantages and minibatches span them"
            )


def _overcommit_bound(config: EngineConfig) -> int:
    """The most sequences beyond B that one step holds (Δ's upper bound): the queue never runs dry."""
    if config.mode not in ("inter", "oppo"):
        return 0
    if isinstance(config.overcommit, int):
        return config.overcommit
    return config.delta.max if config.delta.max is not None else config.batch_size


def engine_config_for(config: PPOConfig, **overrides) -> EngineConfig:
    """An ``EngineConfig`` with ``config``'s batch size (and the given overrides)."""
    return dataclasses.replace(EngineConfig(batch_size=config.batch_size), **overrides)
