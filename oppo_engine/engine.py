"""RolloutEngine: the facade a PPO loop holds (public API: see DESIGN.md).

The engine is glue: it validates and wires the parts, and its public methods say what a user can count on.
Where the work is done: page planning and the arena in ``cache/plan.py``, the step loop's wiring in
``sched/build.py``, the loop in ``sched/step.py``, the commit of a step and its metrics in
``sched/commit.py``, checkpoints in ``checkpoint.py``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from functools import partial
from weakref import finalize

import torch

from oppo_engine import checkpoint
from oppo_engine.cache import KVSpec
from oppo_engine.cache.plan import build_cache
from oppo_engine.cache.stats import CacheStats, cache_stats
from oppo_engine.cache.swap import HostPages, release_arena, restore_arena
from oppo_engine.config import EngineConfig, SamplingParams
from oppo_engine.distributed.group import collective, join_group
from oppo_engine.distributed.remote import RemoteScorers
from oppo_engine.guard import CallGuard, exclusive
from oppo_engine.model.replica import RolloutReplicas
from oppo_engine.model.roles import ACTOR, CRITIC, device_of, dtype_of, resolve_roles
from oppo_engine.model.scorer import RuleReward
from oppo_engine.obs import GpuUtilSampler, Timeline, log_step
from oppo_engine.obs.staleness import StaleBatchWarning
from oppo_engine.prompt_input import one_prompt, to_token_lists
from oppo_engine.sched.build import build_step_loop
from oppo_engine.sched.commit import StepCounters, StepStart, commit_step, run_step, whole_groups
from oppo_engine.sched.lanes import ScorerLane
from oppo_engine.sched.online import chunk_controller, feed_controllers, next_chunk_size
from oppo_engine.sched.overcommit import OvercommitBuffer, batch_cut, delta_controller, refresh_carried
from oppo_engine.sched.prompts import PromptQueue
from oppo_engine.sched.results import Rollout, StepResult
from oppo_engine.serve import ServeHandle
from oppo_engine.sim.prior import engine_prior

__all__ = ["CacheStats", "Rollout", "RolloutEngine", "StepResult"]


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
    data-parallel group (``oppo_engine.distributed.group``): one engine per rank over that rank's prompts,
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
    ``update_policy(weights=...)`` (``critic_weights=``) before the first ``step()`` (docs/scale-out.md,
    "Sharded trainer models"). ``self.actor`` is the model the engine runs (the replica, where there is one).

    ``env`` (a factory: a class, or a function returning an ``Env``) makes every sequence a multi-turn
    episode in its own environment instance (docs/multi-turn.md); ``add_prompts(envs=...)`` gives prompts
    their own. Multi-turn ``SamplingParams`` (``turn_stop_token_ids``, ...) without any are refused here.
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
        env=None,
    ) -> None:
        self._guard = CallGuard()  # step(), update_policy(), ... one at a time (guard.py)
        self.config = config or EngineConfig()
        self.sampling = sampling or SamplingParams()
        cfg = self.config
        group = self.sampling.n  # every prompt yields n rollouts, cut and carried whole
        # Overcommit (inter, oppo): Δ is fixed, or chosen online from the reward trend.
        self._delta_control, self._max_overcommit = delta_controller(cfg, group)
        # A sharded (FSDP2) or meta-device actor/critic runs as a full rollout replica (model/replica.py).
        self._replicas = RolloutReplicas(
            {ACTOR: actor, CRITIC: critic}, (reward, reference), cfg.rollout_dtype
        )
        actor, critic = self._replicas.runs(ACTOR, actor), self._replicas.runs(CRITIC, critic)
        # Data parallel: one collective checks that the ranks share the settings (distributed/group.py).
        # (after the replicas: a meta-device actor runs on its replica's device)
        self._group = join_group(process_group, cfg, self.sampling, device_of(actor))
        self.actor = actor
        self.tokenizer = tokenizer
        self.env = env  # the environment factory of every sequence (None: single-turn, or per prompt)
        # The models the engine runs through its paged cache, by role (the name of their cache and lane).
        remote = reward if isinstance(reward, RemoteScorers) else None  # scored on another rank
        roles = resolve_roles(
            actor, reward, reference, critic, max_model_len=cfg.max_model_len, eos_token_id=eos_token_id,
            tokenizer=tokenizer, reward_tokenizer=reward_tokenizer, remote=remote is not None,
        )  # fmt: skip
        self._models, self.vocab_size = roles.models, roles.vocab_size
        self.max_model_len = roles.max_model_len  # prompt + response tokens of a sequence, at most
        self.eos_token_ids, self.device = roles.eos_token_ids, device_of(actor)
        self._eos_explicit, self._server = eos_token_id is not None, None  # serve(): the endpoint, when up
        self.reward, self.reward_is_model = (reward, True) if roles.rule is None else (roles.rule, False)
        if remote is not None:  # the handshake: refuses another vocabulary, a longer max_model_len
            remote.connect(vocab_size=self.vocab_size, max_model_len=self.max_model_len,
                           local_reference=reference is not None)  # fmt: skip

        self._specs = {name: KVSpec.from_hf_config(m.config, dtype_of(m)) for name, m in self._models.items()}
        self._plan, self._arena = build_cache(
            self._specs, cfg, max_model_len=self.max_model_len, device=self.device,
            in_flight=cfg.batch_size + self._max_overcommit, replica_bytes=self._replicas.nbytes,
            ranks_sharing_memory=1 if self._group is None else self._group.ranks_sharing_memory,
        )  # fmt: skip
        self._page_bytes = self._plan.page_bytes
        self._timeline = Timeline()
        # Streaming modes: the chunk size is fixed, or chosen online from the switch-cost profile.
        prior = partial(engine_prior, cfg, self._models, max_new_tokens=self.sampling.max_new_tokens)
        self._chunk_control, self._profiler = chunk_controller(cfg, self._models, prior=prior)
        self._gpu = GpuUtilSampler.for_device(self.device) if self.device.type == "cuda" else None
        self._prompts = PromptQueue(
            self.sampling, max_model_len=self.max_model_len, vocab_size=self.vocab_size,
            rank=None if self._group is None else self._group.rank, env=env,
        )  # fmt: skip
        self._buffer, self._policy_version, self._counters = OvercommitBuffer(), 0, StepCounters()
        self._closed = False
        self._host: HostPages | None = None  # retained pages while the arena is released
        self._swap_buffer: list[torch.Tensor] = []  # the last release's host buffer, reused by the next
        self._trainer_reward = False  # report_reward() was called: it feeds the Δ controller from now on
        self._stale_warning = StaleBatchWarning()
        built = build_step_loop(
            self._arena, self._models, config=cfg,
            rule_reward=None if self.reward_is_model else self.reward,
            max_in_flight=cfg.batch_size + self._max_overcommit, max_model_len=self.max_model_len,
            vocab_size=self.vocab_size, eos_token_ids=self.eos_token_ids,
            overcommit=self._delta_control is not None, device=self.device, timeline=self._timeline,
            make_lane=self.reward.lane if isinstance(self.reward, RemoteScorers) else ScorerLane,
        )  # fmt: skip
        self._loop, self._caches, self._captured = built.loop, built.caches, built.captured
        # The step loop admits from the queue mid-step; an engine dropped unclosed lets its env workers go.
        self._loop.admission, self._finalizer = self._prompts, finalize(self, self._loop.close)

    def _check_open(self) -> None:
        self._check_not_closed()
        if self._host is not None:
            raise RuntimeError("RolloutEngine memory is released: call resume() first")

    def _check_not_closed(self, *, group: bool = True) -> None:
        if self._closed:
            raise RuntimeError("RolloutEngine is closed")
        if group and self._group is not None:
            self._group.check()  # after a failed collective, only state_dict() and close() work

    def add_prompts(
        self,
        prompts,
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
        attention_mask=None,
        envs: Sequence | None = None,
    ) -> None:
        """Queue prompts: lists of token ids (numpy / torch integer scalars too), a 2-D tensor or array
        (``attention_mask`` strips padding on either side; without it every row is taken whole), a
        tokenizer's ``BatchEncoding`` or dict, one 1-D sequence as one prompt, ``[]`` as none; with
        ``tokenizer=`` given to the engine, also text and chat conversations (``oppo_engine.prompt_input``).
        ``sampling`` is one ``SamplingParams`` for all, or a list of one per prompt; ``envs`` one environment
        factory per prompt (``None`` entries: the engine's ``env``), each sample with its own instance.

        A wrong type raises ``TypeError``, a wrong value (empty prompt, id outside the vocabulary, too long)
        ``ValueError``; all prompts are validated before any is queued, so a bad call queues nothing.
        """
        self._check_open()
        self._prompts.add(to_token_lists(prompts, attention_mask, self.tokenizer), sampling, envs)

    def set_prompt_source(self, source: Iterable) -> None:
        """Pull prompts lazily from ``source`` once the queued ones run out; each item is one prompt in any
        form ``add_prompts`` takes for one (token ids, a 1-D tensor, a tokenizer's output for one text, and,
        with ``tokenizer=``, text or a conversation)."""
        self._check_open()
        tokenizer = self.tokenizer
        # NOTE: map, not a generator: a bad item raises at its turn and the source goes on after it.
        where = "a prompt from the prompt source"
        self._prompts.set_source(map(lambda p: one_prompt(p, tokenizer, where), source))

    @exclusive
    @collective("step()")
    def step(self) -> StepResult:
        """Generate and score the next ``batch_size`` rollouts; blocks until they are done.

        With overcommit (``inter``, ``oppo``) B + Δ sequences are in flight: the carried-over ones first,
        then new prompts; the first B to finish and be scored are returned (finish order), the rest --
        tokens and KV pages -- continue next step. Once the prompt supply is exhausted it returns what
        remains (fewer than B), then empty results.

        Failures (docs/reliability.md): an ``Exception`` from a model forward or a reward is retried once
        within the call; one that reproduces is pinned on a group by retrying halves, and that group comes
        back in ``StepResult.failed`` (``finish_reason="error"``), never among the B. Anything else -- a
        ``BaseException``, out of memory, a failure no single group explains -- rolls every sequence back
        to its state at the start of the step (tokens, log-probs, the KV pages allocated during the step),
        puts them first in line and propagates; the step is all-or-nothing, and the retry is exact.

        Multi-turn episodes (docs/multi-turn.md): an environment that raises or times out ends its
        sequence's group in ``StepResult.failed``, never raised from here; a rollback restarts a sequence
        whose environment was sent a turn in the step from its prompt, with a fresh environment. While
        episodes wait on their environments the call waits for them: it never returns empty then.

        Under a process group the call is collective. A rank whose step fails as above tells its peers,
        which roll their step back too and raise ``PeerCallFailed``; a failed collective raises
        ``GroupFailed`` (``oppo_engine.distributed``) after the same rollback.
        """
        self._check_open()
        self._replicas.check_ready()
        cfg = self.config
        chunk_size = next_chunk_size(self._chunk_control, self._group)
        delta = whole_groups(self._delta_control.delta(), self.sampling.n) if self._delta_control else 0
        num_carried = len(self._buffer)  # B + Δ in flight: the carried sequences first, then new prompts
        seqs = self._buffer.fill(partial(self._prompts.take, holding=num_carried), cfg.batch_size + delta)
        start = StepStart.take(seqs, num_carried, delta, chunk_size, caches=self._caches, loop=self._loop,
                               counters=self._counters)  # fmt: skip
        cut = batch_cut(cfg, self._policy_version, delta if self._delta_control is not None else None)
        try:
            run, gpu = run_step(start, self._loop, cut, self._policy_version, models=self._models.values(),
                                gpu=self._gpu, captured=self._captured)  # fmt: skip
            # NOTE: the seam for collectives of a process group: quarantine ran every retry above, so what
            # the ranks would exchange from here on is final.
        except BaseException:
            start.roll_back(self._loop, self._buffer, self._prompts)
            raise
        out = run.result
        try:
            overcommit = self._delta_control is not None
            result = commit_step(
                start, out, run, gpu=gpu, loop=self._loop, caches=self._caches, counters=self._counters,
                buffer=self._buffer if overcommit else None,
                check_rewards=overcommit and not self._trainer_reward, policy_version=self._policy_version,
                graph_metrics=self._captured.step_metrics() if self._captured is not None else {},
            )  # fmt: skip
            log_step(self._counters.step_index + 1, result.metrics)
            self._stale_warning.check(result.metrics.stale_tokens, out.finished)
            # NOTE: the controllers last: nothing after them can fail but an asynchronous interrupt, and one
            # extra timing sample changes no rollout.
            feed_controllers(
                chunk_size, out, result.metrics.wall_s, out.finished, chunk_control=self._chunk_control,
                profiler=self._profiler, delta_control=self._delta_control, timeline=self._timeline,
                trainer_reward=self._trainer_reward, group=self._group,
            )  # fmt: skip
        except BaseException:
            # All or nothing: the step's batch is not lost to a failure after the loop (a NaN reward).
            self._counters = start.counters
            start.roll_back(self._loop, self._buffer, self._prompts, committed=True)
            raise
        self._counters.advance()
        return result

    def serve(self, host: str = "127.0.0.1", port: int = 0, api_key: str | None = None, **options):
        """Serve this engine's episodes on an OpenAI-compatible endpoint, from a daemon thread: returns its
        ``oppo_engine.serve.ServeHandle`` (which lists ``options`` and what is refused; docs/serve.md)."""
        self._server = ServeHandle(self, host=host, port=port, api_key=api_key, **options)
        return self._server

    def add_agents(self, agent_fn, tasks: Iterable, n: int = 1, in_process: bool = True) -> None:
        """Run ``async def agent_fn(task, client) -> float | None`` n times a task (a group) in episodes,
        B + Δ at once (``ServeHandle.add_agents``: ``serve()`` first); returns at once."""
        ServeHandle.of(self).add_agents(agent_fn, tasks, n=n, in_process=in_process)

    def report_reward(self, reward: float) -> None:
        """Feed the Δ controller the trainer's own reward signal for the last step; from the first call on,
        the returned batches' mean rewards are no longer fed. Ignored without ``overcommit="auto"``."""
        self._check_not_closed()
        self._trainer_reward = True
        if self._delta_control is not None:  # under a group, collective: the group's mean is fed
            group = self._group
            self._delta_control.observe_reward(reward if group is None else group.mean_reward(reward))

    @property
    def delta_history(self) -> list:
        """``DeltaRecord(step, reward, slope, delta)`` of every reward fed to the Δ controller."""
        return list(self._delta_control.history) if self._delta_control is not None else []

    @property
    def chunk_history(self) -> list:
        """``(step, chunk_size, seconds per generated token)`` of every step of a streaming mode
        (``chunk_size="off"`` for a step the controller did not stream); empty in the other modes."""
        return list(self._chunk_control.history) if self._chunk_control is not None else []

    @exclusive
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

        Rollout replicas (docs/scale-out.md): an FSDP2 actor's or critic's replica is
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
        refresh_carried(
            self._buffer.carried, self.config.retained_kv, caches=self._caches, host=self._host,
            lane=self._loop.scorer_lane,
        )  # fmt: skip

    @property
    def policy_version(self) -> int:
        """Version tagged on tokens sampled now; ``update_policy()`` bumps it."""
        return self._policy_version

    @exclusive
    def release_memory(self, weights: bool = False) -> None:
        """Free the KV arena (for training); ``resume()`` rebuilds it. Queued prompts are kept, and the
        retained pages of carried-over sequences (every model's) are copied to host memory. ``weights=True``
        also frees the rollout replicas of sharded / meta-device models (vLLM's sleep level 2; models shared
        with the trainer are the trainer's and stay): ``resume()`` gathers the FSDP2 ones again, and a
        ``weights=``-fed one needs ``update_policy(weights=...)`` before the next ``step()``."""
        if self._closed:
            return
        self._check_not_closed()  # after a failed collective, only state_dict() and close() work
        if weights:
            self._replicas.release()
        if self._host is None:  # takes the swap buffer out
            self._host = release_arena(self._arena, self._caches, self._swap_buffer, self._captured)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    @exclusive
    def resume(self) -> None:
        """Rebuild the KV arena after ``release_memory()`` and bring the retained pages back (new page ids,
        the same bytes); released replicas get their memory back, and the FSDP2 ones are gathered from the
        trainer's shards (collective)."""
        self._check_not_closed()
        self._replicas.restore()
        if self._host is not None:
            host = self._host
            self._swap_buffer = restore_arena(host, self._arena, self._caches, self._counters.swapped_tokens)
            self._host = None

    def cache_stats(self) -> CacheStats:
        """Pages of the arena: total, free, per model, and retained for carried-over sequences (in the
        arena, or on host while the memory is released -- the arena then holds nothing)."""
        self._check_not_closed()
        carried = {s.seq_id for s in self._buffer.carried}
        # Pages of preempted scorer KV on host count too: they are held for these sequences.
        preempted = sum(sched.swapped_pages(carried) for sched in self._loop.scorer_lane.scheds.values())
        return cache_stats(self._arena, self._caches, self._host, carried, preempted)

    def state_dict(self) -> dict:
        """The prompts in flight and queued -- tokens, log-probs, policy versions, seeds, deferral counts,
        results already read -- and the counters that make a restored engine continue exactly. KV is not
        saved: it is rebuilt (prefilled again) after ``load_state_dict``. A prompt source set with
        ``set_prompt_source`` is not saved: set it again after loading. Works after a failed collective of a
        process group, to restart the job from every rank's state. An environment cannot be saved: an
        unfinished episode whose environment was sent a turn (its call in flight, or answered) is saved
        requeued from its prompt, to run with a fresh environment (here they go on); agents: ValueError."""
        self._check_not_closed(group=False)
        return checkpoint.save_state(self)

    @exclusive
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
        return checkpoint.load_state(self, state)

    @property
    def timeline(self) -> Timeline:
        """Lane spans of the last step (export with ``timeline.to_chrome_trace(path)``)."""
        return self._timeline

    @exclusive
    def close(self) -> None:
        """Free the arena now (its device memory, and the captured graphs' memory, go back before this
        returns, whatever still refers to the engine), cancel the environment calls pending and refuse
        further use. Idempotent."""
        if self._closed:
            return
        self._closed = True
        arena = self._arena
        try:
            if self._server is not None:
                self._server.close()
            self._loop.close()
            if self._captured is not None:
                self._captured.close()
                self._captured = None
            self._arena, self._caches, self._loop, self._host, self._swap_buffer = None, {}, None, None, []
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
