"""The engine driven through the real Triton kernels (interpreted on CPU, native on CUDA).

On CPU the engine normally runs the torch references; here ``ops.triton_on_cpu()`` routes attention and
sampling through the Triton kernels, so the kernels are checked with the tensors HF models really hand
them (non-contiguous q/k/v views, packed mixes of prefill and decode, GQA) before any GPU sees them.
"""

from __future__ import annotations

import pytest
import torch
from engine_models import EOS, make_actor, make_reward, random_prompts

from oppo_engine import EngineConfig, RolloutEngine, SamplingParams, ops


def run(actor, reward, prompts, sampling):
    engine = RolloutEngine(
        actor=actor,
        reward=reward,
        config=EngineConfig(batch_size=len(prompts), mode="sequential", max_model_len=64, page_size=8),
        sampling=sampling,
        eos_token_id=EOS,
    )
    engine.add_prompts(prompts)
    return {tuple(r.prompt_ids): r for r in engine.step().rollouts}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_engine_through_triton_kernels_equals_reference_path(temperature):
    if torch.cuda.is_available():
        pytest.skip("on CUDA the engine always runs the Triton kernels; test_engine covers it")
    actor, reward = make_actor(), make_reward()
    # Prompts long enough to cross pages, with a mix of prefill and decode in the same forwards.
    prompts = random_prompts(3, seed=21, min_len=5, max_len=19)
    sampling = SamplingParams(temperature=temperature, max_new_tokens=6, seed=5)
    expected = run(actor, reward, prompts, sampling)
    with ops.triton_on_cpu():
        got = run(actor, reward, prompts, sampling)
    assert got.keys() == expected.keys()
    for key, r in got.items():
        assert r.response_ids == expected[key].response_ids
        assert r.logprobs == pytest.approx(expected[key].logprobs, abs=1e-4)
        assert r.reward == pytest.approx(expected[key].reward, abs=1e-4)


@pytest.mark.parametrize("family", ["gemma2", "mistral_window"])
def test_windows_and_softcap_through_triton_kernels_equal_the_cpu_op(family):
    """Per-layer sliding windows (and Gemma2's attention softcap) through the interpreted Triton kernel,
    against the C++ CPU op, on sequences longer than the window."""
    if torch.cuda.is_available():
        pytest.skip("on CUDA the engine always runs the Triton kernels; the family matrix covers it")
    from families import EOS as FAMILY_EOS
    from families import build_actor, build_reward, prompts, reward_family

    actor, reward = build_actor(family), build_reward(reward_family(family))
    batch = prompts([3, 9, 12], seed=4)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=6, seed=9)

    def run_family():
        engine = RolloutEngine(
            actor=actor,
            reward=reward,
            # Sequential: the Triton interpreter patches tensor operators process-wide while a kernel
            # runs, so two lanes interpreting kernels at once (streamed modes) break each other.
            config=EngineConfig(batch_size=len(batch), mode="sequential", max_model_len=64, page_size=8),
            sampling=sampling,
            eos_token_id=FAMILY_EOS,
        )
        engine.add_prompts(batch)
        return {tuple(r.prompt_ids): r for r in engine.step().rollouts}

    expected = run_family()
    with ops.triton_on_cpu():
        got = run_family()
    for key, r in got.items():
        assert r.response_ids == expected[key].response_ids
        assert r.logprobs == pytest.approx(expected[key].logprobs, abs=1e-4)
        assert r.reward == pytest.approx(expected[key].reward, abs=1e-4)
