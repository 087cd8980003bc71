"""mode="intra": streaming the actor's tokens to the scorers while it decodes changes timing, never numbers.

Against ``sequential`` on the same seeds: the same tokens and policy versions, the same behaviour
log-probs; rewards, reference log-probs and critic values equal to HF's own forward on the whole sequence.
A one-shot failure injected in either lane is absorbed by the step's own retry: counted in ``retries``, no
page leaked, and the result equals a fault-free run.
"""

from __future__ import annotations

import os
import random

import pytest
import torch
from engine_models import EOS, make_actor, make_reward, random_prompts
from test_ppo_scorers import hf_ref_logprobs, hf_values, make_critic, make_reference

from oppo_engine import EngineConfig, RolloutEngine, SamplingParams

ATOL = 1e-4


@pytest.fixture(scope="module")
def models():
    return dict(actor=make_actor(), reward=make_reward(), reference=make_reference(), critic=make_critic())


def make_engine(models, mode: str, *, batch_size=6, temperature=1.0, max_new=14, **cfg) -> RolloutEngine:
    cfg.setdefault("max_model_len", 64)
    cfg.setdefault("page_size", 8)
    return RolloutEngine(
        **models,
        config=EngineConfig(batch_size=batch_size, mode=mode, **cfg),
        sampling=SamplingParams(temperature=temperature, max_new_tokens=max_new, seed=7),
        eos_token_id=EOS,
    )


def run(engine: RolloutEngine, prompts) -> list:
    engine.add_prompts(prompts)
    rollouts = []
    while result := engine.step().rollouts:
        rollouts.extend(result)
    return sorted(rollouts, key=lambda r: prompts.index(r.prompt_ids))


def assert_same_rollouts(got, want) -> None:
    assert [r.prompt_ids for r in got] == [r.prompt_ids for r in want]
    for g, w in zip(got, want, strict=True):
        assert g.response_ids == w.response_ids
        assert g.policy_versions == w.policy_versions
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=1e-5, rtol=0)
        assert g.reward == pytest.approx(w.reward, abs=ATOL)
        if w.ref_logprobs is not None:
            ref = torch.tensor(w.ref_logprobs)
            torch.testing.assert_close(torch.tensor(g.ref_logprobs), ref, atol=ATOL, rtol=0)
            torch.testing.assert_close(torch.tensor(g.values), torch.tensor(w.values), atol=ATOL, rtol=0)


@torch.inference_mode()
def assert_equals_hf(rollouts, models, temperature: float) -> None:
    for r in rollouts:
        ids = torch.tensor([r.prompt_ids + r.response_ids])
        assert r.reward == pytest.approx(models["reward"](ids).logits[0, 0].item(), abs=ATOL)
        want = hf_ref_logprobs(models["reference"], r.prompt_ids, r.response_ids, temperature)
        torch.testing.assert_close(torch.tensor(r.ref_logprobs), want, atol=ATOL, rtol=0)
        want = hf_values(models["critic"], r.prompt_ids, r.response_ids)
        torch.testing.assert_close(torch.tensor(r.values), want, atol=ATOL, rtol=0)


def assert_all_pages_free(engine: RolloutEngine) -> None:
    stats = engine.cache_stats()
    assert stats.free_pages == stats.total_pages, stats
    assert all(v == 0 for v in stats.pages_per_model.values()), stats


# Prompts of 2..13 tokens: several end mid-page (page_size 8), one-token chunks and chunks longer than
# any response are both covered by the chunk sizes.
@pytest.mark.parametrize("chunk_size", [1, 3, 8, 64])
def test_streamed_rollouts_equal_sequential_and_hf(models, chunk_size):
    prompts = random_prompts(9, seed=chunk_size, max_len=13)
    want = run(make_engine(models, "sequential"), prompts)
    engine = make_engine(models, "intra", chunk_size=chunk_size)
    got = run(engine, prompts)
    assert_same_rollouts(got, want)
    assert_equals_hf(got, models, temperature=1.0)
    assert_all_pages_free(engine)


def test_greedy_streaming_with_tight_memory_preempts_and_stays_exact(models):
    prompts = random_prompts(8, seed=21, max_len=13)
    want = run(make_engine(models, "sequential", temperature=0.0), prompts)
    # Room for a few sequences in all four models: the lanes compete for pages, the reserves arbitrate.
    page_bytes = make_engine(models, "sequential").cache_stats().page_bytes
    engine = make_engine(models, "intra", temperature=0.0, chunk_size=2, kv_cache_bytes=40 * page_bytes)
    got = run(engine, prompts)
    assert_same_rollouts(got, want)
    assert_all_pages_free(engine)


def test_a_rule_reward_is_read_when_a_sequence_ends(models):
    rule_models = dict(models, reward=lambda prompt, response: float(len(response)) + 0.5 * len(prompt))
    prompts = random_prompts(5, seed=3)
    got = run(make_engine(rule_models, "intra", chunk_size=2), prompts)
    assert [r.reward for r in got] == [len(r.response_ids) + 0.5 * len(r.prompt_ids) for r in got]


def test_metrics_show_the_handoffs_and_both_lanes(models):
    engine = make_engine(models, "intra", chunk_size=4, batch_size=4)
    engine.add_prompts(random_prompts(4, seed=5))
    m = engine.step().metrics
    assert m.chunk_size == 4
    assert m.handoffs >= 4 * 2  # every prompt, then at least its final chunk
    assert {"actor", "reward", "reference", "critic"} <= set(m.lane_busy)
    assert 0.0 <= m.exposed_scoring_s <= m.wall_s
    # The process's CPU seconds over the step: some, and no more than every core busy for the whole step.
    assert 0.0 < m.cpu_s <= os.cpu_count() * m.wall_s + 0.05
    assert engine.step().rollouts == []


def test_cpu_thread_count_is_restored_after_a_streamed_step(models):
    before = torch.get_num_threads()
    engine = make_engine(models, "intra", chunk_size=4, batch_size=2)
    engine.add_prompts(random_prompts(2, seed=6))
    engine.step()
    assert torch.get_num_threads() == before


class Boom(RuntimeError):
    pass


def _fail_on_call(obj, name: str, k: int) -> list[int]:
    """Make ``obj.name`` raise Boom on its k-th call (0-based); returns the call counter."""
    original = getattr(obj, name)
    calls = [0]

    def wrapped(*args, **kwargs):
        calls[0] += 1
        if calls[0] - 1 == k:
            raise Boom(f"injected into {name} at call {k}")
        return original(*args, **kwargs)

    setattr(obj, name, wrapped)
    return calls


@pytest.mark.parametrize("lane", ["actor", "reward", "reference", "critic"])
def test_a_one_shot_failure_in_any_lane_is_absorbed_leaks_nothing_and_equals_a_fault_free_run(models, lane):
    prompts = random_prompts(6, seed=11)

    def lane_call(engine: RolloutEngine) -> tuple[object, str]:
        if lane == "actor":
            return engine._loop.actor, "forward"
        return engine._loop.scorer_lane.scheds[lane].scorer, "prefill"

    # How often a lane runs a forward depends on how the threads interleave; a budget of 8 tokens per
    # forward makes it at least 12 times in either lane (~130 prompt and response tokens), whatever the order.
    budget = dict(chunk_size=3, max_num_batched_tokens=8)
    clean = make_engine(models, "intra", **budget)
    calls = _fail_on_call(*lane_call(clean), k=-1)
    want = run(clean, prompts)
    assert calls[0] >= 12
    rng = random.Random(lane)
    for _ in range(3):  # a few random points in the step
        engine = make_engine(models, "intra", **budget)
        calls = _fail_on_call(*lane_call(engine), k=rng.randrange(12))
        engine.add_prompts(prompts)  # one step of B = 6
        threads = torch.get_num_threads()
        result = engine.step()
        assert result.metrics.retries == 1 and result.failed == []
        assert_all_pages_free(engine)
        assert torch.get_num_threads() == threads
        # The failing call was retried within the step: its result is what a clean run gives.
        got = sorted(result.rollouts, key=lambda r: prompts.index(r.prompt_ids))
        assert_same_rollouts(got, want)
        assert engine.step().rollouts == []
        assert_all_pages_free(engine)


def test_auto_chunk_size_explores_measured_candidates_and_profiles_the_lanes(models):
    from oppo_engine.control import ChunkControl

    control = ChunkControl(  # nothing hopeless or futile, no budget: every exploration tries sizes,
        candidates=(2, 4, 8),  # whatever the profile says
        explore_period=2,
        explore_top=2,
        min_samples=2,
        noise_window=4,
        hopeless_margin=1e9,
        prior="list",
        explore_budget=None,
    )
    engine = make_engine(models, "intra", batch_size=3, chunk=control)
    engine.add_prompts(random_prompts(3 * 8, seed=8))
    sizes = []
    while (result := engine.step()).rollouts:
        sizes.append(result.metrics.chunk_size)
    # it explored; "off" (no streaming) is an arm like the sizes
    assert set(sizes) <= {*control.candidates, "off"} and len(set(sizes)) >= 2
    assert [c for _, c, _ in engine.chunk_history] == sizes
    profile = engine._profiler.observe(engine.timeline.spans(), sizes[-1], 1, [])
    assert profile is None or (profile.decode_iter_s > 0 and profile.running_seqs > 0)


@pytest.mark.cuda
def test_streams_on_cuda_equal_sequential_and_hf():
    """The two-stream path: the actor on a high-priority stream, the scorers on a low-priority one."""
    makers = dict(actor=make_actor, reward=make_reward, reference=make_reference, critic=make_critic)
    cuda = {name: make().to("cuda") for name, make in makers.items()}
    prompts = random_prompts(8, seed=31, max_len=13)
    want = run(make_engine(cuda, "sequential"), prompts)
    engine = make_engine(cuda, "intra", chunk_size=3)
    lanes = (engine._loop.actor_lane.stream, engine._loop.scorer_lane.device_lane.stream)
    assert lanes[0].priority < lanes[1].priority  # lower is higher on CUDA
    got = run(engine, prompts)
    assert_same_rollouts(got, want)
    cpu = {name: m.to("cpu") for name, m in cuda.items()}
    assert_equals_hf(got, cpu, temperature=1.0)
    assert_all_pages_free(engine)
