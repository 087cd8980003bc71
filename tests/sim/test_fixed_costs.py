"""The fixed costs per forward and per layer, fitted from shrunk copies at two depths.

A model's forwards measure its fixed costs by how much of them they are: on a wide model a forward is mostly
its projections and a fit of ``forward_s`` and ``layer_s`` from it fits noise; and models of one depth ``L``
have the fit's columns 1 and ``L`` in proportion, so it sees only ``forward_s + L * layer_s`` and splits it
arbitrarily (``lstsq``'s minimum norm). ``calibrate`` on the CPU times shrunk copies of each model (its class,
random weights, every width cut down: ``shrunk_config``) at two depths (``shrunk_depths``), fits the two
fixed costs from them (``_fixed_costs``: their projections taken out, their other terms, 0.1-2% of them,
neglected) and the other constants from the models' own forwards with those two held (``_fit``). The
forward times here are made up (exact sums of known constants, or those with a fixed pattern of noise: a
test input, not a measurement)."""

from __future__ import annotations

import dataclasses
import math
import types

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, LlamaConfig, Qwen2Config

from oppo_engine.presets import preset_config
from oppo_engine.sim import calibration
from oppo_engine.sim.calibration import (
    FORWARD_GRID,
    SHRUNK_GRID,
    SHRUNK_HEAD_DIM,
    SHRUNK_VOCAB,
    _batch,
    _fit,
    _fit_with,
    _fixed_costs,
    shrunk_config,
    shrunk_copy,
    shrunk_depths,
)
from oppo_engine.sim.cost import HostCosts
from oppo_engine.sim.profile import Calibrated, Profile, ThreadCosts
from oppo_engine.sim.shapes import model_shape

from .test_profile_fit import forward_s as fitted_terms_s

TRUE = dict(forward_s=1e-4, layer_s=2e-5, pair_s=1e-9, kv_byte_s=1e-11, token_hidden_s=1e-9, logit_s=1e-9)
# Copies whose other terms are nil: the fixed costs and their projections alone.
NIL = dict(pair_s=0.0, kv_byte_s=0.0, token_hidden_s=0.0, logit_s=0.0)
# What neglecting the copies' other terms costs at SHRUNK_GRID's points (a token's or two's attention and
# elementwise work), at TRUE's constants: layer_s comes out 1.1-2.1% high, forward_s 0.03%.
NEGLECTED = 0.025
# GEMMs and weight streaming priced as free: the made-up forward times are the fitted terms alone.
FREE_GEMMS = ThreadCosts({1: [(1, 1e30)]}, 1e30, 0, 0, 0, 0, 0, 0, 0)
# Or priced as a CPU's tables might (made up): a wide model's forwards are then mostly its projections.
GEMM = {kn: [(1, 2e9), (16, 2e10), (256, 5e10)] for kn in (2048, 16384, 1048576)}
STREAMING = [(4e6, 1, 8e9), (1.28e8, 1, 6e9), (4e6, 16, 5e9), (1.28e8, 16, 4e9)]
TABLES = ThreadCosts(GEMM, 1e10, 0, 0, 0, 0, 0, 0, 0, STREAMING)
# The matrix's gqa8 shape (bench/bench_twin.py): 2 layers of 1024, head_dim 128, 8 query heads per KV head.
GQA8 = Qwen2Config(vocab_size=512, hidden_size=1024, intermediate_size=2048, num_hidden_layers=2,
                   num_attention_heads=8, num_key_value_heads=1)  # fmt: skip
HEADS = {"actor": "lm", "reward": "score", "critic": "value"}


def seconds(shape, role, point, c: dict, ts: ThreadCosts = FREE_GEMMS) -> float:
    """A forward's seconds from the constants ``c``, by the terms the calibration fits, plus its
    projections as ``ts``'s tables price them."""
    batch = _batch(role, *point)
    probe = Calibrated(Profile("t", "cpu", {1: ts}, HostCosts(0, 0, 0), 1.0))

    def gemm(m, k, n):
        return max(probe.gemm(m, k, n, shape.dtype_bytes, 1, shape.weight_bytes, False))

    projections = shape.layers * sum(gemm(batch.tokens, k, n) for k, n in shape.layer_gemms())
    projections += gemm(batch.head_rows, *shape.head_gemm())
    return projections + fitted_terms_s(shape, role, point, c)


def timed(config, roles=("actor", "reward"), grid=FORWARD_GRID, ts=FREE_GEMMS, noise=0.0, **constants):
    """Made-up timed forwards of ``config``'s shape in each role over ``grid``; ``noise``: each forward
    ``1 ± noise`` times its true seconds, alternately (a fixed pattern)."""
    c = {**TRUE, **constants}
    points = []
    for role in roles:
        shape = model_shape(config, head=HEADS[role], dtype_bytes=4, name=role)
        for point in grid:
            sign = 1 if len(points) % 2 == 0 else -1
            points.append((shape, role, point, seconds(shape, role, point, c, ts) * (1 + sign * noise)))
    return points


def shrunk(config, depths=None, roles=("actor", "reward"), ts=FREE_GEMMS, **constants):
    """Made-up forwards of the shrunk copies of ``config`` at ``depths`` (its two, by default)."""
    depths = depths or shrunk_depths(config.num_hidden_layers)
    return [p for d in depths for p in timed(shrunk_config(config, d), roles, SHRUNK_GRID, ts, **constants)]


TINY = preset_config("tiny")


@pytest.mark.parametrize("ts", [FREE_GEMMS, TABLES], ids=["free-gemms", "gemm-tables"])
def test_two_depths_recover_the_fixed_costs_that_one_depth_only_sums(ts):
    """The actor and reward of one depth (``tiny``: 2 layers) give the fit only ``forward_s + 2 layer_s``;
    their shrunk copies at depths 1 and 4 give each, and the rest is fitted with them held."""
    points = timed(TINY, ts=ts)
    old = _fit(points, ts)
    total = TRUE["forward_s"] + 2 * TRUE["layer_s"]
    assert old.forward_s + 2 * old.layer_s == pytest.approx(total, rel=1e-6)
    # lstsq's minimum-norm split of a sum it cannot separate: T / (1 + L^2), not the true forward_s
    assert old.forward_s == pytest.approx(total / 5, rel=1e-6)
    assert not math.isclose(old.forward_s, TRUE["forward_s"], rel_tol=0.5)

    # Copies whose other terms are nil: every constant exactly.
    new = _fit(points, ts, shrunk(TINY, ts=ts, **NIL))
    for name, value in TRUE.items():
        assert getattr(new, name) == pytest.approx(value, rel=1e-6), name
    assert new.fit_error < 1e-9 and new.unfitted == {}
    # Copies with their attention, elementwise work and logits (neglected by the fit): the fixed costs
    # within what those are of the copies' forwards.
    new = _fit(points, ts, shrunk(TINY, ts=ts))
    for name in ("forward_s", "layer_s"):
        assert getattr(new, name) == pytest.approx(TRUE[name], rel=NEGLECTED), name

    # Copies of one depth are as degenerate as the models: the fit of the two from them sums them and
    # splits the sum as the models' fit does; _fixed_costs refuses them.
    one = shrunk(TINY, depths=(2,), ts=ts, **NIL)
    fixed = _fit_with(one, ts, free_scale=False, fit=("forward_s", "layer_s"))
    assert fixed.forward_s + 2 * fixed.layer_s == pytest.approx(total, rel=1e-6)
    assert fixed.forward_s == pytest.approx(total / 5, rel=1e-6)
    with pytest.raises(ValueError, match=r"shrunk copies of two depths, got \[2\]"):
        _fixed_costs(one, ts)
    with pytest.raises(ValueError, match=r"shrunk copies of two depths"):
        _fit(points, ts, one)


def test_a_wide_models_noise_does_not_move_the_fixed_costs():
    """gqa8's forwards are almost all projections (70 MB of fp32 weights): 3% of noise on them is many
    times its fixed costs, and a fit of those from its forwards is off by far more than 3%; from the
    shrunk copies (exact here), they come out as the copies alone give them, whatever the noise."""
    copies = shrunk(GQA8, ts=TABLES)
    alone = _fixed_costs(copies, TABLES)
    old = _fit(timed(GQA8, ts=TABLES, noise=0.03), TABLES)
    for noise in (0.0, 0.03):
        new = _fit(timed(GQA8, ts=TABLES, noise=noise), TABLES, copies)
        assert (new.forward_s, new.layer_s) == (alone.forward_s, alone.layer_s)
        for name in ("forward_s", "layer_s"):
            assert getattr(new, name) == pytest.approx(TRUE[name], rel=NEGLECTED), name
    # The fit from its own forwards: their sum at its depth 24% high, forward_s 65% low, layer_s 3.5x.
    fixed = TRUE["forward_s"] + 2 * TRUE["layer_s"]
    assert abs(old.forward_s + 2 * old.layer_s - fixed) > 0.2 * fixed
    assert old.forward_s < 0.5 * TRUE["forward_s"] and old.layer_s > 3 * TRUE["layer_s"]
    # fit_error is still the models' own: the noise (3% on every forward) shows in it
    assert 0.01 < new.fit_error < 0.05


def test_the_unfitted_marks_are_decided_from_the_models_own_forwards():
    """A reward and a critic (no vocabulary head) calibrated with the actor's shrunk copies among the
    copies: the copies' logits do not make ``logit_s`` measured; it is marked as before."""
    roles = ("reward", "critic")
    points = timed(TINY, roles=roles)
    costs = _fit(points, FREE_GEMMS, shrunk(TINY, roles=("actor", "reward"), **NIL))
    assert costs.unfitted == {"logit_s": 0}
    assert costs.forward_s == pytest.approx(TRUE["forward_s"], rel=1e-6)
    assert costs.layer_s == pytest.approx(TRUE["layer_s"], rel=1e-6)
    assert _fit(points, FREE_GEMMS).unfitted == {"logit_s": 0}  # as without copies


# The actor's own fixed costs beside the scorers' (made up, in the proportions measured on ``small``'s copies:
# 291 against 185 us a forward, 204 against 114 us a layer; ``_fixed_costs``).
OWN = dict(actor_forward_s=6e-5, actor_layer_s=1.8e-5)


def with_own(points, actor_forward_s=OWN["actor_forward_s"], actor_layer_s=OWN["actor_layer_s"]):
    """``points`` with the actor's forwards each ``actor_forward_s + layers * actor_layer_s`` longer."""
    return [
        (shape, role, point, s + (actor_forward_s + actor_layer_s * shape.layers if role == "actor" else 0.0))
        for shape, role, point, s in points
    ]


@pytest.mark.parametrize("ts", [FREE_GEMMS, TABLES], ids=["free-gemms", "gemm-tables"])
def test_the_actors_own_fixed_costs_are_fitted_apart_from_the_scorers(ts):
    """The engine's actor costs more per forward and per layer than a scorer of its shape (its packs'
    bookkeeping per module, its sampler): its copies fit its own, the reward's copies the scorers', and the
    models' other constants come out exactly with both held. Fitted together (as before), the two roles'
    fixed costs were one average: the actor's forwards priced low, the reward's high."""
    copies = with_own(shrunk(TINY, ts=ts, **NIL))
    fixed = _fixed_costs(copies, ts)
    assert fixed.forward_s == pytest.approx(TRUE["forward_s"], rel=1e-6)
    assert fixed.layer_s == pytest.approx(TRUE["layer_s"], rel=1e-6)
    assert fixed.actor_forward_s == pytest.approx(OWN["actor_forward_s"], rel=1e-6)
    assert fixed.actor_layer_s == pytest.approx(OWN["actor_layer_s"], rel=1e-6)
    new = _fit(with_own(timed(TINY, ts=ts)), ts, copies)
    for name, value in {**TRUE, **OWN}.items():
        assert getattr(new, name) == pytest.approx(value, rel=1e-6), name
    assert new.fit_error < 1e-9

    # One fit over both roles' copies (the rule before): between the two, neither's.
    both = _fit_with(copies, ts, free_scale=False, fit=("forward_s", "layer_s"))
    assert TRUE["layer_s"] < both.layer_s < TRUE["layer_s"] + OWN["actor_layer_s"]
    assert both.fit_error > 0.05

    # Copies of one role: no scorer to compare with, so no own costs; every copy fits the shared two.
    alone = _fixed_costs(shrunk(TINY, roles=("reward", "critic"), ts=ts, **NIL), ts)
    assert (alone.actor_forward_s, alone.actor_layer_s) == (0.0, 0.0)
    assert alone.layer_s == pytest.approx(TRUE["layer_s"], rel=1e-6)


def test_the_actors_own_fixed_costs_are_charged_to_its_forwards_alone():
    """``CostModel.forward(actor=True)`` adds ``actor_forward_s + layers * actor_layer_s`` to a forward's
    host time, the actor's as the calibration timed it (packed where it packed; where nothing packed, an
    actor asked packed runs unpacked, as timed); a scorer's forward, and an unpacked actor on a profile that
    packed (its own costs never timed), pay the shared fixed costs alone."""
    from oppo_engine.sim.cost import Batch, CostModel

    costs = dataclasses.replace(TABLES, forward_s=1e-4, layer_s=2e-5, **OWN)
    packed = dataclasses.replace(costs, gemm_packed=GEMM, streaming_packed=STREAMING)
    shape = model_shape(TINY, dtype_bytes=4, name="actor")
    batch = Batch(((1, 40),) * 8, 8, 8)
    own = OWN["actor_forward_s"] + shape.layers * OWN["actor_layer_s"]
    for ts, packs in ((costs, False), (packed, True)):
        cost = CostModel(Calibrated(Profile("t", "cpu", {1: ts}, HostCosts(0, 0, 0), 1.0)))
        scorer = cost.forward(shape, batch, packed=packs)
        actor = cost.forward(shape, batch, packed=packs, actor=True)
        assert actor.host_s - scorer.host_s == pytest.approx(own, rel=1e-12)
        assert actor.phases == scorer.phases
        other = cost.forward(shape, batch, packed=not packs, actor=True)
        if packs:  # an unpacked actor on a profile that packed: its own costs were not timed
            assert other.host_s == cost.forward(shape, batch, packed=False).host_s
        else:  # nothing packed here: an actor asked packed runs as timed, unpacked
            assert other.host_s - cost.forward(shape, batch, packed=True).host_s == pytest.approx(
                own, rel=1e-12
            )


# Llama with head_dim given apart from the hidden size, and a pad id past the shrunk vocabulary.
LLAMA = LlamaConfig(vocab_size=1000, hidden_size=192, intermediate_size=512, num_hidden_layers=3,
                    num_attention_heads=6, num_key_value_heads=2, head_dim=48, pad_token_id=999)  # fmt: skip
# Sliding-window layers from the second on: per-layer kinds the copies keep in order.
SLIDING = Qwen2Config(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=4, use_sliding_window=True,
                      sliding_window=64, max_window_layers=1)  # fmt: skip


@pytest.mark.parametrize(
    "config", [TINY, GQA8, LLAMA, SLIDING], ids=["tiny", "gqa8", "llama-head-dim", "qwen2-sliding"]
)
def test_the_shrunk_configs_keep_the_class_and_head_layout_at_two_depths(config):
    own = model_shape(config, dtype_bytes=4)
    depths = shrunk_depths(own.layers)
    assert depths == (1, 2 * own.layers) and len(set(depths)) == 2
    for depth in depths:
        cut = shrunk_config(config, depth)
        shape = model_shape(cut, dtype_bytes=4)
        assert type(cut) is type(config)
        assert (shape.layers, shape.heads, shape.kv_heads) == (depth, own.heads, own.kv_heads)
        assert shape.head_dim == SHRUNK_HEAD_DIM and shape.hidden == own.heads * SHRUNK_HEAD_DIM
        assert shape.intermediate == shape.hidden and shape.vocab == SHRUNK_VOCAB
        assert all(i < SHRUNK_VOCAB for i in (cut.pad_token_id, cut.bos_token_id, cut.eos_token_id) if i)
        if getattr(config, "layer_types", None) is not None:
            kinds = list(config.layer_types)
            assert list(cut.layer_types) == [kinds[i % own.layers] for i in range(depth)]
    assert model_shape(config, dtype_bytes=4) == own  # the model's own config is not touched


def test_a_shrunk_copy_is_the_models_class_and_runs_the_engines_forwards():
    """The copies of a causal LM and of a sequence classifier: the same classes, dtype and device, random
    weights, and one forward each through the calibration's bench (the actor's packed where the engine
    packs)."""
    torch.manual_seed(0)
    shape = dict(vocab_size=300, hidden_size=96, intermediate_size=160, num_hidden_layers=2,
                 num_attention_heads=6, num_key_value_heads=2, pad_token_id=0)  # fmt: skip
    actor = AutoModelForCausalLM.from_config(LlamaConfig(**shape), dtype=torch.float32).eval()
    reward_config = LlamaConfig(**shape, num_labels=1)
    reward = AutoModelForSequenceClassification.from_config(reward_config, dtype=torch.float32).eval()
    packs = calibration.packing(torch.device("cpu"), torch.float32)
    for role, model in (("actor", actor), ("reward", reward)):
        for depth in shrunk_depths(2):
            copy = shrunk_copy(model, depth)
            assert type(copy) is type(model) and not copy.training
            assert next(copy.parameters()).dtype == torch.float32
            assert copy.config.num_hidden_layers == depth and copy.config.num_key_value_heads == 2
            bench = calibration._RoleBench(role, copy, torch.device("cpu"), packed=packs and role == "actor",
                                           grid=SHRUNK_GRID)  # fmt: skip
            bench.call(*SHRUNK_GRID[-1])()
    assert actor.config.num_hidden_layers == 2 and actor.config.hidden_size == 96  # untouched


def test_a_copy_computes_what_the_model_does_or_is_refused_naming_the_modules():
    """OPT names its MLP width ``ffn_dim`` and has an embedding width of its own: a copy cuts both, so it
    gains no projection in or out of the decoder that the model lacks (whose work would land in the fitted
    fixed costs, unpriced); a model that has such projections is refused by name."""
    from transformers import OPTConfig

    torch.manual_seed(0)
    shape = dict(hidden_size=96, num_attention_heads=4, ffn_dim=192, num_hidden_layers=2, vocab_size=200)
    opt = AutoModelForCausalLM.from_config(OPTConfig(**shape, word_embed_proj_dim=96)).eval()
    for depth in shrunk_depths(2):
        copy = shrunk_copy(opt, depth)
        assert copy.config.ffn_dim == copy.config.word_embed_proj_dim == copy.config.hidden_size == 64
        assert copy.model.decoder.project_in is None and copy.model.decoder.project_out is None
    projected = AutoModelForCausalLM.from_config(OPTConfig(**shape, word_embed_proj_dim=48)).eval()
    with pytest.raises(ValueError, match="does not compute what the model does: .*project_in"):
        shrunk_copy(projected, 1)


def test_a_model_that_cannot_be_shrunk_is_named_and_the_fit_falls_back_with_a_warning(monkeypatch):
    class Multimodal:
        def get_text_config(self):
            return TINY

    with pytest.raises(ValueError, match="cannot shrink Multimodal: its decoder's config is nested"):
        shrunk_config(Multimodal(), 1)

    def refuse(model, layers):
        raise ValueError("calibrate: cannot shrink Thing")

    monkeypatch.setattr(calibration, "shrunk_copy", refuse)
    with pytest.warns(RuntimeWarning, match="cannot shrink Thing; the fixed costs .* fitted from the models"):
        assert calibration._shrunk_copies({"actor": types.SimpleNamespace(config=TINY)}, print) == {}
