"""Reward callables: a wrong arity is refused at build, a wrong result fails at the call that returned it
(naming the reward), numbers of every ordinary kind pass unchanged, and BatchedReward is called once per
scoring pass with every sequence that pass finishes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from engine_models import EOS, make_actor, random_prompts

from oppo_engine import BatchedReward, EngineConfig, RolloutEngine, SamplingParams


@pytest.fixture(scope="module")
def actor():
    return make_actor()


def make_engine(actor, reward, *, mode="sequential", batch_size=4, **cfg) -> RolloutEngine:
    if mode == "oppo":
        cfg.setdefault("chunk_size", 4)
    return RolloutEngine(
        actor=actor,
        reward=reward,
        config=EngineConfig(batch_size=batch_size, mode=mode, max_model_len=64, page_size=8, **cfg),
        sampling=SamplingParams(temperature=1.0, max_new_tokens=6, seed=2),
        eos_token_id=EOS,
    )


def length_reward(prompt, response):
    return float(len(prompt) + 10 * len(response))


@pytest.mark.parametrize(
    "reward",
    [lambda p: 0.0, lambda: 0.0, lambda p, r, extra: 0.0, BatchedReward.__call__],
    ids=["one", "none", "three", "unbound"],
)
def test_wrong_arity_is_refused_at_build_naming_the_reward(actor, reward):
    with pytest.raises(TypeError, match=r"reward=.* cannot be called as reward\(prompt_ids, response_ids\)"):
        make_engine(actor, reward)


def test_callables_with_defaults_or_varargs_are_accepted(actor):
    make_engine(actor, lambda p, r, scale=1.0: 0.0).close()
    make_engine(actor, lambda *args: 0.0).close()


@pytest.mark.parametrize(
    "convert",
    [int, float, np.float32, np.int64, lambda x: torch.tensor(x), lambda x: torch.tensor(float(x))],
    ids=["int", "float", "np.float32", "np.int64", "tensor-int", "tensor-float"],
)
def test_every_ordinary_number_passes_as_its_value(actor, convert):
    engine = make_engine(actor, lambda p, r: convert(len(p) + 10 * len(r)))
    engine.add_prompts(random_prompts(4, seed=1))
    for r in engine.step().rollouts:
        assert r.reward == length_reward(r.prompt_ids, r.response_ids)
        assert type(r.reward) is float


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        (None, TypeError, "returned NoneType"),
        (True, TypeError, "returned bool"),
        (np.bool_(True), TypeError, "returned bool"),
        ("1.0", TypeError, "returned str"),
        (torch.tensor([1.0, 2.0]), TypeError, "returned Tensor"),
        (float("nan"), ValueError, "returned nan: rewards must be finite"),
        (float("inf"), ValueError, "returned inf"),
    ],
)
def test_a_wrong_result_fails_the_step_naming_the_reward(actor, value, error, match):
    def my_reward(prompt, response):
        return value

    engine = make_engine(actor, my_reward)
    engine.add_prompts(random_prompts(4, seed=1))
    with pytest.raises(error, match=f"reward .*my_reward {match}"):
        engine.step()
    stats = engine.cache_stats()
    assert stats.free_pages == stats.total_pages  # rolled back, nothing leaked


@pytest.mark.parametrize("mode", ["sequential", "oppo"])
def test_batched_reward_is_called_once_per_scoring_pass_with_every_finished_sequence(actor, mode):
    calls = []

    def batched(prompts, responses):
        calls.append(len(prompts))
        return [length_reward(p, r) for p, r in zip(prompts, responses, strict=True)]

    engine = make_engine(
        actor, BatchedReward(batched), mode=mode, **({"overcommit": 0} if mode == "oppo" else {})
    )
    engine.add_prompts(random_prompts(8, seed=4))
    rollouts = engine.step().rollouts + engine.step().rollouts
    assert len(rollouts) == 8
    assert all(r.reward == length_reward(r.prompt_ids, r.response_ids) for r in rollouts)
    assert sum(calls) == 8
    if mode == "sequential":
        assert calls == [4, 4]  # one scoring pass per step, every finished sequence in it


@pytest.mark.parametrize(
    ("fn", "error", "match"),
    [
        (lambda ps, rs: [1.0] * (len(ps) - 1), ValueError, "returned 3 rewards for 4 sequences"),
        (lambda ps, rs: 1.0, TypeError, "returned float; it must return a list of floats"),
        (lambda ps, rs: [None] * len(ps), TypeError, "returned NoneType"),
    ],
)
def test_a_wrong_batched_result_fails_the_step(actor, fn, error, match):
    engine = make_engine(actor, BatchedReward(fn))
    engine.add_prompts(random_prompts(4, seed=1))
    with pytest.raises(error, match=match):
        engine.step()


def test_batched_reward_checks_its_function_when_made():
    with pytest.raises(
        TypeError, match=r"BatchedReward\(fn\)=.* cannot be called as fn\(prompts, responses\)"
    ):
        BatchedReward(lambda prompts: [0.0])
    with pytest.raises(TypeError, match="must be callable"):
        BatchedReward([1.0])
