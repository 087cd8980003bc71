"""Packed linear weights (``EngineConfig.packed_weights``, model/packed.py): the actor's rollouts with packed
weights are those without (bf16 bitwise per product, fp32 to rounding), the packs follow every change of
the weights, and nothing of them is left on the model outside the engine's forwards."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F
from engine_models import make_actor, random_prompts

from oppo_engine import EngineConfig, RolloutEngine, SamplingParams, ops
from oppo_engine.model import packed

pytestmark = pytest.mark.skipif(
    not ops.packed_linear_supported(torch.zeros(2, 2)), reason="no oneDNN fp32 linear on this build"
)

ATOL = 1e-5  # fp32: the same products summed in oneDNN's order, not MKL's (~1e-6 measured)


def make_engine(actor, packed_weights, *, batch_size=4, temperature=0.0) -> RolloutEngine:
    cfg = dict(batch_size=batch_size, mode="sequential", max_model_len=64, packed_weights=packed_weights)
    return RolloutEngine(
        actor, lambda prompt, response: float(len(response)), config=EngineConfig(**cfg),
        sampling=SamplingParams(temperature=temperature, max_new_tokens=12, ignore_eos=True, seed=3),
    )  # fmt: skip


def rollouts(engine: RolloutEngine, prompts) -> list:
    engine.add_prompts(prompts)
    out = []
    while result := engine.step().rollouts:
        out.extend(result)
    return sorted(out, key=lambda r: r.group_id)


def assert_same(a: list, b: list, atol: float = ATOL) -> None:
    assert [r.response_ids for r in a] == [r.response_ids for r in b]
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=atol, rtol=0)


def no_forward_left(model: torch.nn.Module) -> bool:
    return all("forward" not in m.__dict__ for m in model.modules())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 16, 33])
def test_packed_linear_is_f_linear(dtype, rows):
    """Any number of rows against a pack made for 16, with and without a bias: bf16 bitwise on a contiguous
    input (what the model passes), fp32 and a non-contiguous input to rounding."""
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 64, generator=g).to(dtype)
    b = torch.randn(96, generator=g).to(dtype)
    x = torch.randn(1, rows, 64, generator=g).to(dtype)
    strided = torch.randn(64, 2, rows, generator=g).to(dtype).transpose(0, 2)  # [rows, 2, 64]
    p = ops.pack_linear_weight(w, 16)
    for bias in (None, b):
        got, want = ops.packed_linear(x, p, bias), F.linear(x, w, bias)
        if dtype == torch.bfloat16:
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ops.packed_linear(strided, p, bias), F.linear(strided, w, bias), **tol)


def packed_and_unpacked(engines: dict, prompts) -> list:
    """The packed engine's rollouts (``engines[True]``), checked equal to the unpacked engine's."""
    got = {p: rollouts(e, prompts) for p, e in engines.items()}
    assert_same(got[True], got[False])
    return got[True]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_packed_rollouts_equal_unpacked_and_leave_the_model_as_it_was(temperature):
    actor = make_actor()
    prompts = random_prompts(6, seed=1)
    engines = {p: make_engine(actor, p, temperature=temperature) for p in (True, False)}
    got = {p: rollouts(e, prompts) for p, e in engines.items()}
    assert_same(got[True], got[False])
    runner = engines[True]._loop.actor.runner
    assert runner.packed is not None and runner.packed.nbytes > 0  # it did run packed
    assert engines[False]._loop.actor.runner.packed is None
    assert no_forward_left(actor)
    # The trainer's forward and backward are the module's own.
    actor.train()
    loss = actor(torch.tensor([prompts[0]])).logits.sum()
    loss.backward()
    assert all(p.grad is not None for p in actor.parameters() if p.requires_grad)
    for e in engines.values():
        e.close()


def test_packs_follow_in_place_updates_replaced_weights_and_update_policy():
    """An optimizer-like in-place update, a parameter replaced by a new tensor, and a write through ``.data``
    (which bumps no version counter) followed by ``update_policy()``: each time the packed engine's rollouts
    are the unpacked engine's on the new weights, and differ from the old ones."""
    actor = make_actor()
    prompts = random_prompts(4, seed=2)
    engines = {p: make_engine(actor, p) for p in (True, False)}

    def both():
        return packed_and_unpacked(engines, prompts)

    before = both()
    packs = engines[True]._loop.actor.runner.packed
    repacks = packs.repacks
    with torch.no_grad():
        for p in actor.parameters():
            p.mul_(1.5)  # an optimizer step writes in place: the version counter moves
    after_inplace = both()
    assert [r.logprobs for r in after_inplace] != [r.logprobs for r in before]
    assert packs.repacks > repacks
    layer = next(m for m in actor.modules() if isinstance(m, torch.nn.Linear))
    layer.weight = torch.nn.Parameter(layer.weight.detach() * 2)  # replaced, not written
    after_replace = both()
    assert [r.logprobs for r in after_replace] != [r.logprobs for r in after_inplace]
    with torch.no_grad():
        for p in actor.parameters():
            p.data.copy_(p.data * 0.5)  # no version bump: only update_policy() tells the engine
    for e in engines.values():
        e.update_policy()
    after_data = both()
    assert [r.logprobs for r in after_data] != [r.logprobs for r in after_replace]
    for e in engines.values():
        e.close()


def test_release_memory_with_weights_frees_the_packs_and_the_next_step_packs_again():
    actor = make_actor()
    engine = make_engine(actor, True)
    prompts = random_prompts(4, seed=3)
    first = rollouts(engine, prompts)
    packs = engine._loop.actor.runner.packed
    assert packs.nbytes > 0
    engine.release_memory(weights=True)
    assert packs.nbytes == 0
    engine.resume()
    assert_same(rollouts(engine, prompts), first, atol=0)
    engine.close()


def test_another_thread_running_the_model_meanwhile_gets_the_modules_own_forward():
    """The packed forward is the runner's thread's only: a forward of the same model on another thread while
    it is swapped in runs the module's own product (bitwise F.linear)."""
    actor = make_actor()
    linear = next(m for m in actor.modules() if type(m) is torch.nn.Linear)
    packs = packed.PackedLinears(actor, 4)
    x = torch.randn(3, linear.in_features)
    seen = {}
    with torch.inference_mode(), packs.applied():
        assert "forward" in linear.__dict__
        t = threading.Thread(target=lambda: seen.update(other=linear(x)))
        t.start()
        t.join()
    assert torch.equal(seen["other"], F.linear(x, linear.weight, linear.bias))
    assert no_forward_left(actor)


def test_packs_already_made_stop_serving_when_the_precision_drops_and_read_a_replaced_bias():
    """The support check runs once per kind of weight per forward, not once per module: packs made earlier
    still go unused under a reduced fp32 matmul precision, and come back with it. A bias replaced between
    forwards (only weights are packed) is the one the product adds."""
    actor = make_actor()
    linear = next(m for m in actor.modules() if type(m) is torch.nn.Linear and m.bias is not None)
    packs = packed.PackedLinears(actor, 4)
    x = torch.randn(3, linear.in_features)
    with torch.inference_mode(), packs.applied():
        assert "forward" in linear.__dict__
    saved = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("medium")
    try:
        with torch.inference_mode(), packs.applied():
            assert no_forward_left(actor)
    finally:
        torch.set_float32_matmul_precision(saved)
    linear.bias = torch.nn.Parameter(torch.randn_like(linear.bias) * 10)
    with torch.inference_mode(), packs.applied():
        assert "forward" in linear.__dict__
        got = linear(x)
    torch.testing.assert_close(got, F.linear(x, linear.weight, linear.bias), atol=ATOL, rtol=0)
    assert no_forward_left(actor)


def test_setting_is_checked_and_auto_is_on_for_the_cpu_only():
    with pytest.raises(ValueError, match="packed_weights"):
        EngineConfig(packed_weights="yes")
    assert packed.packed_enabled("auto", torch.device("cpu"))
    assert not packed.packed_enabled("auto", torch.device("cuda"))
    assert not packed.packed_enabled(False, torch.device("cpu"))
    # A weight oneDNN cannot pack exactly is left to F.linear: fp16, and fp32 under reduced precision.
    assert not ops.packed_linear_supported(torch.zeros(2, 2, dtype=torch.float16))
    saved = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("medium")
    try:
        assert not ops.packed_linear_supported(torch.zeros(2, 2))
    finally:
        torch.set_float32_matmul_precision(saved)


def test_weights_made_under_inference_mode_are_left_to_f_linear():
    """An inference tensor has no version counter, so a pack of it could not be told stale: not packed, and
    the engine's rollouts are the unpacked engine's."""
    with torch.inference_mode():
        actor = make_actor()
    prompts = random_prompts(3, seed=4)
    engines = {p: make_engine(actor, p) for p in (True, False)}
    got = {p: rollouts(e, prompts) for p, e in engines.items()}
    assert_same(got[True], got[False], atol=0)
    assert engines[True]._loop.actor.runner.packed.nbytes == 0
    for e in engines.values():
        e.close()


def test_a_forward_already_set_on_the_instance_is_left_in_place_and_runs():
    """A module whose forward is already set on the instance (accelerate's hooks, a user's wrapper) keeps it:
    the packs never replace it (the wrapper's own work, e.g. moving weights, must run), and after the
    block it is the very object that was there, not removed."""
    actor = make_actor()
    linears = [m for m in actor.modules() if type(m) is torch.nn.Linear]
    hooked, plain = linears[0], linears[1]
    calls = []

    def wrapper(x, _own=hooked.forward):
        calls.append(x.shape)
        return _own(x)

    hooked.forward = wrapper
    packs = packed.PackedLinears(actor, 4)
    x = torch.randn(3, hooked.in_features)
    for _ in range(2):  # the second time with the packs already made
        with torch.inference_mode(), packs.applied():
            assert hooked.__dict__["forward"] is wrapper
            assert "forward" in plain.__dict__
            got = hooked(x)
        assert hooked.__dict__["forward"] is wrapper
        assert "forward" not in plain.__dict__
    assert len(calls) == 2
    assert torch.equal(got, F.linear(x, hooked.weight, hooked.bias))


# -- grouped products: q, k, v (Llama's fused attention) and gate, up (Llama-form MLPs) as one product each --


def llama_actor(dtype: torch.dtype, bias: bool, intermediate: int = 96) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=intermediate, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      attention_bias=bias, mlp_bias=bias, eos_token_id=3, pad_token_id=0)  # fmt: skip
    return AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()


def outputs(got: list) -> list[tuple[list[int], list[float]]]:
    return [(r.response_ids, r.logprobs) for r in got]


def grouped_rollouts(actor, grouping: bool, temperature: float) -> tuple[list, packed.PackedLinears, int]:
    """The rollouts, the packs, and how many groups held a stacked pack at the end (before the close)."""
    engine = make_engine(actor, True, temperature=temperature)
    packs = engine._loop.actor.runner.packed
    packs.grouping = grouping
    try:
        got = rollouts(engine, random_prompts(6, seed=4))
        return got, packs, sum(g.packed is not None for g in packs._groups.values())
    finally:
        engine.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("bias", "intermediate"), [(False, 96), (True, 96), (False, 100)])
def test_grouped_products_are_the_members_own_to_the_bit(dtype, bias, intermediate, monkeypatch):
    """A Llama (fused attention and MLPs; with and without biases; an intermediate size that is no multiple
    of a vector, where SiLU over a strided view rounded a row's tail otherwise): greedy and sampled rollouts
    with the grouped products are those without, to the bit, and the groups did serve (q, k, v and gate, up
    of every layer)."""
    served = []
    real = packed.PackedLinears.grouped
    monkeypatch.setattr(
        packed.PackedLinears, "grouped", lambda self, m, x: served.append(len(m)) or real(self, m, x)
    )
    actor = llama_actor(dtype, bias, intermediate)
    for temperature in (0.0, 1.0):
        with_groups, packs, stacked = grouped_rollouts(actor, True, temperature)
        assert packs.ungrouped == 0 and {3, 2} <= set(served)
        assert len(packs._groups) == 4 and stacked == 4
        without, _, stacked = grouped_rollouts(actor, False, temperature)
        assert stacked == 0
        assert outputs(with_groups) == outputs(without)
    assert no_forward_left(actor)


def test_a_group_whose_product_is_not_bitwise_is_declined(monkeypatch):
    """Where the stacked product differs from the members' (forced here), the group is not used: counted in
    ``ungrouped``, ``grouped`` declines, and the rollouts are the members' own."""
    monkeypatch.setattr(packed, "_bitwise_grouped", lambda *a: False)
    actor = llama_actor(torch.float32, False)
    got, packs, stacked = grouped_rollouts(actor, True, 0.0)
    assert packs.ungrouped == 4 and stacked == 0
    monkeypatch.undo()
    want, _, _ = grouped_rollouts(actor, False, 0.0)
    assert outputs(got) == outputs(want)


def test_grouped_serves_only_its_groups_on_the_forward_thread_and_follows_updates():
    actor = llama_actor(torch.float32, True)
    packs = packed.PackedLinears(actor, 4)
    attn = actor.model.layers[0].self_attn
    mlp = actor.model.layers[0].mlp
    x = torch.randn(1, 5, 64)
    assert packed.grouped((attn.q_proj, attn.k_proj, attn.v_proj), x) is None  # outside applied()
    with torch.inference_mode(), packs.applied():
        qkv = packed.grouped((attn.q_proj, attn.k_proj, attn.v_proj), x)
        assert [t.shape[-1] for t in qkv] == [64, 32, 32] and all(t.stride(-1) == 1 for t in qkv)
        for t, m in zip(qkv, (attn.q_proj, attn.k_proj, attn.v_proj), strict=True):
            assert torch.equal(t, m(x))  # the member's own pack
        assert packed.grouped((attn.k_proj, attn.q_proj, attn.v_proj), x) is None  # not a group (order)
        assert packed.grouped((mlp.gate_proj, attn.q_proj), x) is None
        other = []
        t = threading.Thread(target=lambda: other.append(packs.grouped((mlp.gate_proj, mlp.up_proj), x)))
        t.start()
        t.join()
        assert other == [None]
    with torch.no_grad():
        mlp.up_proj.weight.mul_(2.0)  # an in-place update: the group is packed again
    with torch.inference_mode(), packs.applied():
        gate, up = packed.grouped((mlp.gate_proj, mlp.up_proj), x)
        assert torch.equal(up, mlp.up_proj(x))
        torch.testing.assert_close(up, F.linear(x, mlp.up_proj.weight, mlp.up_proj.bias), atol=ATOL, rtol=0)


def test_a_groups_probe_runs_once_per_shape_not_at_every_repacking(monkeypatch):
    """The bitwise probe's verdict depends on the products' shapes, dtype, batch hint and threads, not on
    the weights: a model's layers share one verdict per kind of group, and repacking after an update (every
    PPO step) probes nothing again."""
    probes = []
    real = packed._probe_grouped
    monkeypatch.setattr(packed, "_probe_grouped", lambda *a: probes.append(1) or real(*a))
    monkeypatch.setattr(packed, "_verdicts", {})
    actor = llama_actor(torch.float32, False)
    engine = make_engine(actor, True)
    try:
        first = rollouts(engine, random_prompts(4, seed=5))
        assert len(probes) == 2  # q, k, v and gate, up: one shape each, over both layers
        repacks = engine._loop.actor.runner.packed.repacks
        with torch.no_grad():
            for p in actor.parameters():
                p.mul_(0.9)
        engine.update_policy()
        again = rollouts(engine, random_prompts(4, seed=5))
        assert engine._loop.actor.runner.packed.repacks > repacks and len(probes) == 2
        assert outputs(again) != outputs(first)  # the new weights, grouped
    finally:
        engine.close()


def test_a_hooked_member_runs_alone_and_its_hook_runs():
    """``grouped`` calls no member's ``__call__``: a member with a forward hook (or any global module hook)
    is served alone, through its own call, so the hook runs; without hooks the group serves."""
    from oppo_engine.model import fused

    actor = llama_actor(torch.float32, False)
    mlp = actor.model.layers[0].mlp
    packs, mods = packed.PackedLinears(actor, 4), fused.FusedModules(actor)
    x = torch.randn(1, 5, 64)
    with torch.inference_mode():
        # The references with the packs alone (each member its own packed product, HF's MLP forward): fp32
        # packed products are not F.linear's to the bit (with two threads, at these shapes), so only a
        # packed reference tells the group and the hook apart from the packing.
        with packs.applied():
            want = mlp(x)
        handle = mlp.up_proj.register_forward_hook(lambda module, args, out: out * 2)
        with packs.applied():
            hooked = mlp(x)
        assert not torch.equal(hooked, want)
        with packs.applied(), mods.applied():
            assert packed.grouped((mlp.gate_proj, mlp.up_proj), x) is None
            assert torch.equal(mlp(x), hooked)
        handle.remove()
        with packs.applied(), mods.applied():
            assert packed.grouped((mlp.gate_proj, mlp.up_proj), x) is not None
            assert torch.equal(mlp(x), want)
        global_hook = torch.nn.modules.module.register_module_forward_hook(lambda module, args, out: None)
        with global_hook, packs.applied():
            assert packed.grouped((mlp.gate_proj, mlp.up_proj), x) is None


def test_a_raised_batch_hint_repacks_everything_at_it():
    """Every pack and group of a model is made at one batch hint: raised (a larger engine of the same
    actor), the next forward packs everything again at it, so a group's verdict is for its members' layout."""
    actor = llama_actor(torch.float32, False)
    packs = packed.PackedLinears(actor, 4)
    with torch.inference_mode(), packs.applied():
        pass
    first, held = packs.repacks, packs.held
    assert packed.for_model(actor, 4) is not packs  # for_model keeps its own; raise this one's by hand
    packs.batch_hint = 16
    with torch.inference_mode(), packs.applied():
        pass
    assert packs.repacks == 2 * first and packs.held == held
    assert all(g.packed is not None for g in packs._groups.values())


def test_packs_follow_weights_swapped_under_the_same_tensor():
    """``param.data = t`` keeps the Parameter and its version counter: the packs see its new address (or, for
    a square weight transposed in place of itself, its new strides), so the packed engine's next rollouts are
    the unpacked engine's on the new weights, without ``update_policy()`` (a member of a group included: the
    group is packed again with it)."""
    actor = llama_actor(torch.float32, False)
    prompts = random_prompts(4, seed=3)
    engines = {p: make_engine(actor, p) for p in (True, False)}

    def both():
        return packed_and_unpacked(engines, prompts)

    before = both()
    mlp = actor.model.layers[0].mlp
    weight, version = mlp.up_proj.weight, mlp.up_proj.weight._version
    weight.data = weight.detach() * 3  # a new tensor under the same Parameter, no version bump
    assert mlp.up_proj.weight is weight and weight._version == version
    after = both()
    assert [r.logprobs for r in after] != [r.logprobs for r in before]
    q = actor.model.layers[0].self_attn.q_proj.weight  # square: transposed, it keeps its address
    address = q.data_ptr()
    q.data = q.detach().t()
    assert q.data_ptr() == address
    transposed = both()
    assert [r.logprobs for r in transposed] != [r.logprobs for r in after]
    for e in engines.values():
        e.close()
