"""The baseline arms of a plan (sim/baselines.py): the TRL-like step is its stated assumptions' formula,
the synchronous engine is sequential plus verl's old-log-prob forward, every mode's speed-up against both
is their ratio, and plan.json states the assumptions."""

from __future__ import annotations

import json

import pytest

from oppo_engine import EngineConfig
from oppo_engine.sim import plan
from oppo_engine.sim.baselines import (
    HF_STEP_HOST_S,
    SYNC_ASSUMPTIONS,
    TRL_ASSUMPTIONS,
    hf_decode_s,
    recompute_forward_s,
    trl_step,
)
from oppo_engine.sim.cost import Batch
from oppo_engine.sim.planner import _setting


def _one_gpu(**changes):
    kw = dict(device="h100", gpus=1, placement="colocated", batch_size=4, lengths=10, prompt_lengths=8,
              config=EngineConfig(), reward_curve=None, epochs=2, minibatch_size=4, weight_bytes=2,
              grad_bytes=2, optimizer_bytes=8, checkpointing=False, fsdp=True, seed=0)  # fmt: skip
    kw.update(changes)
    setting, _ = _setting("0.5b", "0.5b", None, "0.5b", **kw)
    return setting


def test_trl_generation_is_left_padded_mini_batches_of_hf_eager_decode_steps():
    s = _one_gpu()
    cost, actor = s.cost, s.shapes["actor"]
    prefill = cost.forward(actor, Batch(tuple((8, 8) for _ in range(4)), 4), captured=False).alone_s
    decode = sum(hf_decode_s(cost, actor, [8 + k] * 4) for k in range(1, 10))
    got = trl_step(s, steps=1)
    assert got["generation_s"] == pytest.approx(prefill + decode)  # one GPU: no ZeRO-3 gathers
    assert hf_decode_s(cost, actor, [9] * 4) == pytest.approx(
        cost.forward(actor, Batch(((1, 9),) * 4, 4, 4), captured=False).alone_s + HF_STEP_HOST_S
    )
    assert got["s_per_step"] == pytest.approx(
        got["generation_s"] + got["scoring_s"] + got["forwards_s"] + got["update_s"]
    )


def test_zero3_gathers_the_weights_for_every_generation_forward():
    one = trl_step(_one_gpu(gpus=1, batch_size=4), steps=1)["generation_s"]
    two = trl_step(_one_gpu(gpus=2, batch_size=8), steps=1)["generation_s"]  # same 4 prompts a rank
    s = _one_gpu(gpus=2, batch_size=8)
    gather = s.cost.source.collective_s(s.shapes["actor"].weight_bytes, 2)
    assert two == pytest.approx(one + 10 * gather)  # a prefill and 9 decode steps, each gathering


def test_the_plan_prices_both_arms_and_every_modes_speedup_against_them(tmp_path):
    p = plan("0.5b", reward="0.5b", reference="0.5b", device="h100", gpus=2, placement="colocated",
             batch_size=4, lengths="uniform:low=8,high=40", prompt_lengths=8, steps=4, sweep=(16,),
             modes=("sequential", "inter", "trl", "sync"))  # fmt: skip
    trl, sync, seq = p.modes["trl"], p.modes["sync"], p.modes["sequential"]
    for m in p.modes.values():
        assert m.speedup_vs["trl"] == pytest.approx(trl.s_per_step / m.s_per_step)
        assert m.speedup_vs["sync"] == pytest.approx(sync.s_per_step / m.s_per_step)
    assert sync.s_per_step == pytest.approx(seq.s_per_step + sync.phases["old_logprob_forward_s"])
    assert sync.phases["old_logprob_forward_s"] > 0
    assert trl.s_per_step == pytest.approx(sum(trl.phases.values()))
    saved = json.loads(p.save(tmp_path / "plan.json").read_text())
    assert saved["assumptions"] == {"trl": list(TRL_ASSUMPTIONS), "sync": list(SYNC_ASSUMPTIONS)}
    assert "vs trl" in p.table() and "vs sync" in p.table()


def test_the_old_logprob_forward_is_one_packed_actor_forward_of_the_slowest_rank():
    s = _one_gpu(gpus=2, batch_size=8)
    rows = [100, 10, 300, 10]
    flops = 2 * s.shapes["actor"].params * 400 + 4 * 24 * s.shapes["actor"].q_width * (100**2 + 300**2)
    assert recompute_forward_s(s, rows) == pytest.approx(s.cost.source.training_s(flops))


def test_an_unknown_arm_is_refused_naming_the_arms():
    with pytest.raises(ValueError, match="'trl', 'sync'"):
        plan("0.5b", device="h100", gpus=2, batch_size=2, lengths=8, prompt_lengths=8, steps=1, modes=("hf",))
