"""RolloutEngine: the facade a PPO loop holds (public API: see DESIGN.md)."""

from __future__ import annotations

import contextlib
import math
import os
import time
import warnings
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from oppo_engine import ops
from oppo_engine.cache import KVArena, KVCacheManager, KVSpec
from oppo_engine.cache.arena import fit_page_size, page_bytes_for
from oppo_engine.cache.swap import HostPages, swap_in, swap_out
from oppo_engine.config import EngineConfig, SamplingParams
from oppo_engine.control import OFF, ChunkSizeController, DeltaController
from oppo_engine.dist.group import StepReport, collective, join_group
from oppo_engine.dist.remote import RemoteScorers
from oppo_engine.model.actor import ActorWorker
from oppo_engine.model.attention import paged_attention_enabled
from oppo_engine.model.eos import resolve_eos_token_ids
from oppo_engine.model.graph import CapturedDecode, graph_enabled
from oppo_engine.model.replica import RolloutReplicas
from oppo_engine.model.roles import ACTOR, CRITIC, REFERENCE, REWARD, collect_models, device_of, dtype_of
from oppo_engine.model.runner import ModelRunner, unwrap_model
from oppo_engine.model.scorer import (
    CriticScorer,
    ReferenceScorer,
    RewardScorer,
    RuleReward,
    RuleScorer,
    Scorer,
)
from oppo_engine.model.support import resolve_max_model_len, text_config
from oppo_engine.model.warmup import warm_up_models
from oppo_engine.obs import GpuUtilSampler, StepMetrics, Timeline, log_step
from oppo_engine.obs.staleness import StaleBatchWarning
from oppo_engine.prompt_input import one_prompt, to_token_lists
from oppo_engine.sched.lanes import ACTOR_PRIORITY, SCORER_PRIORITY, DeviceLane, ScorerLane
from oppo_engine.sched.overcommit import BatchCut, OvercommitBuffer, lag_due
from oppo_engine.sched.profiler import SwitchCostProfiler
from oppo_engine.sched.prompts import PromptQueue
from oppo_engine.sched.quarantine import describe, run_quarantined
from oppo_engine.sched.scheduler import ActorScheduler
from oppo_engine.sched.sequence import SeqStatus
from oppo_engine.sched.sequence import Sequence as _Seq
from oppo_engine.sched.state import load_sequence, restart_from_prompt, save_sequence, why_not_carried
from oppo_engine.sched.step import StepLoop, StepOutcome

# The streamed scorers, in the order the sequential loop runs them, with the class that drives each.
_SCORER_CLASSES: dict[str, type[Scorer]] = {
    REWARD: RewardScorer,
    REFERENCE: ReferenceScorer,
    CRITIC: CriticScorer,
}

# Trained scorers: their KV and results of a carried-over sequence are recomputed after a policy update.
_TRAINED_SCORERS = [CRITIC]
# Share of memory the arena may take when kv_cache_bytes is not given: of the free device memory on
# CUDA, of the physical memory on the CPU.
DEFAULT_CUDA_MEMORY_FRACTION = 0.4
DEFAULT_HOST_MEMORY_FRACTION = 0.25
# 2: sequences carry their sample index (groups); 3: the settings they depend on ("settings"). 2 still loads.
_STATE_VERSION = 3
_READABLE_STATE_VERSIONS = (2, 3)


@dataclass(slots=True)
class Rollout:
    """One scored rollout. ``logprobs[i]``, ``policy_versions[i]``, ``ref_logprobs[i]`` and ``values[i]``
    belong to ``response_ids[i]``.

    ``logprobs`` are the behaviour log-probs (of the distribution the token was drawn from, after
    temperature, top-k and top-p); ``ref_logprobs`` the reference model's (logits over the temperature, no
    truncation; None without a reference); ``values`` the critic's value of the state before each token
    (None without a critic).
    """

    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    reward: float
    policy_versions: list[int]
    deferred_steps: int
    ref_logprobs: list[float] | None = None
    values: list[float] | None = None
    group_id: int = 0
    sample_index: int = 0
    finish_reason: str = "length"  # "eos" | "stop" | "length" | "max_model_len" | "error"
    error: str | None = None  # the failure's message when finish_reason == "error"


@dataclass(slots=True)
class StepResult:
    """The rollouts of one ``step()`` in finish order, and what the step measured. ``failed`` holds the
    quarantined rollouts: whole groups whose forward or reward failed alone (``finish_reason="error"``,
    ``error`` the message, NaN reward), never counted among the B."""

    rollouts: list[Rollout]
    metrics: StepMetrics
    failed: list[Rollout] = field(default_factory=list)


@dataclass(slots=True)
class CacheStats:
    """Pages of the shared arena: total, free, held per model (a shared page once), retained across steps,
    and shared by several samples of a group (per model)."""

    total_pages: int
    free_pages: int
    pages_per_model: dict[str, int] = field(default_factory=dict)
    retained_pages: int = 0  # held for carried-over sequences, in the arena or (released) on host
    page_bytes: int = 0
    shared_pages: dict[str, int] = field(default_factory=dict)


class RolloutEngine:
    """Produces ``batch_size`` scored rollouts per ``step()`` from a queue of prompts.

    ``actor`` is an HF causal LM and ``reward`` an HF sequence-classification model with one label (or a
    plain callable ``reward(prompt_ids, response_ids) -> float``, or ``BatchedReward(fn)`` with
    ``fn(prompts, responses) -> list[float]``; neither is streamed; each result must be a finite number).
    ``reference`` (a frozen causal LM) and ``critic`` (a one-label value model) are optional scorers that fill
    ``Rollout.ref_logprobs`` and ``Rollout.values``. All are used as they are (shared with the trainer,
    in train mode or not, PEFT-wrapped or not); the engine keeps their KV in one paged arena of its own. A
    model the engine cannot run exactly is refused here, with a ``ValueError`` naming the feature.

    The reward model reads the actor's token ids, so its vocabulary must be the actor's. A reward model
    with another vocabulary is refused unless both tokenizers are given (``tokenizer`` for the actor,
    ``reward_tokenizer``); when their vocabularies differ, each finished sequence is decoded with the
    actor's tokenizer (special tokens skipped), re-encoded with the reward model's (its own special tokens
    added) and scored by the reward model's own HF forward -- exact, but not streamed. ``tokenizer`` alone
    lets ``add_prompts`` take text and chat conversations.

    ``eos_token_id=None`` stops at the union of the EOS ids in the actor's ``generation_config`` and
    config (with a warning if neither lists one); ``()`` never stops on EOS.

    ``max_model_len`` is the resolved ``EngineConfig.max_model_len`` (``None`` there: the smallest of 4096
    and every model's position limit): the most prompt + response tokens of any sequence.

    ``process_group`` (a ``torch.distributed`` group; ``None``: single process) makes this engine one of a
    data-parallel group (``oppo_engine.dist.group``): one engine per rank over that rank's prompts,
    ``batch_size`` per rank. The constructor, ``step()`` and ``report_reward()`` are then collective (called
    in the same order on every rank; a rank with no prompts left still calls ``step()``); the constructor
    raises ``ValueError`` on every rank if the ranks' mode, batch size, ``n``, overcommit, chunk size,
    ``delta``, ``chunk``, ``max_deferrals`` or ``retained_kv`` differ. The online controllers are fed the
    group's numbers (identical ``delta_history`` and ``chunk_history`` everywhere), and default seeds derive
    from the rank too. A failed collective raises ``GroupFailed`` naming it; only ``state_dict()`` and
    ``close()`` work after it.

    An FSDP2 (``fully_shard``) actor or critic runs as a full rollout replica in
    ``EngineConfig.rollout_dtype``, filled here from the trainer's shards (collective over its mesh) and
    refreshed by ``update_policy()``; one on the ``meta`` device gets its weights from
    ``update_policy(weights=...)`` (``critic_weights=``) before the first ``step()`` (README, "Sharded
    trainer models"). ``self.actor`` is the model the engine runs (the replica, where there is one).
    """

    def __init__(
        self,
        actor: torch.nn.Module,
        reward: torch.nn.Module | RuleReward,
        config: EngineConfig | None = None,
        sampling: SamplingParams | None = None,
        eos_token_id: int | Sequence[int] | None = None,
        tokenizer=None,
        reward_tokenizer=None,
        reference: torch.nn.Module | None = None,
        critic: torch.nn.Module | None = None,
        process_group: torch.distributed.ProcessGroup | None = None,
    ) -> None:
        self.config = config or EngineConfig()
        self.sampling = sampling or SamplingParams()
        cfg = self.config
        # Groups: every prompt yields n rollouts, cut and carried whole.
        group = self.sampling.n
        if cfg.batch_size % group:
            raise ValueError(
                f"batch_size={cfg.batch_size} is not a multiple of SamplingParams.n={group}: a step returns "
                "whole groups (batch_size counts rollouts)"
            )
        # Overcommit (inter, oppo): Δ is fixed, or chosen online from the reward trend.
        self._delta_control: DeltaController | None = None
        self._max_overcommit = 0
        if cfg.mode in ("inter", "oppo"):
            fixed = cfg.overcommit if isinstance(cfg.overcommit, int) else None
            if fixed is not None and fixed % group:
                raise ValueError(
                    f"overcommit={fixed} is not a multiple of SamplingParams.n={group}: groups are carried "
                    "whole"
                )
            delta = cfg.delta.resolve(cfg.batch_size, group)  # None defaults: B/8 and B/4, whole groups
            self._delta_control = DeltaController(delta, fixed=fixed)
            self._max_overcommit = _whole_groups(fixed if fixed is not None else delta.max, group)
        # A sharded (FSDP2) or meta-device actor/critic runs as a full rollout replica (model/replica.py).
        self._replicas = RolloutReplicas(
            {ACTOR: actor, CRITIC: critic}, (reward, reference), cfg.rollout_dtype
        )
        actor, critic = self._replicas.runs(ACTOR, actor), self._replicas.runs(CRITIC, critic)
        # Data parallel: one collective checks that the ranks share the settings (dist/group.py).
        # (after the replicas: a meta-device actor runs on its replica's device)
        self._group = join_group(process_group, cfg, self.sampling, device_of(actor))
        self.actor = actor
        self.tokenizer = tokenizer
        # The longest sequence, resolved from the config against every model's position limit.
        self.max_model_len = resolve_max_model_len(
            cfg.max_model_len, {ACTOR: actor, REWARD: reward, REFERENCE: reference, CRITIC: critic}
        )
        # The models the engine runs through its paged cache, by role (the name of their cache and lane).
        remote = reward if isinstance(reward, RemoteScorers) else None  # scored on another rank
        self._models, rule = collect_models(
            actor, reward, reference, critic, max_model_len=self.max_model_len, tokenizer=tokenizer,
            reward_tokenizer=reward_tokenizer, remote=remote is not None,
        )  # fmt: skip
        self.reward = reward if rule is None else rule
        self.reward_is_model = rule is None
        self.device = device_of(actor)
        self.vocab_size = int(text_config(actor).vocab_size)
        self.eos_token_ids = resolve_eos_token_ids(actor, eos_token_id)
        if remote is not None:  # the handshake: refuses another vocabulary, a longer max_model_len
            remote.connect(vocab_size=self.vocab_size, max_model_len=self.max_model_len,
                           local_reference=reference is not None)  # fmt: skip

        self._specs = {name: KVSpec.from_hf_config(m.config, dtype_of(m)) for name, m in self._models.items()}
        self._num_pages = self._plan_pages()
        for spec in self._specs.values():
            page_size = fit_page_size(spec, self._page_bytes)
            reason = ops.attention_backend_unavailable(self.config.attention_backend, page_size, self.device)
            if reason is not None:
                raise ValueError(
                    f"attention_backend={self.config.attention_backend!r} cannot be used: {reason}"
                )
        self._timeline = Timeline()
        # Streaming modes: the chunk size is fixed, or chosen online from the switch-cost profile.
        self._chunk_control: ChunkSizeController | None = None
        if self.config.mode in ("intra", "oppo"):
            fixed = self.config.chunk_size if isinstance(self.config.chunk_size, int) else None
            self._chunk_control = ChunkSizeController(self.config.chunk, fixed=fixed)
            scorers = [REWARD, REFERENCE, *(n for n in self._models if n != ACTOR)]  # remote ones too
            self._profiler = SwitchCostProfiler(ACTOR, scorers)
        self._gpu = GpuUtilSampler.for_device(self.device) if self.device.type == "cuda" else None
        self._prompts = PromptQueue(
            self.sampling, max_model_len=self.max_model_len, vocab_size=self.vocab_size,
            rank=None if self._group is None else self._group.rank,
        )  # fmt: skip
        self._buffer = OvercommitBuffer()
        self._policy_version = 0
        self._step_index = 0
        self._closed = False
        self._host: HostPages | None = None  # retained pages while the arena is released
        self._swap_buffer: torch.Tensor | None = None  # the last release's host buffer, reused by the next
        self._swapped_tokens: dict[str, int] = {}  # brought back from host since the last step
        self._trainer_reward = False  # report_reward() was called: it feeds the Δ controller from now on
        self._finished_tokens = self._finished_seqs = 0  # response lengths of every finished sequence
        self._stale_warning = StaleBatchWarning()
        self._arena: KVArena | None = None
        self._build_cache()

    # ------------------------------------------------------------------ set-up

    def _plan_pages(self) -> int:
        """Pages of the arena, validated against what one step needs at the least."""
        cfg = self.config
        page_bytes = self._page_bytes = page_bytes_for(self._specs, cfg.page_size)
        pages_per_seq = {
            name: -(-self.max_model_len // fit_page_size(spec, page_bytes))
            for name, spec in self._specs.items()
        }
        if cfg.kv_cache_bytes is not None:
            num_pages = cfg.kv_cache_bytes // page_bytes
        else:
            # B + Δ_max sequences in flight under overcommit.
            num_pages = (cfg.batch_size + self._max_overcommit) * sum(pages_per_seq.values())
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                budget = int(free * DEFAULT_CUDA_MEMORY_FRACTION)
            else:
                budget = int(
                    os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * DEFAULT_HOST_MEMORY_FRACTION
                )
            if self._group is not None:  # ranks on one host (one GPU) share its memory
                budget //= self._group.ranks_sharing_memory
            if self.device.type != "cuda":  # this rank's replicas come out of its share (on CUDA they are
                budget = max(0, budget - self._replicas.nbytes)  # allocated: the free memory excludes them)
            num_pages = min(num_pages, budget // page_bytes)
        one_sequence = sum(pages_per_seq.values())
        if num_pages < one_sequence:
            raise ValueError(
                f"kv_cache_bytes={cfg.kv_cache_bytes} gives {num_pages} pages of {page_bytes} bytes, but one "
                f"sequence of max_model_len={self.max_model_len} tokens needs {one_sequence} pages "
                f"in the caches of {', '.join(self._specs)} together; raise kv_cache_bytes or lower "
                "max_model_len"
            )
        if num_pages < cfg.batch_size:
            raise ValueError(
                f"batch_size={cfg.batch_size} exceeds what the cache can ever hold: {num_pages} pages, "
                "at least one "
                "page per in-flight sequence; lower batch_size or raise kv_cache_bytes"
            )
        return num_pages

    def _build_cache(self) -> None:
        cfg = self.config
        self._arena = arena = KVArena(
            self._specs, page_size=cfg.page_size, num_pages=self._num_pages, device=self.device
        )
        # Arbitration between lanes: every model can always hold one max_model_len sequence (DESIGN.md).
        for name in self._specs:
            arena.set_reserve(name, -(-self.max_model_len // arena.page_size(name)))
        actor_cache = KVCacheManager(arena, ACTOR)
        self._caches = {ACTOR: actor_cache}
        actor_sched = ActorScheduler(
            actor_cache,
            max_num_seqs=cfg.batch_size + self._max_overcommit,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            eos_token_ids=self.eos_token_ids,
            max_deferrals=cfg.max_deferrals if self._delta_control is not None else None,
        )
        backend = cfg.attention_backend
        scorers: list[Scorer] = [] if self.reward_is_model else [RuleScorer(self.reward)]
        for name, scorer_class in _SCORER_CLASSES.items():
            if name in self._models:
                cache = self._caches[name] = KVCacheManager(arena, name)
                scorers.append(scorer_class(ModelRunner(self._models[name], cache, backend=backend)))
        actor_lane = DeviceLane(self.device, ACTOR_PRIORITY)
        actor_lane.attach(actor_cache)
        actor_runner = ModelRunner(self.actor, actor_cache, backend=backend)
        self._captured: CapturedDecode | None = None
        if graph_enabled(cfg.graph, self.device):  # captured decode (model/graph.py)
            max_num_seqs = cfg.batch_size + self._max_overcommit
            actor_runner.captured = self._captured = CapturedDecode(
                actor_runner, max_num_seqs=max_num_seqs, max_model_len=self.max_model_len
            )
        make_lane = self.reward.lane if isinstance(self.reward, RemoteScorers) else ScorerLane
        self._loop = StepLoop(
            actor_sched=actor_sched,
            actor=ActorWorker(actor_runner),
            scorer_lane=make_lane(
                scorers,
                max_num_batched_tokens=cfg.max_num_batched_tokens,
                timeline=self._timeline,
                pages_in_use=lambda: arena.num_pages - arena.num_free_pages(),
                device_lane=DeviceLane(self.device, SCORER_PRIORITY),
            ),
            actor_lane=actor_lane,
            timeline=self._timeline,
            pages_in_use=lambda: arena.num_pages - arena.num_free_pages(),
        )
        if self.device.type == "cuda":  # compile the Triton variants here, not on two lanes at once
            with torch.cuda.device(self.device):  # Triton launches on the current device, not the tensors'
                warm_up_models(self._loop.actor, scorers, self.max_model_len)

    def _check_open(self) -> None:
        self._check_not_closed()
        if self._host is not None:
            raise RuntimeError("RolloutEngine memory is released: call resume() first")

    def _check_not_closed(self, *, group: bool = True) -> None:
        if self._closed:
            raise RuntimeError("RolloutEngine is closed")
        if group and self._group is not None:
            self._group.check()  # after a failed collective, only state_dict() and close() work

    # ------------------------------------------------------------------ prompts

    def add_prompts(
        self,
        prompts,
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
        attention_mask=None,
    ) -> None:
        """Queue prompts: lists of token ids (numpy / torch integer scalars too), a 2-D tensor or array
        (``attention_mask`` strips padding on either side; without it every row is taken whole), a
        tokenizer's ``BatchEncoding`` or dict, one 1-D sequence as one prompt, ``[]`` as none; with
        ``tokenizer=`` given to the engine, also text and chat conversations (``oppo_engine.prompt_input``).
        ``sampling`` is one ``SamplingParams`` for all, or a list of one per prompt.

        A wrong type raises ``TypeError``, a wrong value (empty prompt, id outside the vocabulary, too long)
        ``ValueError``; all prompts are validated before any is queued, so a bad call queues nothing.
        """
        self._check_open()
        self._prompts.add(to_token_lists(prompts, attention_mask, self.tokenizer), sampling)

    def set_prompt_source(self, source: Iterable) -> None:
        """Pull prompts lazily from ``source`` once the queued ones run out; each item is one prompt in any
        form ``add_prompts`` takes for one (token ids, a 1-D tensor, a tokenizer's output for one text, and,
        with ``tokenizer=``, text or a conversation)."""
        self._check_open()
        tokenizer = self.tokenizer
        # NOTE: map, not a generator: a bad item raises at its turn and the source goes on after it.
        where = "a prompt from the prompt source"
        self._prompts.set_source(map(lambda p: one_prompt(p, tokenizer, where), source))

    # ------------------------------------------------------------------ the step

    @collective("step()")
    def step(self) -> StepResult:
        """Generate and score the next ``batch_size`` rollouts; blocks until they are done.

        With overcommit (``inter``, ``oppo``) B + Δ sequences are in flight: the carried-over ones first,
        then new prompts; the first B to finish and be scored are returned (finish order), the rest --
        tokens and KV pages -- continue next step. Once the prompt supply is exhausted it returns what
        remains (fewer than B), then empty results.

        Failures (README, "Exceptions"): an ``Exception`` from a model forward or a reward is retried once
        within the call; one that reproduces is pinned on a group by retrying halves, and that group comes
        back in ``StepResult.failed`` (``finish_reason="error"``), never among the B. Anything else -- a
        ``BaseException``, out of memory, a failure no single group explains -- rolls every sequence back
        to its state at the start of the step (tokens, log-probs, the KV pages allocated during the step),
        puts them first in line and propagates; the step is all-or-nothing, and the retry is exact.

        Under a process group the call is collective. A rank whose step fails as above tells its peers,
        which roll their step back too and raise ``PeerCallFailed``; a failed collective raises
        ``GroupFailed`` (``oppo_engine.dist``) after the same rollback.
        """
        self._check_open()
        self._replicas.check_ready()
        cfg = self.config
        chunk_size = self._next_chunk_size()
        num_carried = len(self._buffer)
        if self._delta_control is not None:
            delta = _whole_groups(self._delta_control.delta(), self.sampling.n)
            seqs = self._buffer.fill(self._prompts.take, cfg.batch_size + delta)
        else:
            delta = 0
            seqs = self._prompts.take(cfg.batch_size)
        snapshots = [s.snapshot() for s in seqs]
        reused = {name: sum(cache.num_tokens(s.seq_id) for s in seqs) for name, cache in self._caches.items()}
        shared_before = {name: cache.shared_tokens for name, cache in self._caches.items()}
        recomputed_before, swapped_before = self._kv_counts()
        if self._captured is not None:
            self._captured.start_step()
        t0 = time.perf_counter()
        self._timeline.clear()
        if self._gpu is not None:
            self._gpu.start()
        try:
            # Hold the models' paged-attention switch for the whole step (one switch, not one per forward).
            with contextlib.ExitStack() as models:
                for model in self._models.values():
                    models.enter_context(paged_attention_enabled(unwrap_model(model)))
                # The chunk controller's "off" arm: this step does not stream (the non-streamed loop).
                streamed = None if chunk_size == OFF else chunk_size
                run = run_quarantined(
                    _groups(seqs),
                    lambda groups: self._attempt(seqs, snapshots, groups, streamed),
                    lambda groups: self._probe(seqs, snapshots, groups, streamed),
                )
            # NOTE: the seam for collectives of a process group: quarantine ran every retry above, so what
            # the ranks would exchange from here on is final.
        except BaseException:
            self._give_back(seqs, snapshots, num_carried)
            raise
        finally:
            gpu = self._gpu.stop() if self._gpu is not None else None
        out = run.result
        failed = [s for q in run.failed for s in q.group]
        for seq in failed:  # out of the step for good: its KV (carried over, the actor's) goes
            for cache in self._caches.values():
                cache.free(seq.seq_id)
        live = [s for s in seqs if all(s is not f for f in failed)]
        counters = (self._finished_tokens, self._finished_seqs, dict(self._swapped_tokens), self._step_index)
        deferred = [s.deferred_steps for s in seqs]
        try:
            return self._commit_step(
                out, run, live, delta, chunk_size, gpu, t0, reused, shared_before,
                recomputed_before, swapped_before,
            )  # fmt: skip
        except BaseException:
            # All or nothing: the step's batch is not lost to a failure after the loop (a NaN reward).
            self._finished_tokens, self._finished_seqs, self._swapped_tokens, self._step_index = counters
            for seq, n in zip(seqs, deferred, strict=True):
                seq.deferred_steps = n
            self._buffer.carried = []
            self._give_back(seqs, snapshots, num_carried)
            raise

    def _attempt(self, seqs, snapshots, groups: list[list[_Seq]], chunk_size: int | None) -> StepOutcome:
        """One run of the step loop over ``groups`` (a subset of the step's ``seqs``); rolled back if it
        fails."""
        live = [s for g in groups for s in g]
        if self._delta_control is not None:
            due = lag_due(self._policy_version, self.config.max_policy_lag)
            cut = BatchCut(live, self.config.batch_size, self.config.max_deferrals, lag_due=due)
        else:
            cut = BatchCut(live, None, None)
        try:
            return self._loop.run(live, self._policy_version, cut, chunk_size=chunk_size)
        except BaseException:
            self._loop.abort(seqs, snapshots)
            raise

    def _probe(self, seqs, snapshots, groups: list[list[_Seq]], chunk_size: int | None) -> None:
        """Run ``groups`` to the end (every sequence finished and scored), then roll back: a quarantine
        probe, to see whether these groups fail alone."""
        live = [s for g in groups for s in g]
        try:
            cut = BatchCut(live, None, None)
            self._loop.run(live, self._policy_version, cut, chunk_size=chunk_size, commit=False)
        finally:
            self._loop.abort(seqs, snapshots)

    def _give_back(self, seqs: list[_Seq], snapshots, num_carried: int) -> None:
        """Nothing is lost: the step's pages go back, and its sequences (with their seeds) go first in line
        as the step found them."""
        self._loop.abort(seqs, snapshots)
        self._buffer.put_back(seqs[:num_carried])
        self._prompts.requeued.extendleft(reversed(seqs[num_carried:]))

    def _commit_step(
        self, out: StepOutcome, run, live: list[_Seq], delta: int, chunk_size: int | None, gpu, t0: float,
        reused: dict, shared_before: dict, recomputed_before: dict, swapped_before: dict,
    ) -> StepResult:  # fmt: skip
        """The work after the step loop: checks first, then carry-over, counters, metrics and the
        controllers (the caller undoes the engine's part if anything raises)."""
        # NOTE: not out.end_s: in oppo the actor's forward in flight at the cut (and the lane's pause) end
        # after the batch's last score, and the caller waits for them too.
        t_end = time.perf_counter()
        captured = self._captured
        batch = out.finished
        feed_delta = self._delta_control is not None and bool(batch) and not self._trainer_reward
        mean_reward = sum(float(s.reward) for s in batch) / len(batch) if batch else 0.0
        if feed_delta and not math.isfinite(mean_reward):
            bad = next(s for s in batch if not math.isfinite(float(s.reward)))
            raise ValueError(
                f"reward: a non-finite reward {bad.reward!r} (prompt {bad.group_id}, sample "
                f"{bad.sample_index}) cannot feed the overcommit controller; the step is rolled back. Fix "
                "the reward, or call report_reward() to feed the controller yourself"
            )
        rollouts = [_rollout(s) for s in batch]
        failed = [_rollout(s, error=describe(q.error)) for q in run.failed for s in q.group]
        if self._delta_control is not None:
            self._buffer.carry(live, batch)
        self._finished_tokens += sum(len(s.response_ids) for s in out.finished_all)
        self._finished_seqs += len(out.finished_all)
        recomputed, swapped = self._kv_counts()
        for name, n in swapped.items():  # preempted scorer KV that came back from host within the step
            if n > swapped_before[name]:
                self._swapped_tokens[name] = self._swapped_tokens.get(name, 0) + n - swapped_before[name]
        metrics = StepMetrics(
            wall_s=t_end - t0,
            generation_s=out.generation_end_s - t0,
            exposed_scoring_s=out.end_s - out.generation_end_s,
            tokens_generated=out.tokens_generated,
            rollouts=len(batch),
            chunk_size=chunk_size,
            overcommit=delta,
            deferred=len(self._buffer),
            pages_used=out.peak_pages,
            lane_busy=self._timeline.busy_fraction(t0, t_end) if t_end > t0 else {},
            gpu_util=gpu.mean_util_pct if gpu is not None else None,
            handoffs=out.handoffs,
            deferral_histogram=dict(sorted(Counter(s.deferred_steps for s in batch).items())),
            stale_tokens=sum(v < self._policy_version for s in batch for v in s.policy_versions),
            length_bias=self._length_bias(batch),
            recomputed_tokens={m: recomputed[m] - recomputed_before[m] for m in recomputed},
            reused_tokens=reused,
            swapped_tokens=self._swapped_tokens,
            shared_tokens={n: c.shared_tokens - shared_before[n] for n, c in self._caches.items()},
            retries=run.retries,
            **(captured.step_metrics() if captured is not None else {}),
        )
        log_step(self._step_index + 1, metrics)
        self._stale_warning.check(metrics.stale_tokens, sum(len(s.response_ids) for s in batch))
        # NOTE: the controllers last: nothing after them can fail but an asynchronous interrupt, and one
        # extra timing sample changes no rollout.
        self._feed_controllers(chunk_size, out, metrics.wall_s, batch)
        self._swapped_tokens = {}
        self._step_index += 1
        return StepResult(rollouts, metrics, failed)

    def _kv_counts(self) -> tuple[dict[str, int], dict[str, int]]:
        """Per model so far: tokens prefilled again below their high-water mark, and tokens whose KV a
        scorer brought back from host after a preemption."""
        recomputed = {ACTOR: self._loop.actor_sched.recomputed_tokens}
        swapped = {}
        for name, sched in self._loop.scorer_lane.scheds.items():
            recomputed[name] = sched.recomputed_tokens
            swapped[name] = sched.swapped_tokens
        return recomputed, swapped

    def _length_bias(self, batch: list[_Seq]) -> float | None:
        """Mean response length of ``batch`` over that of every sequence finished so far."""
        if not batch or not self._finished_tokens:
            return None
        mean_batch = sum(len(s.response_ids) for s in batch) / len(batch)
        return mean_batch / (self._finished_tokens / self._finished_seqs)

    def report_reward(self, reward: float) -> None:
        """Feed the Δ controller the trainer's own reward signal for the last step; from the first call on,
        the returned batches' mean rewards are no longer fed. Ignored without ``overcommit="auto"``."""
        self._check_not_closed()
        self._trainer_reward = True
        if self._delta_control is not None:
            if self._group is not None:  # collective: the group's mean, reduced here
                reward = self._group.mean_reward(reward)
            self._delta_control.observe_reward(reward)

    @property
    def delta_history(self) -> list:
        """``DeltaRecord(step, reward, slope, delta)`` of every reward fed to the Δ controller."""
        return list(self._delta_control.history) if self._delta_control is not None else []

    def _next_chunk_size(self) -> int | str | None:
        """The chunk size (or "off") of the next step; ``None`` outside the streaming modes. Under a process
        group, rank 0's online decision (collective)."""
        if self._chunk_control is None:
            return None
        chunk_size = self._chunk_control.chunk_size()
        if self._group is not None and self._chunk_control.fixed is None:
            chunk_size = self._group.agree_chunk_size(chunk_size)
        return chunk_size

    def _feed_controllers(self, chunk_size: int | str | None, out: StepOutcome, wall_s: float, batch) -> None:
        """Feed the chunk-size controller this step's time per token and the lanes' switch-cost profile, and
        the Δ controller the batch's mean reward (unless the trainer reports its own). Under a process group
        both are fed the group's numbers (collective: the step's last exchange)."""
        profile = None
        if chunk_size is not None:
            finish_times = [s.finish_time for s in out.finished if s.finish_time is not None]
            spans = self._timeline.spans()
            profile = self._profiler.observe(spans, chunk_size, out.tokens_generated, finish_times)
        reward_sum = sum(float(s.reward) for s in batch)
        report = StepReport(out.tokens_generated, wall_s, reward_sum, len(batch), profile)
        if self._group is not None:
            report = self._group.end_step(report)
        if chunk_size is not None:
            self._chunk_control.observe(chunk_size, report.wall_s, report.tokens)
            if report.profile is not None:
                self._chunk_control.set_profile(report.profile)
        if self._delta_control is not None and report.rewards and not self._trainer_reward:
            self._delta_control.observe_reward(report.reward_sum / report.rewards)

    @property
    def chunk_history(self) -> list:
        """``(step, chunk_size, seconds per generated token)`` of every step of a streaming mode
        (``chunk_size="off"`` for a step the controller did not stream); empty in the other modes."""
        return list(self._chunk_control.history) if self._chunk_control is not None else []

    # ------------------------------------------------------------------ between steps

    def update_policy(
        self,
        weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]] | None = None,
        critic_weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]] | None = None,
    ) -> None:
        """Call after ``optimizer.step()``: tokens sampled from now on carry the next policy version.

        Carried-over sequences: with ``retained_kv="recompute"`` their actor KV is dropped and prefilled
        again with the new weights next step (tokens kept); with ``"reuse"`` it is kept. The critic's KV and
        values are always recomputed (it was trained too); the reward's and reference's are kept (frozen).
        Allowed while the memory is released.

        Rollout replicas (README, "Sharded trainer models"): an FSDP2 actor's or critic's replica is
        gathered from the trainer's shards, one parameter at a time (collective: every rank of the model's
        mesh calls this in the same order); while the replicas are released the gather waits for
        ``resume()``. ``weights`` (``critic_weights``) feed the replica of a meta-device (or FSDP2) actor
        (critic): a mapping or an iterable of ``(name, full tensor)`` named as the replica's
        ``named_parameters()`` (tied weights once), cast to ``EngineConfig.rollout_dtype``; every parameter
        exactly once with its shape, else ``ValueError`` naming it, with nothing copied and the version
        not bumped (an iterable is staged on the host first: one copy of the model in host memory). For a
        model shared with the trainer (unsharded), ``weights=`` raises ``ValueError``. With an FSDP2 replica
        to gather, a check failing on one rank fails the call on every rank of its mesh (``ValueError``
        naming that rank), before any gather: no rank is left waiting in one.
        """
        self._check_not_closed()
        self._replicas.update({ACTOR: weights, CRITIC: critic_weights})
        self._policy_version += 1
        for seq in self._buffer.carried:
            finished = seq.status in (SeqStatus.FINISHED, SeqStatus.SCORED)
            if self.config.retained_kv == "recompute" and not finished:
                self._drop_kv(ACTOR, seq)
            for name in _TRAINED_SCORERS:
                if name in self._caches:
                    self._drop_kv(name, seq)
            self._loop.scorer_lane.rescore(seq, _TRAINED_SCORERS)

    def _drop_kv(self, name: str, seq: _Seq) -> None:
        """Drop ``seq``'s KV in model ``name``, in the arena or on host (released)."""
        if self._host is not None:
            self._host.drop(name, seq.seq_id)
        else:
            self._caches[name].free(seq.seq_id)
        if name == ACTOR:
            seq.num_computed = 0

    @property
    def policy_version(self) -> int:
        """Version tagged on tokens sampled now; ``update_policy()`` bumps it."""
        return self._policy_version

    def release_memory(self, weights: bool = False) -> None:
        """Free the KV arena (for training); ``resume()`` rebuilds it. Queued prompts are kept, and the
        retained pages of carried-over sequences (every model's) are copied to host memory. ``weights=True``
        also frees the rollout replicas of sharded / meta-device models (vLLM's sleep level 2; models shared
        with the trainer are the trainer's and stay): ``resume()`` gathers the FSDP2 ones again, and a
        ``weights=``-fed one needs ``update_policy(weights=...)`` before the next ``step()``."""
        if self._group is not None and not self._closed:  # after a failed collective: state_dict, close
            self._group.check()
        if self._closed:
            return
        if weights:
            self._replicas.release()
        if self._host is None:
            reuse, self._swap_buffer = self._swap_buffer, None
            self._host = swap_out(self._arena, self._caches, reuse)
            del reuse
            self._arena.release()
            if self._captured is not None:
                self._captured.arena_released(self._arena.fixed_address)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def resume(self) -> None:
        """Rebuild the KV arena after ``release_memory()`` and bring the retained pages back (new page ids,
        the same bytes); released replicas get their memory back, and the FSDP2 ones are gathered from the
        trainer's shards (collective)."""
        self._check_not_closed()
        self._replicas.restore()
        if self._host is None:
            return
        self._arena.rebuild()
        for name, n in swap_in(self._host, self._arena, self._caches).items():
            self._swapped_tokens[name] = self._swapped_tokens.get(name, 0) + n
        self._swap_buffer = self._host.whole  # the next release writes it again (its copy is ordered first)
        self._host = None

    def _drop_cache(self) -> None:
        self._arena = None
        self._caches = {}
        self._loop = None
        self._host = None
        self._swap_buffer = None

    def cache_stats(self) -> CacheStats:
        """Pages of the arena: total, free, per model, and retained for carried-over sequences (in the
        arena, or on host while the memory is released -- the arena then holds nothing)."""
        self._check_not_closed()
        if self._host is None:
            self._arena.reclaim(wait=True)  # deferred frees whose lane's kernels are done count as free
        carried = {s.seq_id for s in self._buffer.carried}
        # Pages of preempted scorer KV on host count too: they are held for these sequences.
        preempted = sum(sched.swapped_pages(carried) for sched in self._loop.scorer_lane.scheds.values())
        if self._host is not None:
            return CacheStats(
                total_pages=self._arena.num_pages,
                free_pages=self._arena.num_pages,
                pages_per_model=dict.fromkeys(self._caches, 0),
                retained_pages=self._host.num_pages(carried) + preempted,
                page_bytes=self._arena.page_bytes,
                shared_pages=dict.fromkeys(self._caches, 0),
            )
        return CacheStats(
            total_pages=self._arena.num_pages,
            free_pages=self._arena.num_free_pages(),
            pages_per_model={name: cache.num_pages_used for name, cache in self._caches.items()},
            retained_pages=sum(len({p for s in carried for p in c.pages(s)}) for c in self._caches.values())
            + preempted,
            page_bytes=self._arena.page_bytes,
            shared_pages={name: cache.num_shared_pages for name, cache in self._caches.items()},
        )

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict:
        """The prompts in flight and queued -- tokens, log-probs, policy versions, seeds, deferral counts,
        results already read -- and the counters that make a restored engine continue exactly. KV is not
        saved: it is rebuilt (prefilled again) after ``load_state_dict``. A prompt source set with
        ``set_prompt_source`` is not saved: set it again after loading. Works after a failed collective of a
        process group, to restart the job from every rank's state."""
        self._check_not_closed(group=False)
        delta = self._delta_control
        return {
            "version": _STATE_VERSION,
            "policy_version": self._policy_version,
            "prompts": self._prompts.state_dict(),
            "step_index": self._step_index,
            "finished_lengths": (self._finished_tokens, self._finished_seqs),
            "carried": [save_sequence(s) for s in self._buffer.carried],
            "delta": None if delta is None else delta.state_dict(),
            "trainer_reward": self._trainer_reward,
            "rank": list(self._rank()),  # whose prompts these are: (rank, world size) of the saving engine
            # What the carried sequences depend on: another engine continues them only if it matches.
            "settings": {
                "mode": self.config.mode,
                "overcommit": self.config.overcommit,
                "n": self.sampling.n,
                "max_model_len": self.max_model_len,
                "eos_token_ids": list(self.eos_token_ids),
            },
        }

    def load_state_dict(self, state: dict) -> int:
        """Replace the prompts in flight and queued with ``state``'s (the KV of each is prefilled again);
        returns how many sequences had to start over from their prompts.

        Carried-over sequences continue only in an engine that can carry them (overcommit, a
        ``max_model_len`` at least the saved one, the same EOS ids: ``sched.state.why_not_carried``);
        otherwise each is requeued from its prompt (same prompt index and seed, its tokens dropped),
        first in line, with one warning. None is ever dropped. A state whose prompts do not fit this
        engine (longer than its ``max_model_len``, ids outside its vocabulary, another ``n``) raises
        ``ValueError`` and changes nothing, and so does a state saved by another rank or world size of a
        process group (each rank loads its own; a single process is rank 0 of 1). States of version 2 (before
        the settings were saved) load.
        """
        self._check_not_closed()
        if state.get("version") not in _READABLE_STATE_VERSIONS:
            raise ValueError(
                f"state: version {state.get('version')!r}, this engine reads {_READABLE_STATE_VERSIONS}"
            )
        saved_rank = state.get("rank")  # absent from states saved before it was recorded: not checked
        if saved_rank is not None and tuple(saved_rank) != self._rank():
            (r, w), (mine, size) = saved_rank, self._rank()
            raise ValueError(
                f"state: saved by rank {r} of {w}, this engine is rank {mine} of {size}; each rank loads the "
                "state its own rank saved (another's would run that rank's prompts twice and lose its own)"
            )
        saved = [*state["carried"], *state["prompts"]["requeued"]]
        pending = [params for _, params in state["prompts"]["pending"] if params is not None]
        other = {d["sampling"]["n"] for d in saved} | {p["n"] for p in pending}
        other -= {self.sampling.n}
        if other:
            raise ValueError(
                f"state: its prompts are sampled n={sorted(other)} times, this engine's n={self.sampling.n}: "
                "groups cannot change size across a checkpoint"
            )
        for d in saved:
            self._prompts.validate(f"state: the prompt of sequence {d['seq_id']}", d["prompt_ids"])
        for i, (ids, _) in enumerate(state["prompts"]["pending"]):
            self._prompts.validate(f"state: queued prompt {i}", ids)
        carried = state["carried"]
        reason = why_not_carried(
            state.get("settings"), overcommit=self._delta_control is not None,
            max_model_len=self.max_model_len, eos_token_ids=self.eos_token_ids,
        )  # fmt: skip
        restarted = [] if reason is None else [restart_from_prompt(d) for d in carried]
        if restarted:
            warnings.warn(
                f"load_state_dict: {len(restarted)} carried-over sequences start over from their prompts "
                f"(tokens dropped): {reason}",
                stacklevel=2,
            )
        for seq in self._buffer.carried:  # what this engine held goes
            for name in self._caches:
                self._drop_kv(name, seq)
        self._loop.scorer_lane.abort()
        self._policy_version = state["policy_version"]
        self._prompts.load_state_dict(state["prompts"])
        # Older than anything queued: first in line (whole groups, in their order).
        self._prompts.requeued.extendleft(reversed([load_sequence(d) for d in restarted]))
        self._step_index = state["step_index"]
        self._finished_tokens, self._finished_seqs = state["finished_lengths"]
        self._buffer.carried = [] if restarted else [load_sequence(d) for d in carried]
        if self._delta_control is not None and state["delta"] is not None:
            self._delta_control.load_state_dict(state["delta"])
        self._trainer_reward = state["trainer_reward"]
        return len(restarted)

    def _rank(self) -> tuple[int, int]:
        """(rank, world size) of this engine's process group; (0, 1) without one."""
        return (0, 1) if self._group is None else (self._group.rank, self._group.world_size)

    @property
    def timeline(self) -> Timeline:
        """Lane spans of the last step (export with ``timeline.to_chrome_trace(path)``)."""
        return self._timeline

    def close(self) -> None:
        """Free the arena now (its device memory, and the captured graphs' memory, go back before this
        returns, whatever still refers to the engine) and refuse further use. Idempotent."""
        if self._closed:
            return
        self._closed = True
        arena = self._arena
        try:
            if self._captured is not None:
                self._captured.close()
                self._captured = None
            self._drop_cache()
            self._replicas.release()
            if arena is not None and not arena.released:
                arena.release()
        finally:
            if isinstance(self.reward, RemoteScorers):
                self.reward.close()

    def __enter__(self) -> RolloutEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _groups(seqs: list[_Seq]) -> list[list[_Seq]]:
    """``seqs`` as their groups (a prompt's samples), in order of first appearance."""
    groups: dict[int, list[_Seq]] = {}
    for seq in seqs:
        groups.setdefault(seq.group_id, []).append(seq)
    return list(groups.values())


def _rollout(seq: _Seq, error: str | None = None) -> Rollout:
    """``seq`` as a returned rollout; with ``error``, a quarantined one (NaN reward, no scores)."""
    return Rollout(
        prompt_ids=list(seq.prompt_ids),
        response_ids=list(seq.response_ids),
        logprobs=list(seq.logprobs),
        reward=math.nan if error is not None else float(seq.reward),
        policy_versions=list(seq.policy_versions),
        deferred_steps=seq.deferred_steps,
        ref_logprobs=None if error is not None else seq.ref_logprobs,
        values=None if error is not None else seq.values,
        group_id=seq.group_id,
        sample_index=seq.sample_index,
        finish_reason="error" if error is not None else seq.finish_reason or "length",
        error=error,
    )


def _whole_groups(num_sequences: int, group: int) -> int:
    """``num_sequences`` rounded up to whole groups of ``group``."""
    return -(-num_sequences // group) * group
