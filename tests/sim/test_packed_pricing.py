"""The engine's actor multiplies by packed weights on the CPU (``EngineConfig.packed_weights``, default on
there: ``oppo_engine/model/packed.py``), its scorers by their own ``nn.Linear`` weights, which ``F.linear``
repacks at every call. The twin priced every projection as the unpacked bare GEMMs and weight streaming
timed it, and ``calibrate`` timed the actor's forwards unpacked, so the actor's weight-bound decode was
priced as unpacked: most on a wide model (the matrix's gqa8 column, predicted high from every
calibration). Now a profile holds packed tables beside the unpacked ones, the actor's forwards are priced
(and fitted) by them where the engine packs, and the scorers' by the unpacked ones. The profiles hold
made-up constants (a test input, not a measurement)."""

from __future__ import annotations

import dataclasses

import pytest

from oppo_engine import EngineConfig
from oppo_engine.sim import plan
from oppo_engine.sim.calibration import FORWARD_GRID, _batch, _fit_with
from oppo_engine.sim.cost import Batch, CostModel, HostCosts
from oppo_engine.sim.prior import predicted_profile
from oppo_engine.sim.profile import Calibrated, Profile, ThreadCosts
from oppo_engine.sim.shapes import attention_pairs, model_shape

GEMM = {kn: [(1, 2e9), (16, 2e10), (256, 5e10)] for kn in (16384, 1048576)}
STREAMING = [(4e6, 1, 8e9), (1.28e8, 1, 6e9), (4e6, 16, 5e9), (1.28e8, 16, 4e9)]
# Packed: twice the GEMMs' FLOP/s and twice the streaming bandwidth (made up).
GEMM_PACKED = {kn: [(m, 2 * f) for m, f in v] for kn, v in GEMM.items()}
STREAMING_PACKED = [(w, r, 2 * b) for w, r, b in STREAMING]
UNPACKED = ThreadCosts(GEMM, 1e10, 1e-4, 2e-5, 1e-10, 1e-11, 1e-9, 1e-9, 0.05, STREAMING)
PACKED = dataclasses.replace(UNPACKED, gemm_packed=GEMM_PACKED, streaming_packed=STREAMING_PACKED)


def _profile(costs: ThreadCosts) -> Profile:
    return Profile("cpu:test", "cpu", {1: costs}, HostCosts(2e-5, 3e-6, 5e-6), 5e9, cores=2)


def _gemm_phases(work) -> list[tuple[float, float]]:
    return list(work.phases[:-2])  # the projections (the layers' and the head's); then elementwise, attention


def test_a_packed_forward_is_priced_by_the_packed_tables_and_an_unpacked_one_as_before():
    shape = model_shape("small", dtype_bytes=4)
    batch = Batch(tuple((1, 64) for _ in range(8)), 8, 8)
    with_tables, without = CostModel(Calibrated(_profile(PACKED))), CostModel(Calibrated(_profile(UNPACKED)))
    unpacked = _gemm_phases(with_tables.forward(shape, batch))
    packed = _gemm_phases(with_tables.forward(shape, batch, packed=True))
    assert unpacked == _gemm_phases(without.forward(shape, batch))  # the scorers' price: unchanged
    # Packed, the MLP's gate and up run as one grouped product (model/packed.py), at half the unpacked price.
    src, weights = Calibrated(_profile(UNPACKED)), shape.weight_bytes
    want = [
        tuple(shape.layers * x / 2 for x in src.gemm(8, k, n, 4, 1, weights))
        for k, n in shape.layer_gemms(True)
    ]
    want.append(tuple(x / 2 for x in src.gemm(8, *shape.head_gemm(), 4, 1, weights)))
    assert len(packed) == len(unpacked) - 1
    for (f, m), (pf, pm) in zip(want, packed, strict=True):
        assert pf == pytest.approx(f) and pm == pytest.approx(m)
    # A profile that timed no packed weights prices a packed forward (grouped) by its unpacked tables.
    priced = _gemm_phases(without.forward(shape, batch, packed=True))
    assert [x for pair in priced for x in pair] == pytest.approx([2 * x for pair in want for x in pair])


def test_the_fit_takes_the_actors_packed_gemms_out_of_its_forwards_and_the_scorers_unpacked():
    """Made-up forward times: the actor's are its packed projections plus the fitted terms, the reward's its
    unpacked ones plus the same terms. The fit recovers the terms exactly (before, it took the actor's
    unpacked projections out: its residuals went negative and the non-negative fit zeroed the terms)."""
    true = dict(forward_s=1e-4, layer_s=2e-5, pair_s=1e-9, kv_byte_s=1e-11, token_hidden_s=1e-9, logit_s=1e-9)
    probe = Calibrated(_profile(dataclasses.replace(PACKED, gemm_scale=1.0)))
    actor = model_shape("small", dtype_bytes=4, name="actor")
    reward = model_shape("small", head="score", dtype_bytes=4, name="reward")
    points = []
    for shape, role in ((actor, "actor"), (reward, "reward")):
        for point in FORWARD_GRID:
            batch = _batch(role, *point)
            packed = role == "actor"

            def gemm(m, k, n, shape=shape, packed=packed):
                return max(probe.gemm(m, k, n, 4, 1, shape.weight_bytes, packed))

            seconds = shape.layers * sum(gemm(batch.tokens, k, n) for k, n in shape.layer_gemms())
            seconds += gemm(batch.head_rows, *shape.head_gemm())
            logit_rows = batch.head_rows if shape.head == "lm" else 0
            pairs = sum(attention_pairs(n, c) for n, c in batch.chunks)
            seconds += (
                true["forward_s"]
                + true["layer_s"] * shape.layers
                + true["pair_s"] * shape.layers * shape.q_width * pairs
                + true["kv_byte_s"] * shape.layers * shape.kv_width * 8 * sum(c for _, c in batch.chunks)
                + true["token_hidden_s"] * shape.layers * batch.tokens * shape.hidden
                + true["logit_s"] * logit_rows * shape.vocab
            )
            points.append((shape, role, point, seconds))
    costs = _fit_with(points, PACKED, free_scale=False)
    assert costs.fit_error < 1e-9
    for name in ("pair_s", "kv_byte_s", "token_hidden_s", "logit_s"):
        assert getattr(costs, name) == pytest.approx(true[name], rel=1e-6), name
    # Both models have one depth, so the fit sees the per-forward and per-layer costs only as their sum.
    fixed = costs.forward_s + costs.layer_s * actor.layers
    assert fixed == pytest.approx(true["forward_s"] + true["layer_s"] * actor.layers, rel=1e-6)


def _rollout_s(profile: Profile, packed_weights) -> float:
    config = EngineConfig(batch_size=4, mode="sequential", packed_weights=packed_weights)
    p = plan("small", reward="small", device=profile, gpus=1, placement="cpu", batch_size=4, lengths=16,
             prompt_lengths=8, steps=1, modes=("sequential",), config=config)  # fmt: skip
    return p.modes["sequential"].rollout_s


def test_the_twin_prices_the_engines_actor_packed_on_the_cpu_as_its_config_says():
    packed_profile, unpacked_profile = _profile(PACKED), _profile(UNPACKED)
    # The engine's CPU default ("auto") and True pack the actor: its forwards cost less with the packed
    # tables; False does not: the unpacked price, the same as a profile without packed tables.
    assert _rollout_s(packed_profile, "auto") == _rollout_s(packed_profile, True)
    assert _rollout_s(packed_profile, "auto") < _rollout_s(packed_profile, False)
    assert _rollout_s(packed_profile, False) == _rollout_s(unpacked_profile, "auto")


def test_the_chunk_prior_prices_the_actors_decode_packed():
    cost = CostModel(Calibrated(_profile(PACKED)))
    shapes = {"actor": model_shape("small", dtype_bytes=4), "reward": model_shape("small", head="score")}

    def decode_s(packed: bool) -> float:
        return predicted_profile(cost, shapes, (16,), batch_size=4, running=4, prompt_len=16, response_len=16,
                                 local={"reward"}, packed=packed).decode_iter_s  # fmt: skip

    decode = cost.forward(shapes["actor"], Batch(tuple((1, 24) for _ in range(4)), 4, 4), packed=True)
    assert decode_s(True) == decode.alone_s < decode_s(False)


def test_a_profile_with_packed_tables_survives_its_file(tmp_path):
    profile = _profile(PACKED)
    assert Profile.load(profile.save(tmp_path / "p.json")) == profile


def test_grouped_products_are_priced_as_the_engine_runs_them():
    """The packed actor's projections as ``model/packed.py`` groups them: gate and up as one product for
    every family the twin prices, and q, k and v as one for transformers' Llama (its fused attention)."""
    from transformers import LlamaConfig, Qwen2Config

    dims = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=100)  # fmt: skip
    llama, qwen2 = model_shape(LlamaConfig(**dims)), model_shape(Qwen2Config(**dims))
    assert llama.fused_qkv and not qwen2.fused_qkv and not model_shape("small").fused_qkv
    alone = [(64, 64), (64, 32), (64, 32), (64, 64), (64, 96), (64, 96), (96, 64)]
    assert llama.layer_gemms() == qwen2.layer_gemms() == alone
    assert llama.layer_gemms(grouped=True) == [(64, 128), (64, 64), (64, 192), (96, 64)]
    assert qwen2.layer_gemms(grouped=True) == [(64, 64), (64, 32), (64, 32), (64, 64), (64, 192), (96, 64)]
    assert model_shape(llama, head="value").fused_qkv  # a head swap keeps it


def test_the_actors_packs_are_priced_again_after_every_weight_update():
    """``update_policy()`` drops the actor's packs and its next forward makes them again
    (``model/packed.py``): the twin's actor runs ``CostModel.repack`` before its first forward and before
    the first one after each weight update, and never otherwise; a GPU's (no packs) never."""
    from oppo_engine.model.runner import SeqChunk
    from oppo_engine.sim.cost import Work
    from oppo_engine.sim.models import TwinActor

    costs = dataclasses.replace(PACKED, repack_s=3e-5, repack_byte_s=2e-10)
    cost = CostModel(Calibrated(_profile(costs)))
    shape = model_shape("small", dtype_bytes=4)
    repack = 3e-5 * shape.packs() + 2e-10 * shape.packed_bytes()
    assert cost.repack(shape) == Work(0.0, 0.0, ((0.0, repack),), 1)

    class Cache:
        def token_counts(self, ids):
            return [4 for _ in ids]

    class Seq:
        prompt_ids = [1, 2, 3]

    class Samples:
        rows, positions = [0], [3]

        def __len__(self):
            return 1

    def forwards(packed: bool, updates: list[bool]) -> list[bool]:
        """Per forward, whether a repack ran before it (``weights_updated()`` where ``updates`` says)."""
        works = []
        actor = TwinActor(shape, cost, Cache(), lambda: {1: Seq()}, lambda seq: 99, works.append,
                          captured=False, threads=lambda: 1, packed=packed)  # fmt: skip
        seen = []
        for update in updates:
            if update:
                actor.weights_updated()
            before = len(works)
            actor.forward([SeqChunk(1, [5], [3])], Samples())
            seen.append(len(works) - before == 2 and works[before] == cost.repack(shape))
        return seen

    assert forwards(True, [False, False, True, False, True]) == [True, False, True, False, True]
    assert forwards(False, [False, True, False]) == [False, False, False]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_the_twins_packs_are_the_engines(family):
    """``ModelShape.packs`` and ``packed_bytes`` (what the repacking is priced by) count what the engine's
    ``PackedLinears`` holds after a forward: every projection's pack and the grouped products' stacked
    copies (gate and up; q, k and v in Llama, whose attention the engine fuses)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    from oppo_engine.model import fused  # noqa: F401  (registers the groups its forwards call)
    from oppo_engine.model.packed import PackedLinears

    dims = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=100)  # fmt: skip
    config = {"llama": LlamaConfig, "qwen2": Qwen2Config}[family](**dims)
    packs = PackedLinears(AutoModelForCausalLM.from_config(config).eval(), 4)
    with torch.inference_mode(), packs.applied():
        pass
    shape = model_shape(config, dtype_bytes=4)
    assert packs.ungrouped == 0 and (packs.held, packs.nbytes) == (shape.packs(), shape.packed_bytes())
    assert shape.packs() == 3 * (7 + (2 if family == "llama" else 1)) + 1
