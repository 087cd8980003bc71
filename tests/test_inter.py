"""mode="inter" and mode="oppo": B + Δ sequences in flight, the first B finished and scored are returned, the
rest is carried over -- tokens, log-probs, versions and every model's KV -- without changing a number.

Against ``sequential`` on the same seeds, every prompt's rollout is the same (tokens, versions, log-probs;
rewards, reference log-probs and values equal HF's own forward). The cut, the staleness bound, the end of the
prompt supply, the rollback of a failed step over carried sequences, and the metrics are checked here; policy
updates, memory release and checkpoints in test_retained.py.
"""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
from engine_models import EOS, make_actor, make_reward, random_prompts
from test_intra import assert_all_pages_free, assert_equals_hf, assert_same_rollouts
from test_ppo_scorers import make_critic, make_reference

from oppo_engine import EngineConfig, RolloutEngine, SamplingParams
from oppo_engine.sched.overcommit import deferral_bound
from oppo_engine.sched.sequence import SeqStatus


@pytest.fixture(scope="module")
def models():
    return dict(actor=make_actor(), reward=make_reward(), reference=make_reference(), critic=make_critic())


def make_engine(models, mode: str, *, batch_size=4, temperature=1.0, max_new=14, **cfg) -> RolloutEngine:
    cfg.setdefault("max_model_len", 64)
    cfg.setdefault("page_size", 8)
    if mode in ("intra", "oppo"):
        cfg.setdefault("chunk_size", 3)
    if mode in ("inter", "oppo"):
        cfg.setdefault("overcommit", 2)
    return RolloutEngine(
        **models,
        config=EngineConfig(batch_size=batch_size, mode=mode, **cfg),
        sampling=SamplingParams(temperature=temperature, max_new_tokens=max_new, seed=7),
        eos_token_id=EOS,
    )


def lengths_sampling(lengths: list[int], temperature: float = 1.0) -> list[SamplingParams]:
    return [SamplingParams(temperature=temperature, max_new_tokens=n, ignore_eos=True) for n in lengths]


def drain(engine: RolloutEngine) -> list[list]:
    """Every step's rollouts until an empty step."""
    steps = []
    while result := engine.step().rollouts:
        steps.append(result)
    return steps


def by_prompt(steps, prompts) -> list:
    flat = [r for step in steps for r in step]
    return sorted(flat, key=lambda r: prompts.index(r.prompt_ids))


@pytest.mark.parametrize("mode", ["inter", "oppo"])
def test_overcommitted_rollouts_equal_sequential_and_hf(models, mode):
    prompts = random_prompts(11, seed=40, max_len=13)  # distinct prompts: index() finds each one
    want = by_prompt(drain(_with(make_engine(models, "sequential"), prompts)), prompts)
    engine = make_engine(models, mode, overcommit=3)
    steps = drain(_with(engine, prompts))
    got = by_prompt(steps, prompts)
    assert_same_rollouts(got, want)  # every prompt exactly once, the same numbers
    assert_equals_hf(got, models, temperature=1.0)
    assert [len(s) for s in steps] == [4, 4, 3]
    assert any(r.deferred_steps > 0 for r in got)  # something really was carried over
    assert_all_pages_free(engine)


def _with(engine: RolloutEngine, prompts, sampling=None) -> RolloutEngine:
    engine.add_prompts(prompts, sampling=sampling)
    return engine


@pytest.mark.parametrize("mode", ["inter", "oppo"])
def test_the_first_b_to_finish_are_returned_in_finish_order_and_the_rest_carried(models, mode):
    prompts = random_prompts(6, seed=41)
    lengths = [12, 3, 9, 2, 14, 5]
    engine = _with(make_engine(models, mode, batch_size=2, overcommit=2), prompts, lengths_sampling(lengths))
    first = engine.step()
    # In flight: prompts 0..3; the two shortest finish first, shortest first.
    assert [len(r.response_ids) for r in first.rollouts] == [2, 3]
    assert first.metrics.overcommit == 2 and first.metrics.deferred == 2
    # The carried ones keep their KV while unfinished. In oppo the actor decodes on while the batch is
    # scored, so on a slow scorer lane both may finish -- and be scored, holding no page -- within the step.
    unfinished = [s for s in engine._buffer.carried if s.status not in (SeqStatus.FINISHED, SeqStatus.SCORED)]
    if mode == "inter":
        assert len(unfinished) == 2  # the actor stopped at the cut
    if unfinished:
        assert engine.cache_stats().retained_pages > 0
    second = engine.step()
    got = [(len(r.response_ids), r.deferred_steps) for r in second.rollouts]
    if mode == "inter":
        # The actor stopped at the cut, when 12 and 9 had 3 tokens: 9 has 6 to go, the new 5 has 5.
        assert got == [(5, 0), (9, 1)]
    else:
        # The actor decoded on while the batch was scored: how far 12 and 9 got depends on the lanes'
        # timing, so which of 9, 5 (and 12) finish first does too.
        assert set(got) <= {(9, 1), (5, 0), (12, 1)}
    assert second.metrics.deferral_histogram == dict(sorted(Counter(d for _, d in got).items()))
    rest = drain(engine)
    returned = [len(r.response_ids) for r in first.rollouts + second.rollouts] + [
        len(r.response_ids) for s in rest for r in s
    ]
    assert sorted(returned) == sorted(lengths)
    assert_all_pages_free(engine)


@pytest.mark.parametrize(("batch_size", "overcommit", "max_deferrals"), [(2, 2, 1), (3, 2, 2), (2, 5, 1)])
def test_no_rollout_is_deferred_beyond_the_bound_and_every_step_returns_b(
    models, batch_size, overcommit, max_deferrals
):
    rng = random.Random(batch_size * 10 + overcommit)
    n = 5 * batch_size + 1
    prompts = random_prompts(n, seed=42 + overcommit)
    # A long tail: a few responses much longer than the rest, which the cut would otherwise defer forever.
    lengths = [rng.choice([1, 2, 3, 30]) for _ in range(n)]
    # The deferral bound alone (Δ may exceed B): the policy-lag bound is tests/test_policy_lag.py's.
    engine = make_engine(
        models, "inter", batch_size=batch_size, overcommit=overcommit, max_deferrals=max_deferrals,
        max_policy_lag=None,
    )  # fmt: skip
    steps = drain(_with(engine, prompts, lengths_sampling(lengths)))
    bound = deferral_bound(batch_size, max_deferrals, overcommit)
    assert bound == max_deferrals + (math.ceil(overcommit / batch_size) - 1)
    assert max(r.deferred_steps for s in steps for r in s) <= bound
    sizes = [len(s) for s in steps]
    assert all(k == batch_size for k in sizes[:-1]) and sum(sizes) == n
    assert sorted(map(tuple, (r.prompt_ids for s in steps for r in s))) == sorted(map(tuple, prompts))
    assert_all_pages_free(engine)


def test_a_sequence_at_the_deferral_limit_is_waited_for(models):
    prompts = random_prompts(6, seed=43)
    # Prompt 0 is long; with max_deferrals=1 it must be in the second step's batch, however long it takes.
    engine = make_engine(models, "inter", batch_size=2, overcommit=1, max_deferrals=1)
    _with(engine, prompts, lengths_sampling([30, 2, 2, 2, 2, 2]))
    assert [len(r.response_ids) for r in engine.step().rollouts] == [2, 2]
    second = engine.step().rollouts
    assert [(len(r.response_ids), r.deferred_steps) for r in second] == [(2, 0), (30, 1)]


def test_when_prompts_run_out_the_rest_comes_back_then_empty_results(models):
    engine = _with(make_engine(models, "oppo", batch_size=3, overcommit=3), random_prompts(7, seed=44))
    sizes = [len(engine.step().rollouts) for _ in range(5)]
    assert sizes == [3, 3, 1, 0, 0]
    assert_all_pages_free(engine)


def test_metrics_of_an_overcommitted_step(models):
    prompts = random_prompts(8, seed=45)
    lengths = [2, 3, 20, 21, 4, 5, 22, 6]
    engine = make_engine(models, "oppo", batch_size=2, overcommit=2, max_deferrals=1)
    _with(engine, prompts, lengths_sampling(lengths))
    first = engine.step()
    m = first.metrics
    assert (m.overcommit, m.deferred, m.rollouts) == (2, 2, 2)
    assert m.deferral_histogram == {0: 2} and m.stale_tokens == 0
    # The cut returned the two shortest: shorter than the mean of all finished so far, or equal.
    assert m.length_bias is not None and 0 < m.length_bias <= 1.0
    engine.update_policy()
    second = engine.step()
    m2 = second.metrics
    # The two carried ones are due (max_deferrals=1): both come back, with tokens of policy 0 in them.
    assert sorted(len(r.response_ids) for r in second.rollouts) == [20, 21]
    assert m2.deferral_histogram == {1: 2}
    stale = sum(v < engine.policy_version for r in second.rollouts for v in r.policy_versions)
    assert m2.stale_tokens == stale > 0
    assert m2.length_bias > 1.0  # long ones this time
    assert m2.reused_tokens["reward"] > 0 and m2.reused_tokens["reference"] > 0  # frozen KV kept
    assert m2.reused_tokens["actor"] == 0 and m2.recomputed_tokens["actor"] > 0  # recompute policy
    assert m2.reused_tokens["critic"] == 0 and m2.recomputed_tokens["critic"] > 0  # critic is trained


@pytest.mark.parametrize("mode", ["inter", "oppo"])
def test_tight_memory_preempts_and_stays_exact(models, mode):
    prompts = random_prompts(9, seed=46, max_len=13)
    want = by_prompt(drain(_with(make_engine(models, "sequential", temperature=0.0), prompts)), prompts)
    page_bytes = make_engine(models, "sequential").cache_stats().page_bytes
    engine = make_engine(models, mode, temperature=0.0, overcommit=4, kv_cache_bytes=27 * page_bytes)
    _with(engine, prompts)
    steps, swapped, recomputed = [], Counter(), Counter()
    while (result := engine.step()).rollouts:
        steps.append(result.rollouts)
        swapped.update(result.metrics.swapped_tokens)
        recomputed.update(result.metrics.recomputed_tokens)
    assert_same_rollouts(by_prompt(steps, prompts), want)
    assert engine._loop.actor_sched.num_preemptions > 0  # the scenario really preempted
    # A preempted scorer's KV goes to host and comes back: swapped, never prefilled again.
    scheds = engine._loop.scorer_lane.scheds
    for name in scheds:
        assert recomputed[name] == 0
        assert (swapped[name] > 0) == (scheds[name].num_preemptions > 0)
    assert_all_pages_free(engine)
