"""The checks of a schedule that read whole steps: every prompt's samples come back exactly once (or are
quarantined), equal to what the oracle says they must be; a failed step leaves the state it found; nothing
is held between steps but what the carried sequences need; nothing at all at the end.

Multi-turn episodes: a rollout is the oracle's episode (its tokens, observations, action mask and finish
reason); a group one of whose environments fails or hangs comes back whole in ``failed``, and only such
groups do (or the poison prompt's); a failed step may restart an episode whose environment had stepped
from its prompt, and nothing else changes."""

from __future__ import annotations

from collections import Counter

from oppo_engine import RolloutEngine
from oppo_engine.sched.overcommit import deferral_bound
from oppo_engine.sched.prompts import derive_seed, sample_seed
from oppo_engine.sched.sequence import SeqStatus


def _fail(message: str) -> None:
    from .harness import InvariantViolation  # noqa: PLC0415

    raise InvariantViolation(message)


def _restarted(s) -> bool:
    """An episode started over from its prompt by a rollback (a fresh environment, nothing generated)."""
    return s.episode is not None and not s.response_ids and s.status is SeqStatus.WAITING


def _seq_state(s) -> tuple:
    scored = s.status is SeqStatus.SCORED
    return (
        s.seq_id,
        s.prompt_index,
        s.sample_index,
        tuple(s.response_ids),
        tuple(s.logprobs),
        tuple(s.policy_versions),
        s.deferred_steps,
        s.status,
        (s.reward, s.ref_logprobs, s.values) if scored else None,
    )


class Ledger:
    """What the engine has accepted and returned over a schedule."""

    def __init__(self, sim, engine: RolloutEngine) -> None:
        self.sim = sim
        self.engine = engine
        self.prompts: list[list[int]] = []  # by prompt index (= group id): prompts are taken in order
        self.seen: Counter = Counter()
        self.failed: set[tuple[int, int]] = set()
        self.returned = 0
        self.quarantined = 0
        self.version = engine.policy_version  # at the last step that returned

    @property
    def engine(self) -> RolloutEngine:
        return self.sim.engine

    @engine.setter
    def engine(self, value: RolloutEngine) -> None:
        self.sim.engine = value

    def add(self, prompts: list[list[int]]) -> None:
        self.engine.add_prompts(prompts)
        self.prompts.extend(prompts)

    @property
    def total(self) -> int:
        return len(self.prompts) * self.sim.w.n

    def expected(self, group: int, sample: int) -> tuple:
        """``(response, logprobs, action_mask, finish_reason)`` the oracle says the sample must return."""
        w, oracle = self.sim.w, self.sim.oracle
        prompt = self.prompts[group]
        seed = sample_seed(derive_seed(w.seed, group), sample)
        if w.env is None:
            response, logprobs = oracle.rollout(prompt, seed, w.max_new_tokens, w.max_model_len)
            return response, logprobs, [1] * len(response), None
        return oracle.episode(prompt, seed, w.sampling(), w.max_model_len, w.env)

    def env_fails(self, group: int) -> bool:
        """The environment of a sample of ``group`` fails or hangs: the group comes back in ``failed``."""
        return self.sim.w.env is not None and any(
            self.expected(group, j)[3] == "error" for j in range(self.sim.w.n)
        )

    # -- per step ---------------------------------------------------------------------------------------

    def record(self, result) -> bool:
        """Check a step's result; True once every accepted sample is back (or quarantined)."""
        w, oracle = self.sim.w, self.sim.oracle
        remaining = self.total - self.returned - self.quarantined
        failed = list(getattr(result, "failed", []))
        if not failed and len(result.rollouts) != min(w.batch_size, remaining):
            _fail(f"a step returned {len(result.rollouts)} rollouts, B={w.batch_size}, {remaining} remain")
        per_group = Counter(r.group_id for r in result.rollouts)
        if any(c != w.n for c in per_group.values()):
            _fail(f"a step returned part of a group: {dict(per_group)} (n={w.n})")
        over = w.mode in ("inter", "oppo")
        limit = deferral_bound(w.batch_size, w.max_deferrals, self.sim.engine._max_overcommit) if over else 0
        version = self.engine.policy_version
        lag_limit = self._lag_limit(version) if over else None
        for r in result.rollouts:
            key = (r.group_id, r.sample_index)
            self.seen[key] += 1
            if self.seen[key] > 1 or key in self.failed:
                _fail(f"prompt {r.group_id} sample {r.sample_index} returned twice")
            prompt = self.prompts[r.group_id]
            if r.prompt_ids != prompt:
                _fail(f"prompt {r.group_id}: returned with another prompt")
            if self.env_fails(r.group_id):
                _fail(f"prompt {r.group_id}: returned, but an environment of its group fails")
            response, logprobs, mask, reason = self.expected(r.group_id, r.sample_index)
            if r.response_ids != response or r.logprobs != logprobs:
                _fail(f"prompt {r.group_id} sample {r.sample_index}: response differs from the oracle's")
            if r.action_mask != mask or (reason is not None and r.finish_reason != reason):
                _fail(
                    f"prompt {r.group_id} sample {r.sample_index}: action mask or finish reason "
                    f"{r.finish_reason!r} differs from the oracle's ({reason!r})"
                )
            if r.reward != oracle.reward(prompt, response):
                _fail(f"prompt {r.group_id} sample {r.sample_index}: reward differs from the oracle's")
            for name, on in (("ref_logprobs", w.reference), ("values", w.critic)):
                want = oracle.per_token(name, prompt, response) if on else None
                if getattr(r, name) != want:
                    _fail(f"prompt {r.group_id} sample {r.sample_index}: {name} differ from the oracle's")
            if len(r.policy_versions) != len(response) or any(v > version for v in r.policy_versions):
                _fail(f"prompt {r.group_id}: policy versions {r.policy_versions} (now {version})")
            tagged = list(zip(r.policy_versions, mask, strict=True))
            sampled = [v for v, m in tagged if m]
            if sampled != sorted(sampled) or any(v != -1 for v, m in tagged if not m):
                _fail(f"prompt {r.group_id}: versions go back or tag an observation: {r.policy_versions}")
            if r.deferred_steps > limit:
                _fail(f"prompt {r.group_id}: deferred {r.deferred_steps} steps, the bound is {limit}")
            if lag_limit is not None and version - r.policy_versions[0] > lag_limit:
                _fail(
                    f"prompt {r.group_id} sample {r.sample_index}: a token of policy {r.policy_versions[0]} "
                    f"returned at {version}, the lag bound is {lag_limit}"
                )
        for r in failed:
            key = (r.group_id, r.sample_index)
            if key in self.seen or key in self.failed:
                _fail(f"prompt {r.group_id} sample {r.sample_index} quarantined after being returned")
            if r.finish_reason != "error" or not r.error:
                _fail(f"prompt {r.group_id}: quarantined without its reason")
            if w.env is not None and "environment" in r.error and not self.env_fails(r.group_id):
                _fail(f"prompt {r.group_id}: failed by an environment the oracle says answers: {r.error}")
            self.failed.add(key)
        self.returned += len(result.rollouts)
        self.quarantined += len(failed)
        self.version = version
        return self.returned + self.quarantined == self.total

    def _lag_limit(self, version: int) -> int | None:
        """The policy-lag bound of this step's rollouts: ``max_policy_lag`` (L) when at most one
        ``update_policy`` came since the last step (README, "max_policy_lag"); each further update in that
        gap adds one, as a sequence not yet due at that step (a lag below L) is only due at this one."""
        lag = self.sim.w.max_policy_lag
        if lag is None:
            return None
        return lag + max(0, version - self.version - 1)

    def snapshot(self) -> tuple:
        """The state a failed step must give back: carried sequences, the queue, the actor KV."""
        e = self.engine
        carried = [_seq_state(s) for s in e._buffer.carried]
        queue: list = []
        for s in e._prompts.requeued:
            fresh = not s.response_ids and s.deferred_steps == 0 and s.status is SeqStatus.WAITING
            if not fresh:
                queue.append(_seq_state(s))
            elif s.sample_index == 0:
                queue.append(("fresh", tuple(s.prompt_ids)))
        queue += [("fresh", tuple(ids)) for ids, *_ in e._prompts._pending]
        actor = e._loop.actor_sched.cache
        kv = {s.seq_id: actor.num_tokens(s.seq_id) for s in e._buffer.carried}
        return carried, queue, kv

    def check_restored(self, before: tuple) -> None:
        """After a failed step: every sequence and the queue as the step found them, no actor KV beyond
        what they held, no scorer state, no page leaked."""
        from .harness import check_pages  # noqa: PLC0415

        carried, queue, kv = self.snapshot()
        # An episode whose environment had stepped in the step starts over from its prompt.
        restarted = {s.seq_id for s in self.engine._buffer.carried if _restarted(s)}
        if [c for c in carried if c[0] not in restarted] != [c for c in before[0] if c[0] not in restarted]:
            _fail("a failed step changed the carried sequences")
        if queue != before[1]:
            _fail("a failed step changed the prompt queue")
        for seq_id, n in kv.items():
            if n > before[2].get(seq_id, 0):
                _fail(
                    f"a failed step left seq {seq_id} with {n} tokens of actor KV (had {before[2][seq_id]})"
                )
        for name, sched in self.engine._loop.scorer_lane.scheds.items():
            if sched.cache.seq_ids:
                _fail(f"a failed step left {name} pages for {sched.cache.seq_ids}")
        self.check_between_steps()
        check_pages(self.engine)

    def check_between_steps(self) -> None:
        """Pages are held only for carried sequences."""
        e = self.engine
        carried = {s.seq_id for s in e._buffer.carried}
        for name, cache in e._caches.items():
            stray = set(cache.seq_ids) - carried
            if stray:
                _fail(f"{name} holds pages of sequences not carried over: {sorted(stray)}")

    def check_end(self) -> None:
        """Every sample returned once or quarantined; once the last deferred free is done, every page free."""
        e = self.engine
        poison = self.sim.faults.poison_prompt
        for g in range(len(self.prompts)):
            for j in range(self.sim.w.n):
                if self.seen[(g, j)] != 1 and (g, j) not in self.failed:
                    _fail(f"prompt {g} sample {j} never came back")
                if self.env_fails(g) and (g, j) not in self.failed:
                    _fail(f"prompt {g} sample {j}: its group's environment fails, yet it is not in failed")
                if g == poison and (g, j) not in self.failed:
                    _fail(f"poison prompt {g} sample {j} was not quarantined")
        if e._buffer.carried:
            _fail(f"{len(e._buffer.carried)} sequences still carried at the end")
        self.sim.clock.advance(1e9)
        for name in e._caches:
            e._arena.available_pages(name)  # reclaims completed deferred frees
        stats = e.cache_stats()
        if stats.free_pages != stats.total_pages:
            _fail(f"{stats.total_pages - stats.free_pages} pages leaked at the end")
