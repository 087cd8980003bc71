"""The exact fused modules of ``oppo_engine/model/fused.py``: bit for bit HF's modules, in the op and in the
engine (tokens and log-probs with fusion equal those without, to the bit)."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from families import FAMILIES, ROUTED, build_actor, prompts
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from oppo_engine import EngineConfig, RolloutEngine, SamplingParams, ops
from oppo_engine.model import fused

DTYPES = (torch.float32, torch.bfloat16)


def random_norm(hidden: int, dtype: torch.dtype, seed: int, eps: float = 1e-5) -> LlamaRMSNorm:
    g = torch.Generator().manual_seed(seed)
    norm = LlamaRMSNorm(hidden, eps=eps)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden, generator=g) * 0.5 + 1.0)
    return norm.to(dtype)


def random_rows(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Rows at scales from 1e-3 to 1e3 (each row its own), so the variance and the rounding vary widely."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    scale = 10.0 ** (torch.rand(*shape[:-1], 1, generator=g) * 6 - 3)
    return (x * scale).to(dtype)


def test_llama_rms_norm_has_the_reference_form():
    """The installed transformers' LlamaRMSNorm is the form the op reproduces (else nothing is fused)."""
    assert fused.is_llama_rms_norm(LlamaRMSNorm(8))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("threads", [1, 2])
def test_rms_norm_op_equals_hf_bit_for_bit(dtype, threads):
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for i, (rows, hidden) in enumerate([(1, 576), (3, 48), (16, 576), (17, 576), (64, 576), (100, 64),
                                            (600, 576), (2048, 576), (5, 16)]):  # fmt: skip
            for eps in (1e-5, 1e-6):
                norm = random_norm(hidden, dtype, seed=i)
                norm.variance_epsilon = eps
                x = random_rows((1, rows, hidden), dtype, seed=100 + i)
                with torch.inference_mode():
                    want = norm(x)
                    got = ops.rms_norm(x, norm.weight, eps)
                assert got.dtype == want.dtype and got.shape == want.shape
                assert torch.equal(got.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                                   want.view(torch.int16 if dtype == torch.bfloat16 else torch.int32)), (
                    f"rows={rows} hidden={hidden} eps={eps}: {(got.float() - want.float()).abs().max()}"
                )  # fmt: skip
    finally:
        torch.set_num_threads(saved)


def test_rms_norm_op_equals_hf_on_zeros_and_extremes():
    for dtype in DTYPES:
        norm = random_norm(64, dtype, seed=3)
        x = random_rows((4, 64), dtype, seed=4)
        x[0] = 0  # variance 0: rsqrt(eps)
        x[1, :5] = torch.finfo(dtype).max / 4
        x[2] = torch.finfo(dtype).tiny
        with torch.inference_mode():
            assert torch.equal(ops.rms_norm(x, norm.weight, norm.variance_epsilon), norm(x))


def test_rms_norm_op_refuses_what_it_does_not_compute():
    w = torch.ones(8)
    with pytest.raises(ValueError, match="both be float32 or both bfloat16"):
        ops.rms_norm(torch.ones(2, 8, dtype=torch.bfloat16), w, 1e-5)
    with pytest.raises(ValueError, match="contiguous"):
        ops.rms_norm(torch.ones(8, 2).t(), w, 1e-5)
    with pytest.raises(ValueError, match=r"\[\.\.\., H\]"):
        ops.rms_norm(torch.ones(2, 4), w, 1e-5)


FUSED_FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "phi3", "granite")


@pytest.mark.parametrize("name", ROUTED)
def test_every_familys_norms_fused_are_its_own_bit_for_bit(name):
    """Each family's norms that are fused give their own forward's bits (bf16 and fp32), and the
    Llama-form families are recognised (their norms are fused at all)."""
    for dtype in DTYPES:
        model = build_actor(name, dtype=dtype)
        mods = fused.FusedModules(model)
        if name in FUSED_FAMILIES:
            assert mods.norms, f"{name}: no norm recognised"
        for j, norm in enumerate(mods.norms):
            x = random_rows((1, 7, norm.weight.shape[0]), dtype, seed=j)
            with torch.inference_mode():
                want = norm(x)
                with mods.applied():
                    assert "forward" in norm.__dict__
                    got = norm(x)
            assert torch.equal(got, want), f"{name} {dtype} norm {j}"
            assert "forward" not in norm.__dict__


def test_other_norm_forms_are_not_fused():
    for name in ("gemma", "olmo2", "cohere", "gpt2"):
        if name in FAMILIES:
            assert not fused.FusedModules(build_actor(name)).norms, name


def test_fused_forward_falls_back_off_thread_and_under_autograd(monkeypatch):
    norm = random_norm(16, torch.float32, seed=0)
    mods = fused.FusedModules(norm)
    calls = []
    monkeypatch.setattr(ops, "rms_norm", lambda *a: calls.append(1) or torch.zeros(1))
    x = torch.randn(2, 16)
    with mods.applied():
        other = []
        t = threading.Thread(target=lambda: other.append(norm(x)))
        t.start()
        t.join()
        assert calls == [] and torch.equal(other[0], norm.__class__.forward(norm, x))
        y = norm(x.requires_grad_())  # autograd: the module's own forward, differentiable
        y.sum().backward()
        assert calls == [] and x.grad is not None
        with torch.inference_mode():
            norm(x.detach())
        assert calls == [1]


def rollouts(actor, batch, *, temperature: float) -> list[tuple[list[int], list[float]]]:
    engine = RolloutEngine(
        actor=actor,
        reward=lambda p, r: 0.0,
        config=EngineConfig(batch_size=4, mode="sequential", max_model_len=128, page_size=8),
        sampling=SamplingParams(temperature=temperature, max_new_tokens=12, seed=7, ignore_eos=True),
    )
    try:
        engine.add_prompts(batch)
        done = []
        while result := engine.step().rollouts:
            done += result
    finally:
        engine.close()
    by_prompt = {tuple(r.prompt_ids): (r.response_ids, r.logprobs) for r in done}
    return [by_prompt[tuple(p)] for p in batch]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_engine_tokens_and_logprobs_with_fusion_equal_without_to_the_bit(name, dtype, monkeypatch):
    """Mixed prefills and decodes (6 prompts of 2-16 tokens, batch 4), greedy and sampled: the engine's
    tokens and log-probs are the same floats with the fused norms as with HF's own."""
    batch = prompts((2, 5, 8, 11, 13, 16), seed=5)
    actor = build_actor(name, dtype=dtype)
    calls = []
    real = ops.rms_norm
    monkeypatch.setattr(ops, "rms_norm", lambda *a: calls.append(1) or real(*a))
    for temperature in (0.0, 0.8):
        with_fusion = rollouts(copy.deepcopy(actor), batch, temperature=temperature)
        assert calls, "the fused norm never ran"
        calls.clear()
        with monkeypatch.context() as m:
            m.setattr(fused, "is_llama_rms_norm", lambda module: False)
            without = rollouts(copy.deepcopy(actor), batch, temperature=temperature)
        assert not calls
        assert with_fusion == without
