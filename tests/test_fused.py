"""The exact fused modules of ``oppo_engine/model/fused.py``: bit for bit HF's modules, in the op and in the
engine (tokens and log-probs with fusion equal those without, to the bit)."""

from __future__ import annotations

import contextlib
import copy
import functools
import threading
import warnings

import pytest
import torch
from engine_models import SMALL_LINEAR_SKIP, small_linear_reproduces_onednn
from families import FAMILIES, ROUTED, build_actor, prompts
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from oppo_engine import EngineConfig, RolloutEngine, SamplingParams, ops
from oppo_engine.model import fused, packed

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


def drained(actor, batch, *, batch_size: int, temperature: float, max_new_tokens: int, seed: int) -> list:
    """Every rollout of ``batch`` on a ``sequential`` engine over ``actor``, stepped until it drains."""
    engine = RolloutEngine(
        actor=actor,
        reward=lambda p, r: 0.0,
        config=EngineConfig(batch_size=batch_size, mode="sequential", max_model_len=128, page_size=8),
        sampling=SamplingParams(
            temperature=temperature, max_new_tokens=max_new_tokens, seed=seed, ignore_eos=True
        ),
    )
    try:
        engine.add_prompts(batch)
        done = []
        while result := engine.step().rollouts:
            done += result
    finally:
        engine.close()
    return done


def rollouts(actor, batch, *, temperature: float) -> list[tuple[list[int], list[float]]]:
    done = drained(actor, batch, batch_size=4, temperature=temperature, max_new_tokens=12, seed=7)
    by_prompt = {tuple(r.prompt_ids): (r.response_ids, r.logprobs) for r in done}
    return [by_prompt[tuple(p)] for p in batch]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_engine_tokens_and_logprobs_with_fusion_equal_without_to_the_bit(name, dtype, monkeypatch):
    """Mixed prefills and decodes (6 prompts of 2-16 tokens, batch 4), greedy and sampled: the engine's
    tokens and log-probs are the same floats with the fused norms, attention, MLPs (their grouped products
    included) and decoder layers as with HF's own modules."""
    batch = prompts((2, 5, 8, 11, 13, 16), seed=5)
    actor = build_actor(name, dtype=dtype)
    calls = {"rms_norm": 0, "rotary_and_cache": 0, "grouped": 0, "silu_mul": 0, "layer": 0}

    def counted(op, real):
        def call(*args):
            calls[op] += 1
            return real(*args)

        return call

    for op in ("rms_norm", "rotary_and_cache", "silu_mul"):
        monkeypatch.setattr(ops, op, counted(op, getattr(ops, op)))
    real_grouped = packed.PackedLinears.grouped

    def grouped(self, modules, x):
        out = real_grouped(self, modules, x)
        calls["grouped"] += out is not None
        return out

    monkeypatch.setattr(packed.PackedLinears, "grouped", grouped)
    real_plain = fused._plain_calls

    def plain(modules):  # asked only by the fused decoder layer, right before it takes its parts' forwards
        out = real_plain(modules)
        calls["layer"] += out
        return out

    monkeypatch.setattr(fused, "_plain_calls", plain)
    for temperature in (0.0, 0.8):
        # Each fused module's call through ops' names, where the spies are (a bf16 Llama layer of up to 64
        # rows otherwise runs as one op: ``ops.llama_decode_layer``, compared below and in its own tests).
        with monkeypatch.context() as m:
            m.setattr(fused, "DECODE_LAYERS", False)
            with_fusion = rollouts(copy.deepcopy(actor), batch, temperature=temperature)
        assert calls["rms_norm"], "the fused norm never ran"
        assert calls["rotary_and_cache"] or name != "llama", "the fused attention never ran"
        assert calls["grouped"], "no grouped product ran (the MLPs' gate and up, Llama's q, k and v)"
        # Their MLPs' 96 columns: every float32 product and the even-row bf16 ones take the fused SiLU (the
        # odd-row bf16 ones are torch's two ops: silu_mul_exact), so both paths run here.
        assert calls["silu_mul"] or not ops.SILU_MUL_AVAILABLE, "the fused SiLU and product never ran"
        assert calls["layer"], "the fused decoder layer never ran"
        calls.update(rms_norm=0, rotary_and_cache=0, grouped=0, silu_mul=0, layer=0)
        with monkeypatch.context() as m:
            m.setattr(fused, "is_llama_rms_norm", lambda module: False)
            m.setattr(fused, "is_llama_attention", lambda module: False)
            m.setattr(fused, "is_llama_mlp", lambda module: False)
            m.setattr(fused, "is_llama_decoder_layer", lambda module: False)
            m.setattr(fused, "DECODE_MODEL", False)  # the model's own call
            without = rollouts(copy.deepcopy(actor), batch, temperature=temperature)
        assert calls == {"rms_norm": 0, "rotary_and_cache": 0, "grouped": 0, "silu_mul": 0, "layer": 0}
        assert with_fusion == without
        # With the layer op, and with the model's statements run by decode_logits (its layers as one op)
        assert rollouts(copy.deepcopy(actor), batch, temperature=temperature) == without


# -- The MLP's SiLU and product in one op ---------------------------------------------------------------

needs_silu_mul = pytest.mark.skipif(
    not ops.SILU_MUL_AVAILABLE, reason="silu_mul needs torch's AVX-512 kernels"
)


def grouped_halves(rows: int, width: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The two halves of a [1, rows, 2 * width] product, as ``packed.grouped`` returns them (strided rows):
    values from 1e-3 to 1e3 in magnitude, with zeros, infinities, NaNs, subnormals and exp's overflow edge."""
    y = random_rows((1, rows, 2 * width), torch.float32, seed) * 8
    inf, nan = float("inf"), float("nan")
    special = torch.tensor([0.0, -0.0, inf, -inf, nan, 1e-40, -1e-40, 88.7, -88.7, -104.0])
    flat = y.view(-1)
    where = torch.randperm(flat.numel(), generator=torch.Generator().manual_seed(seed))[: special.numel()]
    flat[where] = special
    gate, up = y.to(dtype).split(width, dim=-1)
    return gate, up


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


@needs_silu_mul
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("threads", [1, 2])
def test_silu_mul_equals_torchs_silu_and_product_bit_for_bit(dtype, threads):
    """Wherever ``silu_mul_exact`` says so (rows of decodes and prefills, widths of real MLPs), the fused op
    on the grouped product's halves in place is bitwise ``F.silu(gate) * up`` on contiguous copies, NaNs
    included (compared as bits); and it says so for SmolLM2's 1536 columns at every row count."""
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        checked = 0
        for width in (16, 96, 704, 1536, 2816):
            for rows in (1, 2, 3, 8, 17, 22, 23, 47, 48, 64, 100, 257):
                if not ops.silu_mul_exact(rows, width, dtype):
                    continue
                gate, up = grouped_halves(rows, width, dtype, seed=rows * 7 + width)
                out = ops.silu_mul(gate, up)
                ref = torch.nn.functional.silu(gate.contiguous()) * up.contiguous()
                assert out.is_contiguous() and out.shape == ref.shape
                assert torch.equal(bits(out), bits(ref)), (width, rows)
                checked += 1
        assert checked >= 40
        assert all(ops.silu_mul_exact(rows, 1536, dtype) for rows in range(1, 300))
    finally:
        torch.set_num_threads(saved)


@needs_silu_mul
def test_silu_mul_exact_declines_where_torchs_loop_takes_its_scalar_tail():
    """Where torch's SiLU loop leaves a chunk's tail to its scalar ``std::exp`` (an odd row count over two
    threads' chunks of 704 columns, a width off the vector step), ``silu_mul_exact`` declines: there the
    fused op's lanes differ from torch in the last bit (found here in float32), so the check is what keeps
    it exact."""
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert not ops.silu_mul_exact(47, 704, torch.bfloat16)  # two chunks of 16,544 elements
        assert not ops.silu_mul_exact(3, 80, torch.bfloat16)  # 240 elements: not a multiple of 64
        assert not ops.silu_mul_exact(1, 8, torch.float32)  # not a multiple of the 16 lanes
        # float32 steps are 32 elements: rows x 48 columns over one chunk leave 16 to the scalar tail.
        assert not ops.silu_mul_exact(1, 48, torch.float32)
        differs = 0
        for seed in range(4):
            gate, up = grouped_halves(1, 48, torch.float32, seed)
            gate = gate * 0.25  # moderate arguments: where Sleef's and libm's exp disagree in the last bit
            ref = torch.nn.functional.silu(gate.contiguous()) * up.contiguous()
            differs += int((bits(ops.silu_mul(gate, up)) != bits(ref)).sum())
        assert differs > 0
    finally:
        torch.set_num_threads(saved)


@needs_silu_mul
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_mul_takes_2d_and_batched_views(dtype):
    """Row strides from any leading dims: a 2-D [rows, 2W] product's halves, and a [3, rows, 2W] one's."""
    for shape in ((40, 2 * 96), (3, 5, 2 * 160)):
        y = random_rows(shape, torch.float32, seed=len(shape)).to(dtype)
        gate, up = y.split(shape[-1] // 2, dim=-1)
        ref = torch.nn.functional.silu(gate.contiguous()) * up.contiguous()
        assert torch.equal(bits(ops.silu_mul(gate, up)), bits(ref)), shape


@needs_silu_mul
def test_silu_mul_splits_as_torch_so_each_thread_rounds_its_own_elements():
    """``torch.set_flush_denormal`` sets flush-to-zero on the calling thread only (the pool's threads keep
    subnormals): the op splits its elements over the threads as torch's loop does, so each element is
    computed under the same thread's settings (a split by rows gave -1.5e-39 where torch gives -0.0)."""
    if not torch.set_flush_denormal(True):
        pytest.skip("no flush-to-zero on this CPU")
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for rows in (16, 23):  # below torch's grain (all on the calling thread), and above it
            y = torch.empty(1, rows, 2 * 1536, dtype=torch.bfloat16)
            y[..., :1536], y[..., 1536:] = -80.0, 1e-6
            gate, up = y.split(1536, dim=-1)
            assert ops.silu_mul_exact(rows, 1536, torch.bfloat16)
            ref = torch.nn.functional.silu(gate.contiguous()) * up.contiguous()
            assert torch.equal(bits(ops.silu_mul(gate, up)), bits(ref)), rows
    finally:
        torch.set_flush_denormal(False)
        torch.set_num_threads(saved)


@needs_silu_mul
def test_silu_mul_exact_probes_the_op_against_torch_and_keeps_the_verdict(monkeypatch):
    """Past the rule, each (rows, width, dtype, threads) is probed once against torch's two ops: a shape
    whose scalar tail rounds otherwise (the rule would refuse it) fails the probe, and a verdict is kept."""
    assert not ops._silu_probe(1, 48, torch.float32)
    assert ops._silu_probe(4, 1536, torch.bfloat16)
    probes = []
    real = ops._silu_probe
    monkeypatch.setattr(ops, "_silu_probe", lambda *a: probes.append(a) or real(*a))
    monkeypatch.setattr(ops, "_silu_verdicts", {})
    assert ops.silu_mul_exact(6, 1536, torch.bfloat16, threads=2)
    assert ops.silu_mul_exact(6, 1536, torch.bfloat16, threads=2)
    assert probes == [(6, 1536, torch.bfloat16)]
    monkeypatch.setattr(ops, "_silu_probe", lambda *a: False)  # a torch whose kernels changed
    assert not ops.silu_mul_exact(7, 1536, torch.bfloat16, threads=2)


@needs_silu_mul
def test_silu_probes_draw_their_operands_once_per_dtype(monkeypatch):
    """Each new row count is probed, on views of one random pool per dtype drawn once (and grown twice over
    where a larger shape asks), not on operands drawn afresh (17-44 ms of a 37-58 ms probe of a prefill's
    rows); the probe keeps its power: a shape whose scalar tail rounds otherwise still fails it."""
    monkeypatch.setattr(ops, "_silu_pools", {})
    draws = []
    real = ops._mixed_scale
    monkeypatch.setattr(
        ops, "_mixed_scale", lambda rows, cols, gen, dtype: draws.append(cols) or real(rows, cols, gen, dtype)
    )
    for rows in (700, 650, 600, 20, 3):
        assert ops._silu_probe(rows, 1536, torch.bfloat16)
    assert draws == [700 * 2 * 1536]
    assert ops._silu_probe(701, 1536, torch.bfloat16)
    assert draws[1] == 2 * 700 * 2 * 1536  # grown twice over
    assert not ops._silu_probe(1, 48, torch.float32)
    monkeypatch.setattr(ops, "_SILU_POOL_MAX", 1000)
    assert ops._silu_probe(4, 1536, torch.float32)  # larger than the bound: drawn and not kept
    assert ops._silu_pools[torch.float32].numel() < 1000


@needs_silu_mul
def test_silu_mul_passes_opcheck():
    y = torch.randn(3, 2 * 64)
    gate, up = y.split(64, dim=-1)
    torch.library.opcheck(torch.ops.oppo.silu_mul.default, (gate.contiguous(), up.contiguous()))


def test_silu_mul_refuses_what_it_does_not_compute():
    x = torch.randn(2, 32)
    if not ops.SILU_MUL_AVAILABLE and not torch.ops.oppo.silu_mul_available():
        with pytest.raises(ValueError, match="AVX-512"):
            ops.silu_mul(x, x)
        return
    with pytest.raises(ValueError, match="one shape"):
        ops.silu_mul(x, torch.randn(2, 16))
    with pytest.raises(ValueError, match="float32 or both bfloat16"):
        ops.silu_mul(x, x.double())
    with pytest.raises(ValueError, match="multiple of 16"):
        ops.silu_mul(torch.randn(2, 24), torch.randn(2, 24))
    with pytest.raises(ValueError, match="contiguous"):
        ops.silu_mul(torch.randn(32, 2).t(), torch.randn(32, 2).t())
    with pytest.raises(ValueError, match="evenly spaced"):
        y = torch.randn(4, 3, 64)[:, :2]  # rows 0,1 of each block of 3: uneven spacing
        ops.silu_mul(y, y)


def test_only_silu_activations_are_fused():
    from transformers.activations import ACT2FN

    assert fused.is_silu(ACT2FN["silu"]) and fused.is_silu(torch.nn.SiLU())
    assert not fused.is_silu(torch.nn.SiLU(inplace=True))
    assert not fused.is_silu(ACT2FN["gelu"]) and not fused.is_silu(torch.nn.GELU())
    hooked = torch.nn.SiLU()
    hooked.register_forward_hook(lambda *a: None)
    assert not fused.is_silu(hooked)
    own = torch.nn.SiLU()
    own.forward = lambda x: x
    assert not fused.is_silu(own)


def test_a_silu_replaced_after_the_check_is_not_fused(monkeypatch):
    """Whatever the activation would compute instead is what HF's MLP computes: a replaced class forward
    (before or after the first check, whose verdict is not reused) or a replaced ``F.silu`` disqualifies."""
    from transformers.activations import SiLUActivation

    act = SiLUActivation()
    assert fused.is_silu(act) and fused.is_silu(torch.nn.SiLU())
    with monkeypatch.context() as m:
        m.setattr(SiLUActivation, "forward", lambda self, x: torch.nn.functional.gelu(x))
        assert not fused.is_silu(act)
    with monkeypatch.context() as m:
        m.setattr(torch.nn.SiLU, "forward", lambda self, x: x)
        assert not fused.is_silu(torch.nn.SiLU())
    with monkeypatch.context() as m:
        m.setattr(torch.nn.functional, "silu", lambda x, inplace=False: x)
        assert not fused.is_silu(act) and not fused.is_silu(torch.nn.SiLU())
    assert fused.is_silu(act)


# -- Llama's attention: the rotary embedding and the cache write in one op ------------------------------


def hf_rotary(q, k, cos, sin):
    """HF's own ``apply_rotary_pos_emb`` on ``[T, H, D]`` tensors laid out as the attention lays them out."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    q4, k4 = q.unsqueeze(0).transpose(1, 2), k.unsqueeze(0).transpose(1, 2)
    q_embed, k_embed = apply_rotary_pos_emb(q4, k4, cos.unsqueeze(0), sin.unsqueeze(0))
    return q_embed[0].transpose(0, 1), k_embed[0].transpose(0, 1)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [64, 12, 80])
def test_rotary_and_cache_equals_hf_rotary_and_cache_write_bit_for_bit(dtype, head_dim):
    """Every position from 0 to 4095 (HF's own cos/sin, from the model's rotary module), GQA heads; the
    cache receives HF's rotated K and the V unchanged, at the slots given, and nothing else changes."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    cfg = LlamaConfig(
        hidden_size=4 * head_dim, num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim
    )
    rotary = LlamaRotaryEmbedding(cfg)
    g = torch.Generator().manual_seed(head_dim)
    tokens = 4096
    positions = torch.arange(tokens)[None]
    x = torch.empty(1, tokens, 1, dtype=dtype)
    with torch.inference_mode():
        cos, sin = (t[0] for t in rotary(x, positions))
    q = (torch.randn(tokens, 4, head_dim, generator=g) * 3).to(dtype)
    k = (torch.randn(tokens, 2, head_dim, generator=g) * 3).to(dtype)
    v = torch.randn(tokens, 2, head_dim, generator=g).to(dtype)
    page_size, layers = 16, 2
    cache = torch.randn(tokens // page_size + 1, layers, 2, page_size, 2, head_dim, generator=g).to(dtype)
    slots = torch.randperm(cache.shape[0] * page_size, generator=g)[:tokens]
    slots[::7] = -1  # skipped tokens
    want_q, want_k = hf_rotary(q, k, cos, sin)
    want_cache, initial = cache.clone(), cache.clone()
    ops.reshape_and_cache(want_k, v, want_cache, slots, 1)
    got_q = ops.rotary_and_cache(q, k, v, cos, sin, cache, slots, 1)
    assert torch.equal(got_q, want_q)
    assert torch.equal(cache, want_cache)
    # The same q, k and v as views of one grouped [T, (4 + 2 + 2) * D] product (rows strided, as the fused
    # attention passes them): the same bits, read in place; the rotated q comes back contiguous.
    qkv = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1)
    widths = [4 * head_dim, 2 * head_dim, 2 * head_dim]
    views = [t.view(tokens, -1, head_dim) for t in qkv.split(widths, dim=1)]
    assert not views[0].is_contiguous()
    got_q = ops.rotary_and_cache(*views, cos, sin, initial, slots, 1)
    assert got_q.is_contiguous() and torch.equal(got_q, want_q)
    assert torch.equal(initial, want_cache)


def test_rotary_and_cache_refuses_what_it_does_not_compute():
    q, k = torch.randn(3, 4, 8), torch.randn(3, 2, 8)
    cos = sin = torch.randn(3, 8)
    cache = torch.zeros(2, 1, 2, 4, 2, 8)
    slots = torch.arange(3)
    with pytest.raises(ValueError, match="cos and sin must be contiguous"):
        ops.rotary_and_cache(q, k, k, cos[:2], sin[:2], cache, slots, 0)
    with pytest.raises(ValueError, match="all be float32 or all bfloat16"):
        ops.rotary_and_cache(q, k, k, cos.bfloat16(), sin.bfloat16(), cache, slots, 0)
    with pytest.raises(ValueError, match="head_dim must be even"):
        ops.rotary_and_cache(q[..., :7].contiguous(), k[..., :7].contiguous(), k, cos[:, :7].contiguous(),
                             sin[:, :7].contiguous(), cache, slots, 0)  # fmt: skip
    with pytest.raises(ValueError, match="layer"):
        ops.rotary_and_cache(q, k, k, cos, sin, cache, slots, 5)
    with pytest.raises(ValueError, match="last dim is contiguous"):
        ops.rotary_and_cache(q.transpose(1, 2).contiguous().transpose(1, 2), k, k, cos, sin, cache, slots, 0)


def test_only_llamas_own_attention_is_fused():
    assert fused.FusedModules(build_actor("llama")).attentions
    for name in ("qwen2", "mistral", "qwen3", "gemma", "phi3", "granite", "olmo2"):
        if name in FAMILIES:
            assert not fused.FusedModules(build_actor(name)).attentions, name


def test_a_modules_own_instance_forward_is_kept_and_runs():
    """A module that already has a forward on the instance (a wrapper's, accelerate's hooks) keeps it
    inside ``applied()`` and after: the fused forward is not installed over it."""
    model = build_actor("llama", dtype=torch.float32)
    mlp = model.model.layers[0].mlp
    calls = []

    def own(x):
        calls.append(1)
        return type(mlp).forward(mlp, x)

    mlp.forward = own
    mods = fused.FusedModules(model)
    assert mlp in mods.mlps
    with mods.applied():
        assert mlp.__dict__["forward"] is own
        mlp(torch.randn(1, 3, model.config.hidden_size))
    assert calls == [1] and mlp.__dict__["forward"] is own


# -- The decoder layer ------------------------------------------------------------------------------------


def test_decoder_layers_of_the_llama_form_are_fused():
    """Every layer of a family whose decoder layer reads as Llama's (whatever its parts: Gemma's norms are
    not fused, and its layer still is); none of a family whose layer reads otherwise."""
    for name in ("llama", "qwen2", "gemma"):
        if name in FAMILIES:
            model = build_actor(name)
            assert len(fused.FusedModules(model).layers) == model.config.num_hidden_layers, name
    for name in ("gemma2", "phi3", "olmo2", "granite", "mixtral"):
        if name in FAMILIES:
            assert not fused.FusedModules(build_actor(name)).layers, name


@pytest.mark.parametrize(
    "hook",
    ["forward", "forward_pre", "global_forward", "global_forward_pre", "compiled", "call_impl", "class_call"],
)
def test_a_layer_whose_part_is_hooked_runs_the_hook_as_hf_does(hook, monkeypatch):
    """The fused layer enters its parts through their forwards only where torch's module call would do
    nothing else: a forward hook that doubles the post-attention norm's output, a pre-hook that halves its
    input, a global forward hook, a compiled call (a stand-in here) on one layer's part: the rollouts equal
    those with every fusion off (the hook ran as many times), and differ from the unhooked model's."""
    batch = prompts((3, 6, 9), seed=2)
    base = build_actor("llama", dtype=torch.float32)
    plain = rollouts(copy.deepcopy(base), batch, temperature=0.0)
    runs = []

    def hooked_rollouts():
        model = copy.deepcopy(base)
        part = model.model.layers[1].post_attention_layernorm
        handle = None
        if hook == "forward":
            part.register_forward_hook(lambda m, args, out: runs.append(1) or out * 2)
        elif hook == "forward_pre":
            part.register_forward_pre_hook(lambda m, args: runs.append(1) or (args[0] * 0.5,))
        elif hook == "global_forward":
            target = part

            def doubled(m, args, out):
                if m is target:
                    runs.append(1)
                    return out * 2
                return None

            handle = torch.nn.modules.module.register_module_forward_hook(doubled)
        elif hook == "global_forward_pre":
            target = part

            def halved(m, args):
                if m is target:
                    runs.append(1)
                    return (args[0] * 0.5,)
                return None

            handle = torch.nn.modules.module.register_module_forward_pre_hook(halved)
        elif hook == "call_impl":  # a _call_impl set on the instance: torch's __call__ looks it up there

            def call_impl(*args, **kwargs):
                runs.append(1)
                return type(part).forward(part, *args, **kwargs) * 2

            part._call_impl = call_impl
        elif hook == "class_call":  # a subclass whose __call__ does more than call forward

            class Doubling(type(part)):
                def __call__(self, *args, **kwargs):
                    runs.append(1)
                    return super().__call__(*args, **kwargs) * 2

            part.__class__ = Doubling
        else:  # a module whose call torch.compile replaced: its compiled call runs, not its forward

            def compiled(*args, **kwargs):
                runs.append(1)
                return type(part).forward(part, *args, **kwargs) * 2

            part._compiled_call_impl = compiled
        try:
            return rollouts(model, batch, temperature=0.0)
        finally:
            if handle is not None:
                handle.remove()

    with_fusion = hooked_rollouts()
    fused_runs, runs[:] = len(runs), []
    with monkeypatch.context() as m:
        for name in ("is_llama_rms_norm", "is_llama_attention", "is_llama_mlp", "is_llama_decoder_layer"):
            m.setattr(fused, name, lambda module: False)
        without = hooked_rollouts()
    assert fused_runs and fused_runs == len(runs)
    assert with_fusion == without
    assert with_fusion != plain


def test_a_layer_class_with_another_forward_is_not_fused(monkeypatch):
    """A decoder layer class whose forward was replaced (a monkeypatch, a subclass) is read again: not
    fused."""
    model = build_actor("llama")
    layer_cls = type(model.model.layers[0])

    def forward(self, hidden_states, **kwargs):
        return hidden_states

    monkeypatch.setattr(layer_cls, "forward", forward)
    assert not fused.FusedModules(model).layers


def test_a_layer_called_with_past_key_values_gets_hfs_renaming(monkeypatch):
    """A caller passing the deprecated ``past_key_values`` keyword (another thread's code, a trainer) while
    the fused forward is installed: HF's wrappers rename it to ``cache`` as they do without fusion (before:
    the fallback passed ``cache=None`` beside it, HF kept the ``None`` and the cache stayed empty)."""
    from transformers import DynamicCache

    model = build_actor("llama", dtype=torch.float32)
    layer = model.model.layers[0]
    x = random_rows((1, 3, model.config.hidden_size), torch.float32, 4)
    ids = torch.arange(3).view(1, 3)
    position_embeddings = model.model.rotary_emb(x, position_ids=ids)

    def cached_tokens(fusion: bool) -> tuple[int, torch.Tensor]:
        cache = DynamicCache(config=model.config)
        mods = fused.FusedModules(model)
        with torch.no_grad(), mods.applied() if fusion else contextlib.nullcontext():
            assert (layer.__dict__.get("forward") is not None) == fusion
            out = layer(
                x,
                position_embeddings=position_embeddings,
                position_ids=ids,
                past_key_values=cache,
                use_cache=True,
            )
        return cache.get_seq_length(0), out

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        fused_len, fused_out = cached_tokens(True)
        hf_len, hf_out = cached_tokens(False)
    assert hf_len == 3 and fused_len == 3
    assert torch.equal(fused_out, hf_out)


# -- A decoder layer of a few bf16 rows as one op -------------------------------------------------------

needs_layer_op = pytest.mark.skipif(
    not (small_linear_reproduces_onednn() and ops.SILU_MUL_AVAILABLE),
    reason="the layer op runs small_linear and silu_mul (torch's AVX-512 kernels); " + SMALL_LINEAR_SKIP,
)


def _small_llama(bias: bool = False) -> torch.nn.Module:
    """A bf16 Llama whose every product qualifies for small_linear (widths multiples of 16, no bias) and
    whose MLP width takes silu_mul at any row count; ``bias``: its attention's projections have biases."""
    from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: PLC0415

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=160, hidden_size=64, intermediate_size=1536, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, attention_bias=bias,
    )  # fmt: skip
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()


def _blocked(*mods) -> tuple[torch.Tensor, int]:
    """The modules' stacked weight blocked for ``small_linear``, and a run (all of K up to 512)."""
    w = torch.cat([m.weight.detach() for m in mods])
    return ops.block_linear_weight(w), 512 if w.shape[1] > 512 else w.shape[1]


def _layer_op_inputs(layers: int, tokens: int, *, head_dim: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Hidden states ``[1, tokens, 64]``, an empty cache of 4 pages of 8 for ``layers`` layers and 2 KV heads,
    and rotary tables, all bf16 (the layer op's inputs besides the layers' own)."""
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(1, tokens, 64, generator=g) * 0.5).to(torch.bfloat16)
    kv_cache = torch.zeros(4, layers, 2, 8, 2, head_dim, dtype=torch.bfloat16)
    cos = torch.randn(tokens, head_dim, generator=g).to(torch.bfloat16)
    sin = torch.randn(tokens, head_dim, generator=g).to(torch.bfloat16)
    return hidden, kv_cache, cos, sin


def _layer_rollouts(actor, batch, *, batch_size: int, temperature: float, layers: bool, monkeypatch) -> list:
    monkeypatch.setattr(fused, "DECODE_LAYERS", layers)
    done = drained(actor, batch, batch_size=batch_size, temperature=temperature, max_new_tokens=10, seed=3)
    return sorted((tuple(r.prompt_ids), tuple(r.response_ids), tuple(r.logprobs)) for r in done)


def _spy_layer_op(monkeypatch, model_calls: list[int] | None = None) -> list[int]:
    """The row count of every layer run as one op: by ``ops.llama_decode_layer``, or as one of the layers of
    an ``ops.llama_decode_layers`` (whose calls' layer counts go to ``model_calls``)."""
    calls = []
    real, real_layers = ops.llama_decode_layer, ops.llama_decode_layers

    def spy(hidden, *args):
        calls.append(hidden.shape[1])
        return real(hidden, *args)

    def spy_layers(hidden, layers, *args):
        calls.extend([hidden.shape[1]] * len(layers))
        if model_calls is not None:
            model_calls.append(len(layers))
        return real_layers(hidden, layers, *args)

    monkeypatch.setattr(ops, "llama_decode_layer", spy)
    monkeypatch.setattr(ops, "llama_decode_layers", spy_layers)
    return calls


@needs_layer_op
@pytest.mark.parametrize("batch_size", [1, 3, 8, 20])
def test_a_decoder_layer_of_a_few_bf16_rows_as_one_op_is_its_calls_bit_for_bit(batch_size, monkeypatch):
    """bf16 rollouts (20 prompts of 2-16 tokens, greedy and sampled) with each decoder layer of up to 64 rows
    as ``ops.llama_decode_layer`` and with its calls one by one: the same tokens and log-probs, to the bit.
    The op ran, on every layer of the decode forwards and of the prefills of up to 64 tokens, and on no
    forward of more rows (oneDNN's products there)."""
    actor = _small_llama()
    batch = prompts(tuple(2 + (7 * i) % 15 for i in range(20)), seed=4)
    calls = _spy_layer_op(monkeypatch)
    for temperature in (0.0, 0.9):
        calls.clear()
        on = _layer_rollouts(actor, batch, batch_size=batch_size, temperature=temperature, layers=True,
                             monkeypatch=monkeypatch)  # fmt: skip
        assert calls and max(calls) <= packed.SMALL_ROWS
        assert len(calls) % actor.config.num_hidden_layers == 0
        assert min(calls) == 1 if batch_size == 1 else True
        calls.clear()
        off = _layer_rollouts(actor, batch, batch_size=batch_size, temperature=temperature, layers=False,
                              monkeypatch=monkeypatch)  # fmt: skip
        assert not calls
        assert on == off


@needs_layer_op
@pytest.mark.parametrize("where", ["o_proj", "q_proj", "down_proj", "act_fn"])
def test_a_layer_with_a_hooked_product_runs_its_calls_and_the_hook(where, monkeypatch):
    """A forward hook (doubling the output) on one layer's output projection, one of its grouped q|k|v
    members, its down projection or its activation: that layer runs its calls one by one, so the hook runs
    as often as with the layer op off and the rollouts are the same; the other layers still run the op."""
    batch = prompts((3, 6, 9), seed=2)
    base = _small_llama()
    plain = _layer_rollouts(copy.deepcopy(base), batch, batch_size=3, temperature=0.0, layers=True,
                            monkeypatch=monkeypatch)  # fmt: skip
    runs = []

    def hooked(layers: bool) -> list:
        model = copy.deepcopy(base)
        layer = model.model.layers[1]
        part = layer.mlp if where in ("down_proj", "act_fn") else layer.self_attn
        getattr(part, where).register_forward_hook(lambda m, args, out: runs.append(1) or out * 2)
        return _layer_rollouts(
            model, batch, batch_size=3, temperature=0.0, layers=layers, monkeypatch=monkeypatch
        )

    calls = _spy_layer_op(monkeypatch)
    on = hooked(True)
    runs_on, runs[:] = len(runs), []
    assert calls and all(rows <= packed.SMALL_ROWS for rows in calls)
    assert len(calls) % (base.config.num_hidden_layers - 1) == 0  # every forward: the two unhooked layers
    off = hooked(False)
    assert runs_on and runs_on == len(runs)
    assert on == off
    assert on != plain


@needs_layer_op
def test_a_layer_whose_projections_have_biases_runs_its_calls(monkeypatch):
    """q|k|v with biases take oneDNN's product (small_linear has no bias), so no layer runs as one op."""
    calls = _spy_layer_op(monkeypatch)
    out = _layer_rollouts(_small_llama(bias=True), prompts((3, 5), seed=1), batch_size=2, temperature=0.0,
                          layers=True, monkeypatch=monkeypatch)  # fmt: skip
    assert out and not calls


@needs_layer_op
def test_the_layer_op_passes_opcheck():
    """The op's schema (its in-place cache write declared) and fake kernel, on one layer's operands."""
    actor = _small_llama()
    layer = actor.model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    tokens = 3
    hidden, kv_cache, cos, sin = _layer_op_inputs(actor.config.num_hidden_layers, tokens, head_dim=16)

    args = (
        hidden, layer.input_layernorm.weight.detach(), 1e-6, *_blocked(attn.q_proj, attn.k_proj, attn.v_proj),
        [64, 32, 32], 16, cos, sin, kv_cache, torch.arange(tokens, dtype=torch.int64), 0,
        torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([tokens], dtype=torch.int32),
        torch.tensor([0, tokens], dtype=torch.int32), 0.25, *_blocked(attn.o_proj),
        layer.post_attention_layernorm.weight.detach(), 1e-6, *_blocked(mlp.gate_proj, mlp.up_proj),
        [1536, 1536], *_blocked(mlp.down_proj),
    )  # fmt: skip
    torch.library.opcheck(torch.ops.oppo.llama_decode_layer.default, args)


@needs_layer_op
@pytest.mark.parametrize(
    "change", ["o_bias", "down_bias", "o_replaced", "o_instance_forward", "gelu", "grouping_off", "autocast"]
)
def test_a_layer_the_op_cannot_run_exactly_runs_its_calls(change, monkeypatch):
    """One layer changed so that some call of its body is not one of the op's (a bias on its output or down
    projection, its output projection wrapped by another module or by an instance ``forward``, a GELU in
    place of SiLU), or every layer so (grouping off: the members' own products; under autocast: HF's
    modules): that layer runs its calls one by one, the other layers still run the op, and the rollouts
    equal those with the layer op off, where they differ from the unchanged model's."""
    batch = prompts((3, 6, 9), seed=2)
    base = _small_llama()
    plain = _layer_rollouts(copy.deepcopy(base), batch, batch_size=3, temperature=0.0, layers=True,
                            monkeypatch=monkeypatch)  # fmt: skip

    class Doubled(torch.nn.Module):  # an adapter-like wrapper: its own module around the projection
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner(x) * 2

    def changed(layers: bool) -> list:
        model = copy.deepcopy(base)
        layer = model.model.layers[1]
        attn, mlp = layer.self_attn, layer.mlp
        if change in ("o_bias", "down_bias"):
            proj = attn.o_proj if change == "o_bias" else mlp.down_proj
            bias = torch.randn(proj.out_features, generator=torch.Generator().manual_seed(1)) * 0.5
            proj.bias = torch.nn.Parameter(bias.to(torch.bfloat16))
        elif change == "o_replaced":
            attn.o_proj = Doubled(attn.o_proj)
        elif change == "o_instance_forward":
            inner = attn.o_proj.forward
            attn.o_proj.forward = lambda x: inner(x) * 2
        elif change == "gelu":
            mlp.act_fn = torch.nn.GELU()
        elif change == "grouping_off":
            packed.for_model(model, 3).grouping = False
        autocast = torch.autocast("cpu", dtype=torch.bfloat16) if change == "autocast" else None
        with autocast or contextlib.nullcontext():
            return _layer_rollouts(
                model, batch, batch_size=3, temperature=0.0, layers=layers, monkeypatch=monkeypatch
            )

    calls = _spy_layer_op(monkeypatch)
    on = changed(True)
    if change in ("grouping_off", "autocast"):
        assert not calls
    else:
        layers = base.config.num_hidden_layers
        assert calls and len(calls) % (layers - 1) == 0 and len(calls) // (layers - 1) >= 10  # 2 a forward
    calls.clear()
    off = changed(False)
    assert not calls
    assert on == off
    assert on != plain or change in ("grouping_off", "autocast")


@needs_layer_op
def test_a_layer_runs_as_one_op_only_at_row_counts_where_silu_mul_is_exact(monkeypatch):
    """An MLP 96 wide: SiLU-and-product is bit for bit torch's only where the rows' elements split into
    whole vector steps (``ops.silu_mul_exact``: 2 rows of 96, not 1 or 3), so at 3 sequences a decode
    forward runs its calls one by one and the 2-row ones run the op; the rollouts equal the calls'."""
    from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: PLC0415

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256,
    )  # fmt: skip
    actor = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    assert not ops.silu_mul_exact(3, 96, torch.bfloat16) and ops.silu_mul_exact(2, 96, torch.bfloat16)
    calls = _spy_layer_op(monkeypatch)
    batch = prompts((2, 4, 6, 8, 10), seed=3)
    on = _layer_rollouts(actor, batch, batch_size=3, temperature=0.0, layers=True, monkeypatch=monkeypatch)
    assert calls and all(ops.silu_mul_exact(rows, 96, torch.bfloat16) for rows in calls)
    assert 3 not in calls
    off = _layer_rollouts(actor, batch, batch_size=3, temperature=0.0, layers=False, monkeypatch=monkeypatch)
    assert on == off


# -- A Llama causal LM's decode forward with its layers as one op (decode_logits) --------------------------


def test_llamas_model_forwards_have_the_reference_form():
    """transformers' LlamaModel and LlamaForCausalLM forwards read as the statements ``decode_logits`` runs
    (a change upstream turns it off rather than making it wrong); Qwen3's base model, whose forward differs,
    does not qualify."""
    from transformers.models.llama import modeling_llama  # noqa: PLC0415
    from transformers.models.qwen3 import modeling_qwen3  # noqa: PLC0415

    model, head = fused._MODEL_WRAPPERS, fused._CAUSAL_LM_WRAPPERS
    assert fused._reads_as_normalised(
        "llama_model", modeling_llama.LlamaModel, fused.LLAMA_MODEL_FORWARD, model
    )
    assert fused._reads_as_normalised(
        "causal_lm", modeling_llama.LlamaForCausalLM, fused.LLAMA_CAUSAL_LM_FORWARD, head
    )
    assert not fused._reads_as_normalised(
        "llama_model", modeling_qwen3.Qwen3Model, fused.LLAMA_MODEL_FORWARD, model
    )

    class Other(modeling_llama.LlamaModel):
        def forward(self, input_ids=None, **kwargs):
            return super().forward(input_ids=input_ids, **kwargs)

    class Inherited(modeling_llama.LlamaForCausalLM):
        pass

    class Wrapped(modeling_llama.LlamaForCausalLM):  # the same source read through a wrapper of its own
        pass

    inner = modeling_llama.LlamaForCausalLM.forward

    @functools.wraps(inner)
    def doubled(self, *args, **kwargs):
        out = inner(self, *args, **kwargs)
        out.logits = out.logits * 2
        return out

    Wrapped.forward = doubled
    assert not fused._reads_as_normalised("llama_model", Other, fused.LLAMA_MODEL_FORWARD, model)
    assert fused._reads_as_normalised("causal_lm", Inherited, fused.LLAMA_CAUSAL_LM_FORWARD, head)
    assert fused._normalised_source(Wrapped.forward) == fused.LLAMA_CAUSAL_LM_FORWARD
    assert not fused._reads_as_normalised("causal_lm", Wrapped, fused.LLAMA_CAUSAL_LM_FORWARD, head)


def _model_rollouts(actor, batch, *, batch_size: int, temperature: float, model: bool, monkeypatch) -> list:
    monkeypatch.setattr(fused, "DECODE_MODEL", model)
    return _layer_rollouts(actor, batch, batch_size=batch_size, temperature=temperature, layers=True,
                           monkeypatch=monkeypatch)  # fmt: skip


@needs_layer_op
@pytest.mark.parametrize("batch_size", [1, 8])
def test_a_llama_decode_forward_with_its_layers_as_one_op_is_the_models_call_bit_for_bit(
    batch_size, monkeypatch
):
    """bf16 rollouts (12 prompts of 2-16 tokens, greedy and sampled) through ``decode_logits`` (every layer of
    a decode forward in one ``ops.llama_decode_layers``) and through the model's own call (each layer its own
    op): the same tokens and log-probs, to the bit. Every decode forward ran its three layers as one op. Each
    norm has its own weights and eps, so operands passed to the wrong layer or part would show."""
    actor = _small_llama()
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for n, layer in enumerate(actor.model.layers):
            for k, norm in enumerate((layer.input_layernorm, layer.post_attention_layernorm)):
                norm.weight.copy_(torch.rand(norm.weight.shape, generator=g) + 0.5)
                norm.variance_epsilon = 1e-6 * (1 + n + 3 * k)
    batch = prompts(tuple(2 + (5 * i) % 15 for i in range(12)), seed=6)
    model_calls: list[int] = []
    calls = _spy_layer_op(monkeypatch, model_calls)
    for temperature in (0.0, 0.9):
        model_calls.clear()
        on = _model_rollouts(actor, batch, batch_size=batch_size, temperature=temperature, model=True,
                             monkeypatch=monkeypatch)  # fmt: skip
        assert len(model_calls) >= 9 and set(model_calls) == {actor.config.num_hidden_layers}
        calls.clear()
        made = len(model_calls)
        off = _model_rollouts(actor, batch, batch_size=batch_size, temperature=temperature, model=False,
                              monkeypatch=monkeypatch)  # fmt: skip
        assert len(model_calls) == made and calls  # no more model calls: each layer its own op
        assert on == off


@needs_layer_op
@pytest.mark.parametrize("where", ["model", "base", "layer", "lm_head", "norm", "embed_tokens"])
def test_a_hooked_llama_runs_its_hooks_as_the_models_call_does(where, monkeypatch):
    """A forward hook (adding to the output) on the causal LM, its base model, one decoder layer, the LM
    head, the final norm or the embedding: the hook runs as often as through the model's own call, and the
    rollouts are the same. A hook on either model turns ``decode_logits`` off (the model's call runs it); on a
    layer, the layers run HF's loop (the others each as their own op); on the head, the norm or the
    embedding, their module calls run it and the layers still run as one op."""
    batch = prompts((3, 6, 9), seed=2)
    base = _small_llama()
    plain = _model_rollouts(copy.deepcopy(base), batch, batch_size=3, temperature=0.0, model=True,
                            monkeypatch=monkeypatch)  # fmt: skip
    runs = []

    def bumped(m, args, out):
        runs.append(1)
        if isinstance(out, torch.Tensor):
            return out + 1
        out.logits = out.logits + 1  # the causal LM's output
        return out

    def hooked(model_path: bool) -> list:
        model = copy.deepcopy(base)
        target = {
            "model": model, "base": model.model, "layer": model.model.layers[1], "lm_head": model.lm_head,
            "norm": model.model.norm, "embed_tokens": model.model.embed_tokens,
        }[where]  # fmt: skip
        target.register_forward_hook(bumped)
        return _model_rollouts(model, batch, batch_size=3, temperature=0.0, model=model_path,
                               monkeypatch=monkeypatch)  # fmt: skip

    model_calls: list[int] = []
    _spy_layer_op(monkeypatch, model_calls)
    on = hooked(True)
    runs_on, runs[:] = len(runs), []
    if where in ("lm_head", "norm", "embed_tokens"):
        assert model_calls, "decode_logits did not run its layers as one op"
    else:
        assert not model_calls
    made = len(model_calls)
    off = hooked(False)
    assert len(model_calls) == made
    assert runs_on and runs_on == len(runs)
    assert on == off
    assert on != plain


@needs_layer_op
def test_a_config_asking_for_hidden_states_turns_the_model_path_off(monkeypatch):
    """``output_hidden_states`` in the config: the model's own call runs (its wrappers capture them), and the
    rollouts are the same."""
    actor = _small_llama()
    actor.config.output_hidden_states = True
    model_calls: list[int] = []
    _spy_layer_op(monkeypatch, model_calls)
    batch = prompts((3, 6), seed=1)
    on = _model_rollouts(actor, batch, batch_size=2, temperature=0.0, model=True, monkeypatch=monkeypatch)
    assert not model_calls
    off = _model_rollouts(actor, batch, batch_size=2, temperature=0.0, model=False, monkeypatch=monkeypatch)
    assert not model_calls
    assert on == off


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_llama_forward_the_layer_op_cannot_run_is_hfs_loop_bit_for_bit(dtype, monkeypatch):
    """float32 (no layer op), and bf16 prefills of more than ``packed.SMALL_ROWS`` rows: ``decode_logits``
    runs HF's layer loop, to the bit the model's own call (prompts of up to 70 tokens, batch 2)."""
    from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: PLC0415

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=160, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256,
    )  # fmt: skip
    actor = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    model_calls: list[int] = []
    _spy_layer_op(monkeypatch, model_calls)
    ran = []
    real = fused.decode_logits

    def spy(*args):
        out = real(*args)
        ran.append(out is not None)
        return out

    monkeypatch.setattr(fused, "decode_logits", spy)
    batch = prompts((70, 40, 3), seed=9)
    on = _model_rollouts(actor, batch, batch_size=2, temperature=0.0, model=True, monkeypatch=monkeypatch)
    assert ran and all(ran)
    assert not model_calls if dtype == torch.float32 else True
    off = _model_rollouts(actor, batch, batch_size=2, temperature=0.0, model=False, monkeypatch=monkeypatch)
    assert on == off


@needs_layer_op
def test_the_layers_op_passes_opcheck_and_refuses_miscounted_operands():
    """The op's schema (its in-place cache write declared) and fake kernel, on two layers' operands; operand
    lists that do not split into whole layers are refused."""
    actor = _small_llama()
    tokens = 3
    hidden, kv_cache, cos, sin = _layer_op_inputs(actor.config.num_hidden_layers, tokens, head_dim=16)

    weights, ints, floats = [], [], []
    for n in (0, 1):
        layer = actor.model.layers[n]
        attn, mlp = layer.self_attn, layer.mlp
        (qkv, qkv_run), (o, o_run) = _blocked(attn.q_proj, attn.k_proj, attn.v_proj), _blocked(attn.o_proj)
        (gate_up, gate_up_run), (down, down_run) = (
            _blocked(mlp.gate_proj, mlp.up_proj),
            _blocked(mlp.down_proj),
        )
        norms = (layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach())
        weights += [norms[0], qkv, o, norms[1],
                    gate_up, down]  # fmt: skip
        ints += [qkv_run, 64, 32, 32, 16, n, o_run, gate_up_run, 1536, 1536, down_run]
        floats += [1e-6, 0.25, 1e-6]
    meta = (
        kv_cache, torch.arange(tokens, dtype=torch.int64), torch.tensor([[0, 1]], dtype=torch.int32),
        torch.tensor([tokens], dtype=torch.int32), torch.tensor([0, tokens], dtype=torch.int32),
    )  # fmt: skip
    op = torch.ops.oppo.llama_decode_layers.default
    torch.library.opcheck(op, (hidden, weights, ints, floats, cos, sin, *meta))
    with pytest.raises(ValueError, match="a layer"):
        op(hidden, weights, ints[:-1], floats, cos, sin, *meta)


@needs_layer_op
def test_the_layers_op_is_its_layers_one_by_one_on_distinct_operands():
    """Two layers whose every operand differs from its neighbours' (random norm weights, each norm its own
    eps, q 128 wide over a 64-wide model so that q|k|v, o and gate|up have different widths and runs, each
    layer its own cache layer and scale): ``ops.llama_decode_layers`` gives the hidden states and writes the
    cache of ``ops.llama_decode_layer`` called layer after layer, to the bit."""
    from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: PLC0415

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=160, hidden_size=64, intermediate_size=1536, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
    )  # fmt: skip
    actor = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    g = torch.Generator().manual_seed(1)
    tokens = 5
    layers = []
    for n, layer in enumerate(actor.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        norms = [(torch.rand(64, generator=g) + 0.5).to(torch.bfloat16) for _ in range(2)]
        layers.append(
            ops.DecodeLayer(
                (norms[0], 1e-6 * (n + 1)),
                (*_blocked(attn.q_proj, attn.k_proj, attn.v_proj), [128, 64, 64]),
                32,
                n,
                0.17 + 0.01 * n,
                _blocked(attn.o_proj),
                (norms[1], 1e-5 * (n + 2)),
                (*_blocked(mlp.gate_proj, mlp.up_proj), [1536, 1536]),
                _blocked(mlp.down_proj),
            )  # fmt: skip
        )
    assert len({d.qkv[1] for d in layers} | {d.o[1] for d in layers} | {d.down[1] for d in layers}) > 1
    hidden, cache, cos, sin = _layer_op_inputs(2, tokens, head_dim=32, seed=1)
    slots = torch.tensor([0, 1, 2, 8, 9], dtype=torch.int64)
    meta = (
        torch.tensor([[0, 1], [1, 2]], dtype=torch.int32), torch.tensor([3, 2], dtype=torch.int32),
        torch.tensor([0, 3, 5], dtype=torch.int32),
    )  # fmt: skip
    caches = [cache, cache.clone()]
    one_by_one = hidden
    for d in layers:
        one_by_one = ops.llama_decode_layer(
            one_by_one, d.input_norm, d.qkv, d.head_dim, cos, sin, caches[0], slots, d.layer, *meta, d.scale,
            d.o, d.post_norm, d.gate_up, d.down,
        )  # fmt: skip
    together = ops.llama_decode_layers(hidden, layers, cos, sin, caches[1], slots, *meta)
    assert bits(together).equal(bits(one_by_one))
    assert bits(caches[1]).equal(bits(caches[0])) and caches[0].any()
    empty = ops.llama_decode_layers(hidden, [], cos, sin, caches[1], slots, *meta)
    assert empty.equal(hidden) and empty.data_ptr() != hidden.data_ptr()


@needs_layer_op
@pytest.mark.parametrize(
    "change", ["model_instance_forward", "base_instance_forward", "is_causal", "captured"]
)
def test_a_llama_whose_call_does_more_than_its_statements_runs_the_models_call(change, monkeypatch):
    """An instance ``forward`` on the causal LM or its base model (an accelerate-style wrapper adding to the
    logits or hidden states), ``is_causal`` in the config (which the wrappers pass to every layer), or
    transformers' output-capture hooks installed by an earlier call that asked for hidden states: the model's
    own call runs, and the rollouts equal those with ``decode_logits`` off."""
    batch = prompts((3, 6), seed=4)
    base = _small_llama()

    def changed(model_path: bool) -> list:
        model = copy.deepcopy(base)
        if change == "model_instance_forward":
            inner = model.forward

            def forward(*args, **kwargs):
                out = inner(*args, **kwargs)
                out.logits = out.logits + 1
                return out

            model.forward = forward
        elif change == "base_instance_forward":
            inner_base = model.model.forward

            def base_forward(*args, **kwargs):
                out = inner_base(*args, **kwargs)
                out.last_hidden_state = out.last_hidden_state * 2
                return out

            model.model.forward = base_forward
        elif change == "is_causal":
            model.config.is_causal = True
        else:
            with torch.no_grad():
                model(torch.tensor([[1, 2, 3]]), output_hidden_states=True)
            assert model.model.__dict__.get("_output_capturing_hooks_installed") or model.__dict__.get(
                "_output_capturing_hooks_installed"
            )
        return _model_rollouts(model, batch, batch_size=2, temperature=0.0, model=model_path,
                               monkeypatch=monkeypatch)  # fmt: skip

    model_calls: list[int] = []
    _spy_layer_op(monkeypatch, model_calls)
    on = changed(True)
    assert not model_calls
    off = changed(False)
    assert on == off
