"""The deterministic simulator over the real scheduling core (tests/sim/harness.py has the invariants and the
progress bound). CI runs a fixed set of seeds; ``make sim SEEDS=100000`` runs the long search."""

from __future__ import annotations

import random

import pytest

pytest.importorskip("greenlet")  # the dev extra; absent on the device machine, whose check skips this

from oppo_engine.sched.scheduler import ActorScheduler, ScheduledChunk  # noqa: E402
from oppo_engine.sched.scorer import ScorerScheduler  # noqa: E402
from oppo_engine.sched.sequence import SeqStatus  # noqa: E402
from oppo_engine.sim.standin import KVCorruption  # noqa: E402

from .harness import InvariantViolation, Livelock, Sim, SimFailure, Workload, run_schedule  # noqa: E402
from .search import search  # noqa: E402

CI_SEEDS = range(2000)
# Seeds whose schedules found engine bugs (README, "Deterministic simulation"): each passes since its fix.
FOUND_BUGS = {
    2: "a non-streamed step failed while its freed pages were still pending (deferred frees)",
    107: "admission took the pages an older sequence needed for its next chunk: livelock",
    135: "the same admission livelock, n=3",
    208: "the same admission livelock, n=2",
    227: "the same admission livelock, oppo",
    6767: "a rollback kept slots of the failed forward that the step had recomputed from 0: wrong KV",
}


def test_every_invariant_holds_over_the_ci_seed_set():
    result = search(CI_SEEDS)
    print(result.summary())
    assert not result.failures, "\n\n".join(str(f) for f in result.failures[:3])
    reports = result.reports
    # The set exercises what it claims to: faults rolled back, every mode, groups, deferrals.
    assert sum(r.failed_steps for r in reports) > 100
    assert {Workload.draw(r.seed).mode for r in reports} == {"sequential", "intra", "inter", "oppo"}
    assert sum(r.rollouts for r in reports) > 10_000
    assert {Workload.draw(r.seed).max_policy_lag for r in reports} == {None, 1, 2, 3}
    assert sum(r.quarantined for r in reports) > 100
    # Multi-turn episodes with a seeded environment: calls answered, failed, hung past the timeout, in
    # every mode.
    episodes = [r for r in reports if Workload.draw(r.seed).env is not None]
    assert {Workload.draw(r.seed).mode for r in episodes} == {"sequential", "intra", "inter", "oppo"}
    assert sum(r.env_calls for r in episodes) > 3000
    assert sum(r.env_failed for r in episodes) > 100 and sum(r.env_timeouts for r in episodes) > 20
    assert sum(r.failed_steps for r in episodes) > 20  # rollbacks that restart stepped episodes


@pytest.mark.parametrize("seed", sorted(FOUND_BUGS))
def test_the_seeds_that_found_bugs_pass(seed):
    run_schedule(seed)
    # As they were found: before max_policy_lag, whose draw changes their schedules.
    run_schedule(seed, max_policy_lag=None)


def test_a_schedule_replays_unit_for_unit_from_its_seed():
    def trace(seed):
        sim = Sim(Workload.draw(seed))
        sim.ex.trace = type(sim.ex.trace)(maxlen=None)
        from .harness import _run  # noqa: PLC0415

        try:
            _run(sim)
        finally:
            sim.ex.closed = True
            sim.engine.close()
        return list(sim.ex.trace), sim.clock.now

    for seed in (3, 227):
        first, second = trace(seed), trace(seed)
        assert len(first[0]) > 50
        assert first == second


def _old_schedule(self: ActorScheduler) -> list[ScheduledChunk]:
    """``ActorScheduler._schedule`` before 703a411 and 8b0e847: a waiting sequence is admitted when the pool
    holds the pages of its first chunk (one that may stop at its group's prefix), and forks its group's
    prefix before that check."""
    budget = self.max_num_batched_tokens
    chunks: list[ScheduledChunk] = []
    prefixing: set[int] = set()
    i = 0
    while i < len(self.running) and budget > 0:
        seq = self.running[i]
        n = self._chunk_len(seq, budget, prefixing)
        slots = self.cache.append_slots(seq.seq_id, n)
        while slots is None and (victim := self._victim(after=i)) is not None:
            self.preempt(victim)
            slots = self.cache.append_slots(seq.seq_id, n)
        if slots is None:
            self.preempt(seq)
            break
        chunks.append(self._chunk(seq, n, slots))
        budget -= n
        i += 1
    j = 0
    while j < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
        seq = self.waiting[j]
        if seq.num_computed < seq.prefix_len and seq.seq_id not in self.cache:
            source = self._prefix_source(seq, prefixing)
            if source is not None:
                self._fork(source, seq)
            elif self._prefix_in_progress(seq, prefixing):
                j += 1
                continue
        n = self._chunk_len(seq, budget, prefixing)
        reserve = self.watermark_pages if self.running else 0
        if self.cache.pages_needed(seq.seq_id, n) + reserve > self.cache.num_available_pages():
            prefixing.discard(seq.seq_id)
            break
        slots = self.cache.append_slots(seq.seq_id, n)
        if slots is None:
            prefixing.discard(seq.seq_id)
            break
        del self.waiting[j]
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)
        chunks.append(self._chunk(seq, n, slots))
        budget -= n
    return chunks


def test_the_simulator_finds_the_admission_livelock_fixed_in_703a411(monkeypatch):
    """With the old admission rule put back, a search of the CI seeds reports a livelock (its seed and the
    trace of its last units); the same seed passes on today's code."""
    monkeypatch.setattr(ActorScheduler, "_schedule", _old_schedule)
    # Frees that return at once (as on the CPU): the livelock the groups soak found needs no late event.
    seeds = [s for s in CI_SEEDS if Workload.draw(s).event_latency == 0]
    result = search(seeds, stop_at_first=True)
    assert result.failures, "the old admission rule went unnoticed"
    found = result.failures[0]
    assert isinstance(found.error, Livelock), found
    assert f"seed {found.seed}:" in str(found) and "actor: forward" in str(found)
    assert len(found.trace) > 10
    monkeypatch.undo()
    run_schedule(found.seed)


def test_the_simulator_reports_a_page_leak(monkeypatch):
    """A scorer that keeps a sequence's pages after reading its result breaks the page invariant."""
    real = ScorerScheduler.complete

    def leaky(self, seq):
        pages = self.cache.pages(seq.seq_id)
        result = real(self, seq)
        if pages and seq.seq_id % 5 == 0:
            self.cache.arena.alloc(self.cache.name, 1)  # a page nobody holds
        return result

    monkeypatch.setattr(ScorerScheduler, "complete", leaky)
    result = search(range(200), stop_at_first=True)
    assert result.failures and isinstance(result.failures[0].error, InvariantViolation)


def test_the_simulator_reports_kv_that_did_not_move_with_its_pages(monkeypatch):
    """Page copies that copy nothing (copy on write of a group's shared page, swap to host and back) leave
    sequences reading pages that do not hold their tokens: the stand-in's fingerprints catch it."""
    from oppo_engine import ops  # noqa: PLC0415

    monkeypatch.setattr(ops, "copy_pages", lambda src, dst, src_ids, dst_ids: None)
    result = search(range(400), stop_at_first=True)
    assert result.failures and isinstance(result.failures[0].error, KVCorruption), result.failures[:1]


def test_a_failure_names_its_seed_and_replays():
    with pytest.raises(SimFailure) as info:
        raise SimFailure(7, Workload.draw(7), RuntimeError("x"), [(1, 0.0, "actor", "forward")])
    assert "seed 7:" in str(info.value) and "python -m tests.sim --seed 7" in str(info.value)


def test_the_simulator_reports_a_token_past_the_policy_lag_bound(monkeypatch):
    """Without the lag-due rule (a carried sequence whose oldest token is max_policy_lag versions old must
    be in the next batch) a search returns tokens staler than the bound."""
    from oppo_engine.sched import overcommit  # noqa: PLC0415

    monkeypatch.setattr(overcommit, "lag_due", lambda version, lag: None)
    seeds = [s for s in CI_SEEDS if Workload.draw(s).max_policy_lag is not None]
    result = search(seeds, stop_at_first=True)
    assert result.failures, "a lag past the bound went unnoticed"
    assert isinstance(result.failures[0].error, InvariantViolation), result.failures[0]
    assert "the lag bound is" in str(result.failures[0].error)


def _shared_prefix_workload(seed: int) -> dict:
    """Changes to the workload of ``seed`` whose prompts begin alike: each prompt starts with one of up to
    three stems (or none; some prompts repeat), cut to fit ``max_model_len``, and a minimum shared length
    from one token up (``EngineConfig.shared_prefix_min_tokens``)."""
    w = Workload.draw(seed)
    r = random.Random(seed * 7919 + 1)
    room = w.max_model_len - 1
    stems = [[r.randrange(4, 64) for _ in range(r.randint(1, room))] for _ in range(r.randint(1, 3))]
    prompts = []
    for p in w.prompts:
        if prompts and r.random() < 0.15:
            prompts.append(list(r.choice(prompts)))
        elif r.random() < 0.8:
            prompts.append((r.choice(stems) + p)[:room])
        else:
            prompts.append(p)
    return dict(prompts=prompts, shared_prefix_min_tokens=r.choice((None, 1, 2, 3, 5, 8)))


def test_shared_prompt_prefixes_hold_every_invariant():
    """Prompts sharing prefixes across prompts (``share_prompt_prefix``, on by default): every invariant --
    each prompt exactly once, its tokens and results the oracle's, every page's fingerprints those of the
    tokens its holders wrote (forks, copy on write, swaps), no page leaked -- over faults, rollbacks,
    preemption, policy updates, releases and reloads, in every mode."""
    reports = []
    for seed in range(600):
        try:
            reports.append(run_schedule(seed, **_shared_prefix_workload(seed)))
        except SimFailure as f:
            raise AssertionError(f"{f}\nchanges: {_shared_prefix_workload(seed)}") from None
    shared = [r for r in reports if r.shared_tokens]
    assert sum(r.shared_tokens for r in reports) > 5000
    assert {Workload.draw(r.seed).mode for r in shared} == {"sequential", "intra", "inter", "oppo"}
    assert sum(r.failed_steps for r in shared) > 20
