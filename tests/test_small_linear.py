"""Products of a few bf16 rows (``ops.small_linear``, csrc/linear_cpu.cpp): bit for bit oneDNN's packed
product wherever the engine uses it. oneDNN sums an output over runs of K inputs in float32 (``vdpbf16ps``
pairs in order) and adds the runs' sums; the op does the same, the run chosen per (rows, shape, batch hint,
threads) by a probe against oneDNN's product (``ops.small_linear_kblock``). The packs use it up to
``packed.SMALL_ROWS`` rows (64), in passes of up to 16 rows a panel: the rollouts are those of oneDNN's
products to the bit."""

from __future__ import annotations

import os

import pytest
import torch
from engine_models import (
    EOS,
    SMALL_LINEAR_SKIP,
    VOCAB,
    make_actor,
    random_prompts,
    small_linear_reproduces_onednn,
)
from transformers import AutoModelForCausalLM, LlamaConfig

from oppo_engine import EngineConfig, RolloutEngine, SamplingParams, ops
from oppo_engine.model import fused, packed

pytestmark = pytest.mark.skipif(not ops.SMALL_LINEAR_AVAILABLE, reason="needs a CPU with AVX-512 BF16")
needs_small_linear = pytest.mark.skipif(not small_linear_reproduces_onednn(), reason=SMALL_LINEAR_SKIP)

# SmolLM2-135M's products (q|k|v, o, gate|up, down) and a wider one.
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (4096, 512)]


def _rows(rows: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    scale = 10.0 ** (torch.rand(rows, k, generator=g) * 2.6 - 1.3)
    return (torch.randn(rows, k, generator=g) * scale).bfloat16()


@needs_small_linear
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("hint", [1, 16])
def test_small_linear_is_onednns_packed_product_to_the_bit(n, k, hint):
    w = (torch.randn(n, k, generator=torch.Generator().manual_seed(n + k)) * 0.05).bfloat16()
    p, b = ops.pack_linear_weight(w, hint), ops.block_linear_weight(w)
    for rows in (1, 2, 3, 4, 5, 7, 8, 11, 16, 17, 24, 40, 64):  # one pass, two (9 + 8), ..., four
        run = ops.small_linear_kblock(rows, k, n, hint)
        assert run in (512, 1024) or (run == k and k <= 512)  # found for every shape here
        for seed in range(3):  # inputs the probe did not see
            x = _rows(rows, k, 1000 + seed)
            assert torch.equal(
                ops.small_linear(x, b, run).view(torch.int16), ops.packed_linear(x, p, None).view(torch.int16)
            )


@needs_small_linear
def test_the_run_decides_the_bits_so_a_wrong_one_is_declined():
    """The probe has power: where the runs differ (K above 512), the other candidate's sums differ from
    oneDNN's in the last bit somewhere on the probe's kind of input, so it can never pass for oneDNN's."""
    for n, k in ((576, 576), (576, 1536)):
        w = (torch.randn(n, k, generator=torch.Generator().manual_seed(k)) * 0.05).bfloat16()
        p, b = ops.pack_linear_weight(w, 4), ops.block_linear_weight(w)
        run = ops.small_linear_kblock(4, k, n, 4)
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
    """bf16 rollouts at 1-20 sequences a batch (one pass of the op and two), greedy and sampled, with the
    small products on and off: the same tokens and log-probs, bit for bit. The op ran (a spy around the real
    op), on Llama's grouped q|k|v and gate|up and its lone products; Qwen2's q|k|v have biases and stay
    oneDNN's. The blocked copies are held with the packs and counted in ``nbytes``. On a CPU where oneDNN
    multiplies bf16 with AMX tiles the op runs only where the probe found oneDNN's order (Qwen2's 48-wide
    products here, not Llama's 64-wide ones, on a Xeon, 2026-12-07), and the rollouts are still oneDNN's to
    the bit."""
    actor = _llama() if model == "llama" else make_actor().to(torch.bfloat16)
    prompts = random_prompts(20, seed=2)
    monkeypatch.setattr(fused, "DECODE_LAYERS", False)  # each product through ops' name, where the spy is
    calls = []
    real = ops.small_linear
    monkeypatch.setattr(ops, "small_linear", lambda x, b, r: calls.append(tuple(b.shape)) or real(x, b, r))
    for batch_size in (1, 3, 8, 20):
        for temperature in (0.0, 1.0):
            monkeypatch.setattr(packed, "SMALL_ROWS", 64)
            calls.clear()
            on, held_on = _rollouts(actor, prompts, batch_size, temperature)
            shapes = set(calls)
            monkeypatch.setattr(packed, "SMALL_ROWS", 0)
            calls.clear()
            off, held_off = _rollouts(actor, prompts, batch_size, temperature)
            assert not calls
            assert on == off
            if not small_linear_reproduces_onednn():  # AMX tiles: the op runs where the probe found a run
                continue
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


def test_the_verdict_is_probed_on_its_own_weight_so_a_zero_weight_first_poisons_nothing(monkeypatch):
    """The verdict is kept per shape; it is probed on a random weight of that shape, not on the weight of the
    first product that asks (an all-zero one, as some models initialise their output projections, passes any
    run: before, it fixed run 512 for every later 576 x 1536 weight at 2-4 rows, where oneDNN sums runs of
    1024, and 48-104 outputs in ~10^5 differed)."""
    monkeypatch.setattr(ops, "_small_verdicts", {})

    def linear(weight):
        model = torch.nn.Sequential(torch.nn.Linear(1536, 576, bias=False)).to(torch.bfloat16)
        with torch.no_grad():
            model[0].weight.copy_(weight)
        return model, packed.PackedLinears(model, 4)

    zero, zero_packs = linear(torch.zeros(576, 1536))
    real, real_packs = linear(torch.randn(576, 1536, generator=torch.Generator().manual_seed(11)) * 0.05)
    pack = ops.pack_linear_weight(real[0].weight, 4)
    with torch.inference_mode():
        for rows in (2, 3, 4):
            with zero_packs.applied():
                assert not zero(_rows(rows, 1536, rows).view(1, rows, 1536)).any()  # asks first
            with real_packs.applied():
                for seed in range(20):
                    x = _rows(rows, 1536, 100 + seed).view(1, rows, 1536)
                    assert torch.equal(real(x), ops.packed_linear(x, pack, None))


def test_a_write_past_the_version_counter_reaches_neither_copy_until_both_are_made_again():
    """The blocked copy is made with the pack, from the same tensor: a write that bypasses ``_version``
    (``param.data``, a fused optimizer step; ``update_policy`` drops the packs for those) leaves a 1-row
    product (``small_linear``) equal to the same row among 80 (oneDNN's), as before small products (before:
    the copy was made at the first small product, from the weight as it was then, and one row came out
    negated)."""
    torch.manual_seed(0)
    model, other = (
        torch.nn.Sequential(torch.nn.Linear(576, 960, bias=False)).to(torch.bfloat16) for _ in "ab"
    )
    rows = packed.SMALL_ROWS + 16
    packs = packed.PackedLinears(model, rows)
    x = _rows(rows, 576, 1).view(1, rows, 576)
    with torch.inference_mode(), packed.PackedLinears(other, rows).applied():
        other(x[:, :1])  # another module of the shape has had its small products (their verdict is known)
    with torch.inference_mode(), packs.applied():
        many = model(x)
    model[0].weight.data.mul_(-1)
    with torch.inference_mode(), packs.applied():
        one = model(x[:, :1])
    assert torch.equal(one, many[:, :1])
    packs.drop()  # update_policy's guarantee: both copies made again from the weight as it is
    with torch.inference_mode(), packs.applied():
        assert torch.equal(model(x[:, :1]), -many[:, :1])


@needs_small_linear
def test_a_product_too_narrow_to_probe_or_with_runs_too_alike_is_left_to_onednn():
    """The probe needs 2^19 outputs within 8192 draws, and one candidate left: a 16-column product of one row
    (8192 draws of 16 outputs: half) is declined, and so is K = 514, where a run of 512 and one run over all
    of K differ too rarely to tell (both matched everything)."""
    assert ops.small_linear_kblock(1, 64, 16, 1) is None
    assert ops.small_linear_kblock(4, 64, 16, 4) == 64  # 4 x 16 outputs a draw: enough
    assert ops.small_linear_kblock(1, 514, 576, 1) is None


def test_the_probe_runs_the_band_of_rows_asked_for(monkeypatch):
    """Verdicts are probed a band of row counts at a time (1-8, 9-16, 17-32, 33-64): a process whose
    batches never pass 8 rows pays for the first band only; rows past ``SMALL_LINEAR_ROWS`` run as asked."""
    monkeypatch.setattr(ops, "_small_verdicts", {})
    ops.small_linear_kblock(12, 576, 576, 16)
    assert sorted(key[0] for key in ops._small_verdicts) == list(range(9, 17))
    ops.small_linear_kblock(3, 576, 576, 16)
    assert sorted(key[0] for key in ops._small_verdicts) == list(range(1, 17))
    assert packed.SMALL_ROWS == ops.SMALL_LINEAR_ROWS == ops._SMALL_LINEAR_BANDS[-1][1]


def test_the_probe_finds_onednns_order_except_where_onednn_multiplies_with_amx_tiles():
    """The probe finds a run for a plain product on a CPU with AVX-512 BF16 and no AMX tiles (Zen 5: every
    shape here), and none at any band of rows where oneDNN multiplies bf16 with AMX tiles (a Xeon with
    AMX-BF16, 2026-12-07), where such products are left to oneDNN: so a skip of the op's tests names the
    CPU, never a probe that stopped finding runs. Not decided where oneDNN's instruction set is capped by
    its environment variable (the probe then finds runs on an AMX CPU too)."""
    if any(os.environ.get(name) for name in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")):
        pytest.skip("oneDNN's instruction set is capped by the environment")
    capabilities = getattr(torch.cpu, "get_capabilities", None)
    if capabilities is None or not hasattr(torch.cpu, "_init_amx"):
        pytest.skip("this torch cannot tell whether the CPU runs AMX tiles")
    # AMX-BF16 on the CPU, and the kernel's permission to use its tiles (what oneDNN asks for too)
    amx = bool(capabilities().get("amx_bf16", False)) and torch.cpu._init_amx()
    assert small_linear_reproduces_onednn() is (not amx)
    if amx:
        assert all(ops.small_linear_kblock(rows, 576, 576, 1) is None for rows in (1, 9, 17, 33))
