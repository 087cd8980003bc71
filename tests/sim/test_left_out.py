"""The step's sequences a quarantine run leaves out keep their actor KV, and the run may need those pages.

The soak's stall (tests/test_soak.py, n=2, on CI): a group carried over with its actor KV fails in a scorer,
the retry fails too, isolation pins it, and the step runs again without it. The rollbacks gave the group
back the KV the step found it with, but no run schedules it any more: its pages were held by no lane that
could free them, the actor was left short of its reserve (one ``max_model_len`` sequence), and a sequence
growing to that length waited for them until the 10 s stall check failed the step. The same happens in an
isolation probe, whose left-out groups keep their KV: there the stall passes for "does not fail alone" and
can pin the failure on no group. Since the fix the run's actor scheduler gives those pages up when starved
(``ActorScheduler.leave_out``).

Deterministic: the simulator's executor orders the lanes from a seed and its clock is virtual, so a stall
costs no wall time; the arena holds exactly one ``max_model_len`` sequence per model (no spare page).
"""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("greenlet")  # the dev extra; absent on the device machine, whose check skips this

from oppo_engine import SamplingParams  # noqa: E402
from oppo_engine.sched.prompts import derive_seed, sample_seed  # noqa: E402
from oppo_engine.sched.step import _STALL_S  # noqa: E402

from .harness import Sim, Workload, check_pages  # noqa: E402

L = 32  # max_model_len: 4 actor pages of 8 tokens, the actor's whole reserve


def _sim(policy: str, seed: int, groups: int) -> Sim:
    w = dataclasses.replace(
        Workload.draw(seed), mode="oppo", n=2, batch_size=2, overcommit=2 * (groups - 1), max_deferrals=4,
        retained_kv="recompute", chunk_size=4, page_size=8, max_model_len=L, max_new_tokens=L, budget=4096,
        reward="model", reference=False, critic=False, extra_pages=0, prompts=[], policy=policy,
        event_latency=0.0, p_long=1.0, fail_forward_at=None, interrupt_at=None, poison=False,
        max_policy_lag=None, env=None,
    )  # fmt: skip
    return Sim(w)


def _expected(sim: Sim, prompt: list[int], group: int, sample: int) -> list[int]:
    seed = sample_seed(derive_seed(sim.w.seed, group), sample)
    return sim.oracle.rollout(prompt, seed, L, L)[0]


@pytest.mark.parametrize(("policy", "seed"), [("random", 0), ("sticky", 0), ("actor_starved", 1)])
@pytest.mark.parametrize("groups", [2, 3])
def test_a_run_gives_up_the_actor_kv_of_the_groups_it_leaves_out(policy, seed, groups):
    sim = _sim(policy, seed, groups)
    engine = sim.build()
    try:
        # Group 0 finishes at once (the first step's batch); the long groups are carried with their KV.
        prompts = [[5 + 5 * g + i for i in range(5)] for g in range(groups)]
        short = SamplingParams(temperature=1.0, max_new_tokens=1, n=2)
        long = SamplingParams(temperature=1.0, max_new_tokens=L, n=2)
        engine.add_prompts(prompts, sampling=[short] + [long] * (groups - 1))
        first = engine.step()
        assert {r.group_id for r in first.rollouts} == {0}
        poisoned = groups - 1  # with 3 groups, probed after group 1: a probe leaves it out too
        actor = engine._caches["actor"]
        carried = [s for s in engine._buffer.carried if s.group_id == poisoned]
        assert any(actor.num_tokens(s.seq_id) for s in carried), "the poisoned group holds no actor KV"

        # Its reward forwards fail from now on: retried, isolated, quarantined.
        if groups == 2:
            engine.add_prompts([[40, 41, 42]], sampling=[long])
            prompts.append([40, 41, 42])
        sim.faults.poison_prompt, sim.faults.poison_role = poisoned, "reward"
        t0 = sim.clock.now
        result = engine.step()  # before the fix: RuntimeError, the actor scheduler made no progress
        assert sim.clock.now - t0 < _STALL_S  # no run waited for pages only a run left out held
        assert {r.group_id for r in result.failed} == {poisoned} and len(result.failed) == 2
        assert all("poison" in r.error for r in result.failed)
        assert len(result.rollouts) == 2 and len({r.group_id for r in result.rollouts}) == 1
        for r in result.rollouts:  # exact: the oracle's tokens, and the reward of every token
            assert r.response_ids == _expected(sim, prompts[r.group_id], r.group_id, r.sample_index)
            assert r.reward == sim.oracle.reward(prompts[r.group_id], r.response_ids)
        check_pages(engine)
        assert engine.step().rollouts == []
        stats = engine.cache_stats()
        assert stats.free_pages == stats.total_pages  # the quarantined group's pages came back
    finally:
        sim.ex.closed = True
        engine.close()
