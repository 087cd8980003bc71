"""Products of a few bf16 rows (``ops.small_linear``, csrc/linear_cpu.cpp): bit for bit oneDNN's packed
product wherever the engine uses it. oneDNN sums an output over runs of K inputs in float32 (``vdpbf16ps``
pairs in order) and adds the runs' sums; the op does the same, the run chosen per (rows, shape, batch hint,
threads) by a probe against oneDNN's product (``ops.small_linear_kblock``). The packs use it up to
``packed.SMALL_ROWS`` rows (8): the rollouts are those of oneDNN's products to the bit."""

from __future__ import annotations

import pytest
import torch
from engine_models import EOS, VOCAB, make_actor, random_prompts
from transformers import AutoModelForCausalLM, LlamaConfig

from oppo_engine import EngineConfig, RolloutEngine, SamplingParams, ops
from oppo_engine.model import packed

pytestmark = pytest.mark.skipif(not ops.SMALL_LINEAR_AVAILABLE, reason="needs a CPU with AVX-512 BF16")

# SmolLM2-135M's products (q|k|v, o, gate|up, down) and a wider one.
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (4096, 512)]


def _rows(rows: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    scale = 10.0 ** (torch.rand(rows, k, generator=g) * 2.6 - 1.3)
    return (torch.randn(rows, k, generator=g) * scale).bfloat16()


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("hint", [1, 16])
def test_small_linear_is_onednns_packed_product_to_the_bit(n, k, hint):
    w = (torch.randn(n, k, generator=torch.Generator().manual_seed(n + k)) * 0.05).bfloat16()
    p, b = ops.pack_linear_weight(w, hint), ops.block_linear_weight(w)
    for rows in (1, 2, 3, 4, 5, 7, 8, 11):
        run = ops.small_linear_kblock(rows, p, b, hint)
        assert run in (512, 1024)  # found for every shape here
        for seed in range(3):  # inputs the probe did not see
            x = _rows(rows, k, 1000 + seed)
            assert torch.equal(
                ops.small_linear(x, b, run).view(torch.int16), ops.packed_linear(x, p, None).view(torch.int16)
            )


def test_the_run_decides_the_bits_so_a_wrong_one_is_declined():
    """The probe has power: where the runs differ (K above 512), the other candidate's sums differ from
    oneDNN's in the last bit somewhere on the probe's kind of input, so it can never pass for oneDNN's."""
    for n, k in ((576, 576), (576, 1536)):
        w = (torch.randn(n, k, generator=torch.Generator().manual_seed(k)) * 0.05).bfloat16()
        p, b = ops.pack_linear_weight(w, 4), ops.block_linear_weight(w)
        run = ops.small_linear_kblock(4, p, b, 4)
        other = 1024 if run == 512 else 512
        x = _rows(256, k, 7)
        want = torch.cat([ops.packed_linear(x[i : i + 4], p, None) for i in range(0, 256, 4)])
        assert torch.equal(ops.small_linear(x, b, run), want)
        assert not torch.equal(ops.small_linear(x, b, other), want)


def test_bad_input_is_refused_by_name():
    w = torch.randn(32, 8).bfloat16()
    b = ops.block_linear_weight(w)
    with pytest.raises(ValueError, match="bfloat16"):
        ops.small_linear(torch.randn(2, 8), b, 512)
    with pytest.raises(ValueError, match="contiguous"):
        ops.small_linear(torch.randn(8, 2).bfloat16().t(), b, 512)
    with pytest.raises(ValueError, match="inputs"):
        ops.small_linear(torch.randn(2, 6).bfloat16(), b, 512)
    with pytest.raises(ValueError, match="even"):
        ops.small_linear(torch.randn(2, 8).bfloat16(), b, 3)
    with pytest.raises(ValueError, match="blocked"):
        ops.small_linear(torch.randn(2, 8).bfloat16(), w, 512)
    with pytest.raises(ValueError, match="N % 16"):
        ops.block_linear_weight(torch.randn(24, 8).bfloat16())
    assert not ops.small_linear_supported(torch.randn(32, 8))  # fp32: oneDNN's product
    assert not ops.small_linear_supported(torch.randn(24, 8).bfloat16())


def _llama() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=1536, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, eos_token_id=EOS, pad_token_id=0,
    )  # fmt: skip
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()


def _rollouts(actor, prompts, batch_size: int, temperature: float) -> list:
    engine = RolloutEngine(
        actor, lambda prompt, response: 0.0,
        config=EngineConfig(batch_size=batch_size, mode="sequential", max_model_len=64, packed_weights=True),
        sampling=SamplingParams(temperature=temperature, max_new_tokens=10, seed=5),
    )  # fmt: skip
    engine.add_prompts(prompts)
    out = []
    while result := engine.step().rollouts:
        out.extend(result)
    held = engine._loop.actor.runner.packed.nbytes
    engine.close()
    return sorted((tuple(r.prompt_ids), r.response_ids, r.logprobs) for r in out), held


@pytest.mark.parametrize("model", ["llama", "qwen2"])
def test_rollouts_with_small_products_are_onednns_to_the_bit(model, monkeypatch):
    """bf16 rollouts at 1-8 sequences a batch, greedy and sampled, with the small products on and off:
    the same tokens and log-probs, bit for bit. The op ran (a spy around the real op), on Llama's grouped
    q|k|v and gate|up and its lone products; Qwen2's q|k|v have biases and stay oneDNN's. The blocked copies
    are held with the packs and counted in ``nbytes``."""
    actor = _llama() if model == "llama" else make_actor().to(torch.bfloat16)
    prompts = random_prompts(5, seed=2)
    calls = []
    real = ops.small_linear
    monkeypatch.setattr(ops, "small_linear", lambda x, b, r: calls.append(tuple(b.shape)) or real(x, b, r))
    for batch_size in (1, 3, 8):
        for temperature in (0.0, 1.0):
            monkeypatch.setattr(packed, "SMALL_ROWS", 8)
            calls.clear()
            on, held_on = _rollouts(actor, prompts, batch_size, temperature)
            shapes = set(calls)
            monkeypatch.setattr(packed, "SMALL_ROWS", 0)
            calls.clear()
            off, held_off = _rollouts(actor, prompts, batch_size, temperature)
            assert not calls
            assert on == off
            assert held_on > held_off
            h, i = actor.config.hidden_size, actor.config.intermediate_size
            panels = {(n // 16, k // 2, 16, 2) for n, k in ((h, h), (2 * i, h), (h, i), (VOCAB, h))}
            assert panels <= shapes  # o, gate|up, down, the head
            qkv = (h + 2 * actor.config.num_key_value_heads * (h // actor.config.num_attention_heads)) // 16
            assert ((qkv, h // 2, 16, 2) in shapes) == (model == "llama")


def test_the_blocked_copies_follow_the_weights():
    """A weight written in place between two rollouts: the small products read the new weight (the blocked
    copy is made again with the pack), as oneDNN's do."""
    actor = _llama()
    prompts = random_prompts(3, seed=4)
    before, _ = _rollouts(actor, prompts, 2, 0.0)
    with torch.no_grad():
        actor.model.layers[0].mlp.down_proj.weight.mul_(-1.5)
        actor.lm_head.weight.add_(0.25)
    packed.SMALL_ROWS, saved = 0, packed.SMALL_ROWS
    try:
        off, _ = _rollouts(actor, prompts, 2, 0.0)
    finally:
        packed.SMALL_ROWS = saved
    on, _ = _rollouts(actor, prompts, 2, 0.0)
    assert on == off and on != before


def test_a_blocked_weight_at_any_offset_is_read_alike():
    """The op reads its weight panels with unaligned loads: a view at a 2-byte offset (not 64-byte aligned)
    gives the same bits as a fresh copy (an aligned-load build faults on it)."""
    w = torch.randn(64, 576, generator=torch.Generator().manual_seed(3)).bfloat16()
    b = ops.block_linear_weight(w)
    raw = torch.empty(b.numel() + 1, dtype=torch.bfloat16)
    shifted = raw[1:].view(b.shape)
    shifted.copy_(b)
    assert shifted.data_ptr() % 64 != 0
    x = _rows(3, 576, 9)
    assert torch.equal(ops.small_linear(x, shifted, 512), ops.small_linear(x, b, 512))
