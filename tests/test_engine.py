"""RolloutEngine in mode="sequential": equivalence with HF, batch invariance, page accounting, bad input."""

from __future__ import annotations

import pytest
import torch
from engine_models import EOS, VOCAB, make_actor, make_reward, random_prompts

from oppo_engine import EngineConfig, RolloutEngine, SamplingParams


@pytest.fixture(scope="module")
def actor():
    return make_actor()


@pytest.fixture(scope="module")
def reward():
    return make_reward()


def make_engine(actor, reward, *, batch_size=4, sampling=None, **cfg) -> RolloutEngine:
    cfg.setdefault("max_model_len", 64)
    cfg.setdefault("page_size", 8)
    return RolloutEngine(
        actor=actor,
        reward=reward,
        config=EngineConfig(batch_size=batch_size, mode="sequential", **cfg),
        sampling=sampling or SamplingParams(temperature=0.0, max_new_tokens=10),
        eos_token_id=EOS,
    )


def drain(engine: RolloutEngine) -> list:
    rollouts = []
    while True:
        result = engine.step()
        if not result.rollouts:
            return rollouts
        rollouts.extend(result.rollouts)


def assert_all_pages_free(engine: RolloutEngine) -> None:
    stats = engine.cache_stats()
    assert stats.free_pages == stats.total_pages, stats
    assert all(v == 0 for v in stats.pages_per_model.values()), stats


@torch.inference_mode()
def hf_reward(reward, ids: list[int]) -> float:
    return reward(torch.tensor([ids], device=reward.device)).logits[0, 0].item()


def test_greedy_rollouts_equal_hf_generate(actor, reward):
    prompts = random_prompts(6, seed=0)
    engine = make_engine(actor, reward, batch_size=3)
    engine.add_prompts(prompts)
    rollouts = drain(engine)
    assert sorted(map(tuple, (r.prompt_ids for r in rollouts))) == sorted(map(tuple, prompts))
    for r in rollouts:
        with torch.inference_mode():
            out = actor.generate(
                torch.tensor([r.prompt_ids]),
                attention_mask=torch.ones(1, len(r.prompt_ids), dtype=torch.long),
                do_sample=False,
                max_new_tokens=10,
                eos_token_id=EOS,
                pad_token_id=0,
            )
        expected = out[0, len(r.prompt_ids) :].tolist()
        if EOS in expected:  # HF pads after EOS; the engine stops at it
            expected = expected[: expected.index(EOS) + 1]
        assert r.response_ids == expected
        # The behaviour log-probs are the actor's own, and the reward is the reward model's on the full text.
        with torch.inference_mode():
            full = torch.tensor([r.prompt_ids + r.response_ids])
            logp = actor(full).logits[0].float().log_softmax(-1)
        p = len(r.prompt_ids)
        want = [logp[p - 1 + i, t].item() for i, t in enumerate(r.response_ids)]
        assert r.logprobs == pytest.approx(want, abs=1e-4)
        assert r.reward == pytest.approx(hf_reward(reward, r.prompt_ids + r.response_ids), abs=1e-4)
    assert_all_pages_free(engine)


def test_sampled_rollouts_identical_alone_or_in_batch_of_16(actor, reward):
    prompts = random_prompts(16, seed=1)
    sampling = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, max_new_tokens=8, seed=7)
    batched = make_engine(actor, reward, batch_size=16, sampling=sampling)
    batched.add_prompts(prompts)
    together = {tuple(r.prompt_ids): r for r in drain(batched)}
    alone = make_engine(actor, reward, batch_size=1, sampling=sampling)
    alone.add_prompts(prompts)
    single = {tuple(r.prompt_ids): r for r in drain(alone)}
    assert together.keys() == single.keys() and len(together) == 16
    for key, r in together.items():
        assert r.response_ids == single[key].response_ids
        assert r.logprobs == pytest.approx(single[key].logprobs, abs=1e-5)
        assert r.reward == pytest.approx(single[key].reward, abs=1e-5)
    # Sampling really sampled: not every response is the greedy one.
    greedy = make_engine(actor, reward, batch_size=16)
    greedy.add_prompts(prompts)
    greedy_out = {tuple(r.prompt_ids): r.response_ids for r in drain(greedy)}
    assert any(greedy_out[k] != r.response_ids for k, r in together.items())


def test_step_returns_batch_size_then_remainder_then_empty(actor, reward):
    engine = make_engine(actor, reward, batch_size=2)
    engine.add_prompts(random_prompts(5, seed=2))
    sizes = [len(engine.step().rollouts) for _ in range(4)]
    assert sizes == [2, 2, 1, 0]
    assert_all_pages_free(engine)


def test_rollouts_come_in_finish_order(actor, reward):
    prompt = random_prompts(1, seed=3)[0]
    lengths = [9, 2, 6, 4]
    engine = make_engine(actor, reward, batch_size=4)
    engine.add_prompts(
        [prompt] * 4,
        sampling=[SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True) for n in lengths],
    )
    result = engine.step()
    assert [len(r.response_ids) for r in result.rollouts] == sorted(lengths)
    assert result.metrics.rollouts == 4
    assert result.metrics.tokens_generated == sum(lengths)


def test_no_page_leaks_after_preemption_and_tokens_unchanged(actor, reward):
    prompts = random_prompts(8, seed=4, min_len=10, max_len=20)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=30, ignore_eos=True, seed=3)
    roomy = make_engine(actor, reward, batch_size=8, sampling=sampling)
    roomy.add_prompts(prompts)
    expected = {tuple(r.prompt_ids): r.response_ids for r in drain(roomy)}
    # Just enough pages for one sequence of max_model_len in both models: eight sequences must preempt.
    spec_pages = roomy.cache_stats().page_bytes
    tight = make_engine(actor, reward, batch_size=8, sampling=sampling, kv_cache_bytes=spec_pages * 18)
    tight.add_prompts(prompts)
    got = {tuple(r.prompt_ids): r.response_ids for r in drain(tight)}
    assert tight._loop.actor_sched.num_preemptions > 0  # the scenario really preempted
    assert got == expected
    assert_all_pages_free(tight)


def test_a_one_shot_reward_failure_is_absorbed_by_the_retry_and_equals_a_fault_free_run(actor, reward):
    calls = {"n": 0}

    def flaky_reward(prompt_ids, response_ids):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("reward service down")
        return float(len(response_ids))

    prompts = random_prompts(3, seed=5)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=6)
    engine = make_engine(actor, flaky_reward, batch_size=3, sampling=sampling)
    engine.add_prompts(prompts)
    result = engine.step()
    assert result.metrics.retries == 1 and result.failed == []
    assert_all_pages_free(engine)
    reference = make_engine(actor, lambda p, r: float(len(r)), batch_size=3, sampling=sampling)
    reference.add_prompts(prompts)
    want = reference.step()
    assert want.metrics.retries == 0
    assert [(r.prompt_ids, r.response_ids, r.logprobs) for r in result.rollouts] == [
        (r.prompt_ids, r.response_ids, r.logprobs) for r in want.rollouts
    ]
    assert all(r.reward == len(r.response_ids) for r in result.rollouts)


def test_an_interrupt_in_a_reward_rolls_back_exactly_and_the_next_step_is_exact(actor, reward):
    calls = {"n": 0}

    def interrupted_reward(prompt_ids, response_ids):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt  # a BaseException: never retried
        return float(len(response_ids))

    prompts = random_prompts(3, seed=5)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=6)
    engine = make_engine(actor, interrupted_reward, batch_size=3, sampling=sampling)
    engine.add_prompts(prompts)
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    assert calls["n"] == 2  # not retried
    assert_all_pages_free(engine)
    reference = make_engine(actor, lambda p, r: float(len(r)), batch_size=3, sampling=sampling)
    reference.add_prompts(prompts)
    got, want = engine.step(), reference.step()
    assert [(r.prompt_ids, r.response_ids) for r in got.rollouts] == [
        (r.prompt_ids, r.response_ids) for r in want.rollouts
    ]


def test_policy_version_tags_each_token(actor, reward):
    engine = make_engine(actor, reward, batch_size=1)
    engine.add_prompts(random_prompts(2, seed=6))
    first = engine.step().rollouts[0]
    engine.update_policy()
    second = engine.step().rollouts[0]
    assert set(first.policy_versions) == {0} and len(first.policy_versions) == len(first.response_ids)
    assert set(second.policy_versions) == {1}


def test_release_memory_and_resume(actor, reward):
    engine = make_engine(actor, reward, batch_size=2)
    engine.add_prompts(random_prompts(4, seed=8))
    engine.step()
    engine.release_memory()
    with pytest.raises(RuntimeError, match="resume"):
        engine.step()
    engine.resume()
    assert len(engine.step().rollouts) == 2
    assert_all_pages_free(engine)
    engine.close()
    with pytest.raises(RuntimeError, match="closed"):
        engine.step()


@pytest.mark.parametrize(
    ("prompts", "match"),
    [
        ([[]], r"prompt_token_ids\[1\] is empty"),
        ([[5] * 64], "max_model_len=64"),
        ([[5, VOCAB]], rf"outside the vocabulary \[0, {VOCAB}\)"),
        ([[5, -1]], "outside the vocabulary"),
    ],
)
def test_bad_prompts_raise_value_error_and_engine_stays_usable(actor, reward, prompts, match):
    engine = make_engine(actor, reward, batch_size=1)
    with pytest.raises(ValueError, match=match):
        engine.add_prompts([[7, 8]] + prompts)
    engine.add_prompts([[7, 8]])
    assert len(engine.step().rollouts) == 1  # the bad call queued nothing
    assert len(engine.step().rollouts) == 0


def test_batch_size_beyond_cache_raises(actor, reward):
    probe = make_engine(actor, reward, batch_size=1)
    page_bytes = probe.cache_stats().page_bytes
    with pytest.raises(ValueError, match="batch_size=64 exceeds"):
        make_engine(actor, reward, batch_size=64, kv_cache_bytes=page_bytes * 20)
    with pytest.raises(ValueError, match="max_model_len=64"):
        make_engine(actor, reward, batch_size=1, kv_cache_bytes=page_bytes * 2)


def test_models_on_different_devices_raise(actor):
    reward_meta = make_reward().to("meta")
    with pytest.raises(ValueError, match="different devices"):
        make_engine(actor, reward_meta)


def test_reward_without_score_head_raises(actor):
    with pytest.raises(ValueError, match="reward"):
        make_engine(actor, make_actor(seed=3))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(batch_size=0), "batch_size"),
        (dict(mode="fast"), "mode"),
        (dict(page_size=12), "page_size"),
        (dict(chunk_size=0), "chunk_size"),
    ],
)
def test_bad_config_raises_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kwargs)


def test_unavailable_attention_backend_raises(actor, reward):
    with pytest.raises(ValueError, match="attention_backend='flash_attn' cannot be used"):
        make_engine(actor, reward, attention_backend="flash_attn")


def test_default_mode_is_oppo_and_every_mode_builds(actor, reward):
    assert EngineConfig().mode == "oppo"
    for mode in ("sequential", "intra", "inter", "oppo"):
        engine = RolloutEngine(
            actor=actor, reward=reward, config=EngineConfig(batch_size=2, mode=mode, max_model_len=64)
        )
        assert engine.config.mode == mode
        engine.close()


def test_a_one_shot_failure_mid_decode_is_absorbed_frees_its_pages_and_equals_a_fresh_run(actor, reward):
    prompts = random_prompts(4, seed=9)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=12)
    engine = make_engine(actor, reward, batch_size=4, sampling=sampling)
    engine.add_prompts(prompts)
    calls = {"n": 0}

    def fail_on_fifth_forward(module, args, kwargs):
        calls["n"] += 1
        if calls["n"] == 5:
            raise RuntimeError("device fell over")

    handle = actor.model.register_forward_pre_hook(fail_on_fifth_forward, with_kwargs=True)
    try:
        result = engine.step()
    finally:
        handle.remove()
    assert calls["n"] > 5 and result.metrics.retries == 1 and result.failed == []
    assert_all_pages_free(engine)
    # Nothing was lost: the same four prompts, generated exactly as an untouched engine does.
    fresh = make_engine(actor, reward, batch_size=4, sampling=sampling)
    fresh.add_prompts(prompts)
    want = {tuple(r.prompt_ids): r.response_ids for r in fresh.step().rollouts}
    assert {tuple(r.prompt_ids): r.response_ids for r in result.rollouts} == want


def test_prompt_source_is_pulled_lazily_and_bad_prompts_are_reported(actor, reward):
    pulled = []

    def source():
        for p in random_prompts(3, seed=10) + [[]] + random_prompts(1, seed=11):
            pulled.append(p)
            yield p

    engine = make_engine(actor, reward, batch_size=2)
    engine.set_prompt_source(source())
    assert pulled == []
    assert len(engine.step().rollouts) == 2 and len(pulled) == 2
    with pytest.raises(ValueError, match="prompt source is empty"):
        engine.step()  # the third prompt is fine, the fourth is empty
    assert_all_pages_free(engine)
    sizes = [len(engine.step().rollouts) for _ in range(2)]
    assert sizes == [2, 0]  # the good third prompt was kept, then the fifth


@pytest.mark.cuda
def test_on_cuda_greedy_rollouts_equal_hf_generate_and_sampling_is_batch_invariant():
    actor, reward = make_actor().cuda(), make_reward().cuda()
    prompts = random_prompts(8, seed=12)
    engine = make_engine(actor, reward, batch_size=8)
    engine.add_prompts(prompts)
    for r in drain(engine):
        with torch.inference_mode():
            out = actor.generate(
                torch.tensor([r.prompt_ids], device="cuda"),
                do_sample=False,
                max_new_tokens=10,
                eos_token_id=EOS,
                pad_token_id=0,
            )
        expected = out[0, len(r.prompt_ids) :].tolist()
        if EOS in expected:
            expected = expected[: expected.index(EOS) + 1]
        assert r.response_ids == expected
        assert r.reward == pytest.approx(hf_reward(reward, r.prompt_ids + r.response_ids), abs=1e-3)
    sampling = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=8)
    outs = []
    for batch_size in (8, 1):
        engine = make_engine(actor, reward, batch_size=batch_size, sampling=sampling)
        engine.add_prompts(prompts)
        outs.append({tuple(r.prompt_ids): r.response_ids for r in drain(engine)})
        assert_all_pages_free(engine)
    assert outs[0] == outs[1]
