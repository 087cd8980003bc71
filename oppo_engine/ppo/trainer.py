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

import contextlib
import dataclasses
import itertools
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from oppo_engine.config import EngineConfig, SamplingParams
from oppo_engine.engine import RolloutEngine
from oppo_engine.model.support import text_config
from oppo_engine.ppo import agreement, core, prefix, ranks
from oppo_engine.ppo.agreement import Agreement
from oppo_engine.ppo.batch import RolloutBatch, canonical_order, collate
from oppo_engine.ppo.config import PPOConfig
from oppo_engine.ppo.pack_attention import batched_attention
from oppo_engine.ppo.packing import (
    Pack,
    check_batched_packing,
    check_packing,
    pack_logprobs,
    pack_rows,
    pack_values,
    plan_packs,
    plan_sorted_packs,
)
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
    # The gap between the engine's behaviour log-probs and the trainer's forward before the first optimizer
    # step, per token class (agreement.CLASSES); None with measure_agreement=False.
    agreement: dict[str, Agreement] | None = None
    agreement_s: float = 0.0  # that no-grad forward and its statistics (part of update_s)
    truncated_sampling: bool = False  # top-k/top-p: the behaviour log-probs are of a truncated law
    rollout_weight: float = float("nan")  # mean rollout-correction weight over sampled tokens
    skipped_minibatches: int = 0  # minibatches not stepped: non-finite loss or gradient norm


def _check_one_label(model: nn.Module, role: str) -> None:
    labels = getattr(model.config, "num_labels", None)
    if labels != 1 or not isinstance(getattr(model, "score", None), nn.Module):
        raise ValueError(
            f"{role} must be a sequence-classification model with one label (a `score` head), got "
            f"{type(model).__name__} with num_labels={labels}"
        )


def adamw(params, lr: float) -> torch.optim.AdamW:
    """AdamW over ``params``, on torch's fused kernel (``fused=True``) where every trained parameter's device
    and dtype have one (CPU or CUDA, a real floating dtype) and it is contiguous, else torch's default
    implementation.

    For fp32 weights the same update to rounding (4.5e-8 at most over the first 4M of 135M parameters after
    three steps, against the default's per-parameter loop), and on a CPU 3.7-6.1x faster: 0.17 s against
    1.04 s a step for SmolLM2's 135M fp32 parameters with 2 threads (docs/benchmarks.md, "The optimizer
    step"). The update steps AdamW once per minibatch for actor and critic each: on the math demo eight
    steps a PPO step, some 7-11 s of the default's loop (a prediction from those figures). The fused kernel
    does not bump a parameter's ``_version``; packed weights are dropped by ``update_policy()`` instead
    (``model/packed.py``)."""
    params = list(params)
    trained = [p for p in params if p.requires_grad]
    # Contiguous only: torch's fused CPU kernel steps a parameter whose strides differ from its gradient's
    # (a view into a wider buffer) wrongly, without an error (6e-2 off the default after 3 steps at lr 1e-2).
    fused = all(
        p.device.type in _FUSED_DEVICES and p.dtype in _FUSED_DTYPES and p.is_contiguous() for p in trained
    )
    # Not fused: torch's own choice (None: foreach on CUDA), not fused=False (the per-tensor loop there too).
    return torch.optim.AdamW(params, lr=lr, fused=True if fused and trained else None)


# Where torch's fused AdamW kernel runs (torch checks only at the first step, so the trainer decides here).
_FUSED_DEVICES = ("cpu", "cuda")
_FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class PPOTrainer:
    """PPO on ``actor`` (causal LM) and ``critic`` (one-label value model), against a frozen ``reference``
    (causal LM) and a frozen ``reward`` model (one label), all HF models sharing ``tokenizer``'s vocabulary;
    ``reward`` may also be a rule, ``reward(prompt_ids, response_ids) -> float`` (or ``BatchedReward``).

    Multi-turn episodes: with ``env`` (an environment factory, docs/multi-turn.md) every rollout is an
    episode whose turns end on ``turn_stop_token_ids`` (or after ``max_turn_tokens``), at most ``max_turns``
    of them, each observation cut to ``max_observation_tokens``. Observation tokens are masked out of the
    policy loss, the KL penalty and the value loss (``Rollout.action_mask``); GAE carries across them.

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
        env=None,
        turn_stop_token_ids: Sequence[int] = (),
        max_turn_tokens: int | None = None,
        max_turns: int | None = None,
        max_observation_tokens: int | None = None,
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
        if isinstance(reward, nn.Module):
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
            if isinstance(model, nn.Module):
                model.requires_grad_(False)
        self.actor, self.critic, self.reference, self.reward = actor, critic, reference, reward
        self.tokenizer = tokenizer
        self._sampling = SamplingParams(
            temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens, seed=cfg.seed,
            turn_stop_token_ids=tuple(turn_stop_token_ids), max_turn_tokens=max_turn_tokens,
            max_turns=max_turns, max_observation_tokens=max_observation_tokens,
        )  # fmt: skip
        self.engine = RolloutEngine(
            actor=actor,
            reward=reward,
            reference=reference,
            critic=critic,
            config=engine_config,
            sampling=self._sampling,
            eos_token_id=tokenizer.eos_token_id,
            process_group=process_group,
            env=env,
        )
        # The engine resolves max_model_len (None: the models' limit), so the check reads its value.
        longest = max(len(p) for p in prompts)
        if longest + cfg.max_new_tokens > self.engine.max_model_len:
            self.engine.close()
            raise ValueError(
                f"a prompt of {longest} tokens plus max_new_tokens={cfg.max_new_tokens} exceeds "
                f"max_model_len={self.engine.max_model_len}"
            )
        self._probe_prompt = prompts[0]
        # Why each trained model's packs cannot take the batched attention ("" for none), probed once.
        self._batched_refusal: dict[str, str] = {}
        # Why each trained model's packs cannot run the dense mask, where "auto" batches them instead.
        self._dense_refusal: dict[str, str] = {}
        if cfg.max_tokens_per_microbatch is not None:
            try:
                _check_packing_budget(cfg, longest, self.engine.max_model_len, env is not None)
                if cfg.pack_attention != "dense":
                    self._pack_attention_modes()  # the batched probes ("batched": a refusal raises here)
                if cfg.pack_attention != "batched":
                    dense = {}  # the dense probes' refusals ("" for none): every rank probes both models
                    failure = None  # a probe's error that is not a refusal: raised once every rank knows it
                    for role, model, forward in (
                        ("actor", actor, _pack_logprobs),
                        ("critic", critic, pack_values),
                    ):
                        try:
                            check_packing(model, role, prompts[0], forward)
                            dense[role] = ""
                        except ValueError as e:
                            dense[role] = str(e)
                        except Exception as e:  # shared with the other ranks, then raised
                            if not ranks.shared_failure(e):
                                raise
                            failure, dense[role] = failure or e, ""
                    # NOTE: any rank's refusal is every rank's, agreed before any rank raises: a rank raising
                    # (or later refusing the dense fallback) alone would leave the others in a collective.
                    agreed = ranks.refusals_on_any_rank(dense, process_group, failure)
                    for role, reason in agreed.items():
                        if not reason:
                            continue
                        # "auto" with the batched attention verified needs the dense mask only if the
                        # model turns activation checkpointing on later: refused then, not now.
                        if cfg.pack_attention != "auto" or self._batched_refusal[role]:
                            raise ValueError(reason)
                        self._dense_refusal[role] = reason
            except Exception:  # a refusal, or a probe's failure on this rank or another: nothing left running
                self.engine.close()
                raise
        self._share_prefix = False  # the update computes each minibatch's common prompt prefix once
        if cfg.share_prefix is not False and cfg.max_tokens_per_microbatch is None:
            reason = (
                f"{self.world_size} data-parallel ranks (each would make its own number of forward calls)"
                if self.world_size > 1
                else prefix.check_prefix(actor, "actor", prompts[0], _probe_logprobs)
                or prefix.check_prefix(critic, "critic", prompts[0], _probe_values)
            )
            if reason is not None and cfg.share_prefix is True:
                self.engine.close()
                raise ValueError(f"PPOConfig.share_prefix=True: {reason}")
            if reason is not None:
                logger.info("PPOConfig.share_prefix='auto': off (padded minibatches): %s", reason)
            self._share_prefix = reason is None
        self._prompts = ranks.rank_prompts(
            prompts, rank=self.rank, world_size=self.world_size, block=cfg.batch_size
        )
        self._queued = 0  # prompts handed to the engine and not yet returned by a step
        self._queue_target = cfg.batch_size + _overcommit_bound(engine_config)
        self._feed_engine()
        self.device = next(actor.parameters()).device
        self.actor_optim = adamw(actor.parameters(), lr=cfg.lr)
        self.critic_optim = adamw(critic.parameters(), lr=cfg.critic_lr)
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
        self._stepped = False  # set by _update at its first optimizer step
        try:
            stats = self._update(batch)
        except BaseException:
            # A refusal (non-finite loss) or an error after some minibatches were stepped: the weights moved,
            # so the engine must not go on sampling them under the old policy version (nor from a stale
            # rollout replica).
            if self._stepped:
                self.engine.update_policy()
            raise
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

    def _micro_batches(self, rows: torch.Tensor, lengths: torch.Tensor) -> list[tuple[torch.Tensor, float]]:
        """This rank's forwards over the global ``rows`` as ``(row indices, loss weight)``: its share in one
        padded micro-batch, or (``max_tokens_per_microbatch``) its share's packs. FSDP runs every forward on
        every rank, so every rank gets as many: the ranks' packs are planned alike on every rank (each holds
        the global batch), and a rank with fewer runs the first row of ``rows`` with weight 0."""
        budget = self.config.max_tokens_per_microbatch
        if budget is None:
            return [self._my_rows(rows)]
        shares = torch.tensor_split(rows, self.world_size)
        plan = plan_sorted_packs if any(self._pack_attention_modes().values()) else plan_packs
        plans = [plan(lengths[share].tolist(), budget) for share in shares]
        mine = shares[self.rank]
        packs = [(mine[torch.tensor(p, device=mine.device)], 1.0) for p in plans[self.rank]]
        return packs + [(rows[:1], 0.0)] * (max(map(len, plans)) - len(packs))

    def _forward(
        self,
        batch: RolloutBatch,
        rows: torch.Tensor,
        lengths: torch.Tensor,
        values: bool,
        keep_open: contextlib.ExitStack | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, int]:
        """``(log-probs, values or None, w)``, each ``[n, w-1]``, of ``rows`` (``w``: their longest): one
        forward per model, padded to ``w`` (exact: right padding, causal models) or packed. ``keep_open``: a
        pack's batched-attention switches are entered into it and stay on until the caller closes it, after
        the backward (activation checkpointing recomputes the forward inside the backward: with the switch
        off by then, the recompute would attend across the pack's sequences)."""
        cfg = self.config
        width = int(lengths[rows].max())
        # Only the sampled tokens' log-probs are ever read (the losses, the agreement and the stale
        # recompute are masked): the LM head and its log-softmax run on those positions alone, packed or
        # padded (not on prompts and padding).
        keep = batch.mask[rows, : width - 1] > 0
        if cfg.max_tokens_per_microbatch is not None:
            pack = pack_rows(batch.input_ids[rows], lengths[rows].tolist(), keep)
            batched = self._pack_attention_modes()
            with contextlib.ExitStack() as stack:
                stack.enter_context(self._pack_attention(self.actor, pack, batched["actor"]))
                logprobs = pack_logprobs(self.actor, pack, cfg.temperature)
                if values:
                    stack.enter_context(self._pack_attention(self.critic, pack, batched["critic"]))
                    critic_values = pack_values(self.critic, pack)
                if keep_open is not None:
                    keep_open.enter_context(stack.pop_all())
            return logprobs, critic_values if values else None, width
        ids, attention_mask = batch.input_ids[rows, :width], batch.attention_mask[rows, :width]
        share = self._share_prefix and not any(map(prefix.checkpointing, (self.actor, self.critic)))
        shared = prefix.shared_prefix(ids, keep, lengths=lengths[rows]) if share else 0
        logprobs = prefix.logprobs(self.actor, ids, attention_mask, cfg.temperature, keep, shared)
        return logprobs, prefix.values(self.critic, ids, attention_mask, shared) if values else None, width

    def _pack_attention_modes(self) -> dict[str, bool]:
        """Whether the actor's and the critic's packs run their attention batched, from
        ``PPOConfig.pack_attention`` and each model's probe (made the first time it is needed, collective;
        ``ValueError`` under ``"batched"`` for a model refused). A model that turned activation checkpointing
        on since runs dense under ``"auto"`` (``"batched"``: refused by the switch), or raises ``ValueError``
        where the dense mask cannot serve it (its build-time dense probe refused it)."""
        cfg = self.config
        models = {"actor": (self.actor, _pack_logprobs), "critic": (self.critic, pack_values)}
        if cfg.pack_attention == "dense" or cfg.max_tokens_per_microbatch is None:
            return dict.fromkeys(models, False)
        if not self._batched_refusal:
            refusals, failure = {}, None
            for role, (model, forward) in models.items():
                try:
                    check_batched_packing(
                        model, role, self._probe_prompt, forward, cfg.max_tokens_per_microbatch
                    )
                    refusals[role] = ""
                except ValueError as e:
                    refusals[role] = str(e)
                except Exception as e:  # shared with the other ranks, then raised
                    if not ranks.shared_failure(e):
                        raise
                    failure, refusals[role] = failure or e, ""
            # Every rank must plan its packs alike (and run as many forwards): any rank's refusal is every
            # rank's, agreed before any rank acts on it (as the dense probes' are); so is a probe's failure.
            self._batched_refusal = ranks.refusals_on_any_rank(refusals, self.group, failure)
            for role, reason in self._batched_refusal.items():
                if reason and cfg.pack_attention == "auto":
                    logger.info("PPOConfig.pack_attention='auto': %s's packs stay dense: %s", role, reason)
        modes = {}
        for role, (model, _) in models.items():
            if cfg.pack_attention == "batched" and self._batched_refusal[role]:
                raise ValueError(self._batched_refusal[role])
            modes[role] = not self._batched_refusal[role] and (
                cfg.pack_attention == "batched" or not prefix.checkpointing(model)
            )
            if not modes[role] and self._dense_refusal.get(role):
                raise ValueError(
                    f"PPOConfig.pack_attention='auto': the {role} turned activation checkpointing on, so its "
                    f"packs would run the dense mask, which it cannot: {self._dense_refusal[role]}"
                )
        return modes

    @staticmethod
    def _pack_attention(model: nn.Module, pack: Pack, batched: bool):
        return batched_attention(model, pack.lengths) if batched else contextlib.nullcontext()

    def trainer_logprobs(self, batch: RolloutBatch, rows: torch.Tensor | None = None) -> torch.Tensor:
        """``[N, L-1]`` the current actor's log-probs (pi_trainer) of ``rows`` (default: every row; 0
        elsewhere) from no-grad forwards in eval semantics (no dropout, as the engine samples): packs (of
        sequences of similar length where a pack's attention is batched), or chunks of rows of similar
        length each trimmed to its longest (under long-tailed lengths a padded batch is mostly padding).
        Data-parallel ranks split the rows and sum what they computed, so every rank holds the whole tensor.
        Collective."""
        out = torch.zeros_like(batch.logprobs)
        lengths = batch.attention_mask.sum(1)
        rows = torch.arange(len(batch), device=lengths.device) if rows is None else rows
        if self.config.max_tokens_per_microbatch is not None:
            groups = [rows]
        else:
            chunk = self.config.minibatch_size * self.world_size
            groups = rows[torch.argsort(lengths[rows], stable=True)].split(chunk)
        with torch.no_grad(), core.eval_semantics(self.actor):
            for group in groups:
                for idx, weight in self._micro_batches(group, lengths):
                    logprobs, _, width = self._forward(batch, idx, lengths, values=False)
                    if weight:
                        out[idx, : width - 1] = logprobs
        ranks.all_reduce_sum(out, self.group)
        return out

    def old_logprobs(self, batch: RolloutBatch, trainer_logprobs: torch.Tensor | None = None) -> torch.Tensor:
        """The log-probs the PPO ratio is taken against (``trainer_logprobs``: pi_trainer of every row,
        computed here when needed and not given).

        Without a rollout correction, tokens sampled by the current policy keep their behaviour log-probs;
        with ``off_policy="recompute"`` the stale ones (sampled before the last ``update_policy()``) get the
        current actor's, so the update starts on-policy. With a rollout correction every token's is the
        trainer's (the correction weights carry pi_trainer / pi_behaviour), except stale tokens under
        ``off_policy="truncated_is"``, which keep their behaviour log-probs and a truncated PPO ratio."""
        cfg = self.config
        stale = (batch.versions < self.engine.policy_version) & (batch.mask > 0)
        if cfg.rollout_correction is not None:
            trainer = self.trainer_logprobs(batch) if trainer_logprobs is None else trainer_logprobs
            keep = stale if cfg.off_policy == "truncated_is" else torch.zeros_like(stale)
            return torch.where(keep, batch.logprobs, trainer)
        if cfg.off_policy != "recompute" or not stale.any():
            return batch.logprobs
        if trainer_logprobs is None:
            trainer_logprobs = self.trainer_logprobs(batch, stale.any(1).nonzero().flatten())
        return torch.where(stale, trainer_logprobs, batch.logprobs)

    def _correction(self, batch: RolloutBatch, trainer_logprobs: torch.Tensor, stale: torch.Tensor):
        """The rollout correction's per-token weights (``agreement.correction_weights``); stale tokens under
        ``off_policy="truncated_is"`` are not corrected (their PPO ratio is against the behaviour policy)."""
        cfg = self.config
        corrected = batch.mask > 0
        if cfg.off_policy == "truncated_is":
            corrected = corrected & ~stale
        delta = torch.where(corrected, trainer_logprobs - batch.logprobs, 0.0)
        weights = agreement.correction_weights(
            delta, corrected, cfg.rollout_correction, cfg.rollout_correction_cap, cfg.rollout_correction_level
        )
        # NOTE: at the sequence level every token of a row gets the row's weight: a token left uncorrected
        # (stale under truncated_is) keeps 1, as at the token level.
        return torch.where(corrected, weights, 1.0)

    def _update(self, batch: RolloutBatch) -> dict:
        cfg = self.config
        mask = batch.mask
        stale_mask = (batch.versions < self.engine.policy_version) & (mask > 0)
        t0 = time.perf_counter()
        trainer = None
        if cfg.measure_agreement or cfg.rollout_correction is not None:
            trainer = self.trainer_logprobs(batch)  # before the first optimizer step of this update
        gap = None
        if cfg.measure_agreement:
            gap = agreement.measure(trainer, batch.logprobs, mask, stale_mask, batch.carried)
        agreement_s = time.perf_counter() - t0
        old_logprobs = self.old_logprobs(batch, trainer)
        weights = self._correction(batch, trainer, stale_mask) if cfg.rollout_correction is not None else None
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
        n_minibatches = skipped = 0
        lengths = batch.attention_mask.sum(1)
        for _ in range(cfg.epochs):
            for minibatch in self._minibatches(lengths, g):
                minibatch = minibatch.to(self.device)
                count = mask[minibatch].sum()  # the whole minibatch's tokens, over every rank's share
                self.actor_optim.zero_grad(set_to_none=True)
                self.critic_optim.zero_grad(set_to_none=True)
                shares = torch.zeros_like(sums)
                # One forward and backward per micro-batch, the gradients accumulated: each one's losses are
                # its tokens' sums over the minibatch's count, so together they are the minibatch's means.
                for idx, weight in self._micro_batches(minibatch, lengths):
                    switches = contextlib.ExitStack()  # a pack's batched attention, on through its backward
                    with switches:
                        new_logprobs, new_values, width = self._forward(batch, idx, lengths, True, switches)
                        old, adv, ret, m, values = (
                            t[idx, : width - 1]
                            for t in (old_logprobs, advantages, returns, mask, batch.values)
                        )
                        w = weights[idx, : width - 1] if weights is not None else None
                        pg_loss, clipfrac, approx_kl = core.policy_loss(
                            new_logprobs, old, adv, m, cfg.clip_range, truncation, count, w
                        )
                        vf_loss = core.value_loss(new_values, values, ret, m, cfg.clip_range_value, count)
                        # FSDP averages the ranks' gradients: scaled by W, their average is the loss.
                        ((pg_loss + cfg.value_coef * vf_loss) * (weight * self.world_size)).backward()
                        if weight:
                            shares += (
                                weight
                                * torch.stack([pg_loss, vf_loss, clipfrac, approx_kl]).detach().double()
                            )
                norm = _full(nn.utils.clip_grad_norm_(self.actor.parameters(), cfg.max_grad_norm))
                critic_norm = _full(nn.utils.clip_grad_norm_(self.critic.parameters(), cfg.max_grad_norm))
                if self._refuse_nonfinite(shares, norm, critic_norm):
                    skipped += 1
                    continue
                # Set before the steps: if one raises half-way, the weights may have moved, and the engine
                # is still updated (step()'s error path).
                self._stepped = True
                self.actor_optim.step()
                self.critic_optim.step()
                # Under an enclosing torch.autocast (the demo's bf16 update, a user's) the casts of the fp32
                # weights are cached until the outermost autocast exits, and the cache does not see an
                # in-place optimizer step: every later minibatch would run on the pre-step weights.
                torch.clear_autocast_cache()
                sums += shares
                grad_norm += norm
                n_minibatches += 1
        ranks.all_reduce_sum(sums, self.group)
        means = sums / n_minibatches if n_minibatches else torch.full_like(sums, math.nan)
        sampled = mask > 0
        return dict(
            reward=float(batch.scores.mean()),
            kl=float(kl.sum(1).mean()),
            response_len=float(mask.sum(1).mean()),
            stale_tokens=int(stale_mask.sum()),
            grad_norm=grad_norm / n_minibatches if n_minibatches else math.nan,
            agreement=gap,
            agreement_s=agreement_s,
            truncated_sampling=self._sampling.top_k > 0 or self._sampling.top_p < 1,
            rollout_weight=float(weights[sampled].mean()) if weights is not None else math.nan,
            skipped_minibatches=skipped,
            **dict(zip(names, means.tolist(), strict=True)),
        )

    def _refuse_nonfinite(self, shares: torch.Tensor, actor_norm: float, critic_norm: float) -> bool:
        """Whether a minibatch must not be stepped: its loss (this rank's share, any rank's) or a gradient
        norm is not finite. ``on_nonfinite="raise"`` raises ``RuntimeError`` instead; either way the
        gradients are dropped and nothing reaches the weights (nor, through them, ``update_policy()``)."""
        bad = torch.tensor(
            [float(not (torch.isfinite(shares[:2]).all() and math.isfinite(actor_norm + critic_norm)))],
            device=self.device,
        )
        ranks.all_reduce_sum(bad, self.group)
        if not bad.item():
            return False
        self.actor_optim.zero_grad(set_to_none=True)
        self.critic_optim.zero_grad(set_to_none=True)
        message = (
            f"PPO step {self.steps + 1}: a minibatch's loss or gradient norm is not finite (policy loss "
            f"{float(shares[0])}, value loss {float(shares[1])} on rank {self.rank}; gradient norms: actor "
            f"{actor_norm}, critic {critic_norm}): the optimizer step is refused"
        )
        if self.config.on_nonfinite == "raise":
            raise RuntimeError(message)
        logger.warning("%s; skipped (on_nonfinite='skip')", message)
        return True

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
        if isinstance(model, nn.Module) and ranks.is_sharded(model):
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


def _full(norm: torch.Tensor) -> float:
    """A gradient norm as a float (an FSDP2 norm is a DTensor: its full value)."""
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)


def _pack_logprobs(model: nn.Module, pack: Pack) -> torch.Tensor:
    return pack_logprobs(model, pack, 1.0)


def _probe_logprobs(model, ids, mask, keep, p):
    return prefix.logprobs(model, ids, mask, 1.0, keep, p)


def _probe_values(model, ids, mask, keep, p):
    return prefix.values(model, ids, mask, p)


def _check_packing_budget(cfg: PPOConfig, longest_prompt: int, max_model_len: int, episodes: bool) -> None:
    """ValueError unless a pack of ``max_tokens_per_microbatch`` tokens holds the longest sequence a step
    can return: the longest prompt plus ``max_new_tokens``, or ``max_model_len`` for multi-turn episodes."""
    budget = cfg.max_tokens_per_microbatch
    longest = max_model_len if episodes else longest_prompt + cfg.max_new_tokens
    if budget < longest:
        what = (
            f"max_model_len={max_model_len} (an episode's length)"
            if episodes
            else f"the longest prompt ({longest_prompt}) plus max_new_tokens={cfg.max_new_tokens}"
        )
        raise ValueError(
            f"PPOConfig.max_tokens_per_microbatch={budget} is smaller than {what}: a sequence must fit in "
            "one pack"
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
