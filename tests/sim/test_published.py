"""The published rows the twin is checked against (bench/published.py): every row names its page, GPU and
role; no constant comes from a check row's page; what the twin cannot express is refused by name; and the
FLOP convention the update charges is the one the cited MFU was measured in."""

from __future__ import annotations

import re

import pytest

from bench.published import LLAMA3_8B, QWEN25_7B, ROWS, Refused, predict
from oppo_engine.sim import baselines
from oppo_engine.sim.cost import Batch, roofline, training_flops
from oppo_engine.sim.devices import DEVICES, device


def test_every_row_names_its_page_gpu_software_settings_quote_and_role():
    keys = [r.key for r in ROWS]
    assert len(keys) == len(set(keys))
    for r in ROWS:
        assert r.role in ("source", "check"), r.key
        assert r.url and r.gpu and r.software and r.settings and r.quote and r.unit, r.key
        assert r.refused or r.device in DEVICES, r.key
        assert r.constant is None or r.role == "source", r.key


def test_no_constant_comes_from_a_check_rows_page():
    sources = {r.url for r in ROWS if r.role == "source"}
    checks = {r.url for r in ROWS if r.role == "check"}
    assert not sources & checks


@pytest.mark.parametrize("key, named", [
    ("torchtitan-h100-96gb-8b", "H100 96 GB HBM2e at 500 W"),
    ("nemo-rl-grpo-llama8b-16xh100", "two DGX-H100 nodes"),
    ("oppo-paper-2node", "two nodes (2x4 A100)"),
    ("trtllm-h100-7b-fp8", "FP8"),
    ("nemo-rl-grpo-llama8b-8xgb200", "GB200"),
    ("verl-dapo-qwen-math-7b-2x16xh20", "H20: not in the device table"),
])  # fmt: skip
def test_a_setting_the_twin_cannot_express_is_refused_by_name(key, named):
    row = next(r for r in ROWS if r.key == key)
    with pytest.raises(Refused, match=re.escape(named)):
        predict(row)


def test_the_update_counts_flops_as_torchtitan_counts_them_for_its_mfu():
    """``6 N + 12 L H q T`` per token (torchtitan/utils.py @0413364): the source row's 2973 tokens/s on an
    A100 (312 TFLOP/s) is the 58.2% it reports, in the twin's count of the same model."""
    seq = 8192
    per_token = training_flops(LLAMA3_8B, [seq], 3.0) / seq
    assert per_token == pytest.approx(6 * LLAMA3_8B.params + 12 * 32 * 4096 * seq)
    assert 2973 * per_token / 312e12 == pytest.approx(0.582, rel=0.01)
    # a recomputed forward adds a third: checkpointing is charged, never counted in an MFU
    assert training_flops(LLAMA3_8B, [seq], 4.0) == pytest.approx(per_token * seq * 4 / 3)
    assert device("a100-80gb").fractions.training_mfu == 0.582


def test_hf_host_time_is_the_source_rows_step_less_the_twins_eager_forward():
    h100 = device("h100")
    floor = (QWEN25_7B.weight_bytes + QWEN25_7B.kv_bytes_per_token * 2048) / h100.hbm_bandwidth
    kernels = roofline(h100).forward(QWEN25_7B, Batch(((1, 2048),), 1, 1), captured=False).alone_s
    assert floor / 0.27 - kernels == pytest.approx(baselines.HF_STEP_HOST_S, abs=0.05e-3)
    row = next(r for r in ROWS if r.key == "hf-eager-h100-qwen7b-b1")
    assert predict(row) == pytest.approx(0.27, rel=0.01)


def _made_rows(figure) -> list:
    """Fixed-batch latency rows whose figures ``figure(prefill, decode, batch)`` makes from the twin's own
    prefill and decode (test inputs, not measurements)."""
    from bench.published import LLAMA2_7B, Published, _latency_parts

    cost = roofline(device("h100"))
    rows = []
    for batch, inp in ((1, 128), (8, 128), (64, 2048), (256, 4096)):
        prefill, decode = _latency_parts(cost, LLAMA2_7B, batch, inp, 20)
        settings = dict(model=LLAMA2_7B, batch=batch, input=inp, output=20)
        made = figure(prefill, decode, batch)
        rows.append(Published(f"t{batch}", "fixed_batch_latency", "source", made, "s", "H100", "h100", "x",
                              settings, "u", "q"))  # fmt: skip
    return rows


def test_the_decode_fit_recovers_the_overhead_and_slope_it_was_given():
    from bench.published import decode_fit

    joint = decode_fit(_made_rows(lambda p, d, b: p + 19 * 3e-3 + 1.25 * d))["h100"]
    assert joint["spread"] > 2  # large batches and contexts: the decode terms differ, the fit is separable
    assert joint["joint_overhead_s"] == pytest.approx(3e-3, rel=1e-6)
    assert joint["joint_slope"] == pytest.approx(1.25, rel=1e-6)
    assert joint["joint_stream"] == pytest.approx(device("h100").fractions.stream / 1.25, rel=1e-6)
    line = decode_fit(_made_rows(lambda p, d, b: p + d + 19 * (2e-3 + 1e-4 * b)))["h100"]
    assert line["overhead_s"] == pytest.approx(2e-3, rel=1e-6)
    assert line["per_row_s"] == pytest.approx(1e-4, rel=1e-6)
