"""The published rows the twin is checked against (bench/published.py): every row names its page, GPU and
role; no constant comes from a check row's page; what the twin cannot express is refused by name; and the
FLOP convention the update charges is the one the cited MFU was measured in."""

from __future__ import annotations

import re
from dataclasses import replace

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


# -- the GEMM ridge: max(c, m) plus the unhidden share of the shorter term, fitted to the gemm source rows --


@pytest.mark.parametrize("a", [0.0, 0.37, 0.54, 1.0])
def test_ridge_gemm_is_the_bare_max_far_from_the_ridge_and_one_plus_unhidden_on_it(a):
    from oppo_engine.sim.cost import ridge_gemm

    assert ridge_gemm(2.0, 2.0, a) == (2.0 * (1 + a), 2.0)  # on the ridge: neither roof is reached
    for c, m in ((1.0, 1e-7), (1e-7, 1.0)):  # far from it (a decode's one row: ~1/134 on an A100)
        f, s = ridge_gemm(c, m, a)
        assert max(f, s) == pytest.approx(1.0, rel=1e-6)
        assert min(f, s) == min(c, m)  # the shorter term, what the GEMM demands of that resource, is kept
    assert max(ridge_gemm(3.0, 1.0, a)) == 3.0 + a * 1.0
    assert max(ridge_gemm(3.0, 1.0, 0.0)) == max(3.0, 1.0) and max(ridge_gemm(3.0, 1.0, 1.0)) == 4.0


def test_the_roofline_prices_every_gemm_with_its_devices_unhidden_share():
    """Decode (one row), a 128-token prefill at the A100's ridge and 2,048 rows, through ``forward``."""
    from bench.published import LLAMA2_7B

    dev = device("a100-80gb")
    f = dev.fractions
    src = roofline(dev).source
    for m in (1, 128, 2048):
        c = 2.0 * m * 4096 * 11008 / (dev.bf16_flops * f.gemm)
        b = (4096 * 11008 + m * 4096 + m * 11008) * 2 / (dev.hbm_bandwidth * f.stream)
        assert max(src.gemm(m, 4096, 11008, 2)) == pytest.approx(max(c, b) + f.gemm_unhidden * min(c, b))
    one = max(src.gemm(1, 4096, 11008, 2))
    assert one == pytest.approx(max(src.gemm(2, 4096, 11008, 2)), rel=0.01)  # decode: memory-bound still
    work = roofline(dev).forward(LLAMA2_7B, Batch(((128, 128),), 1, 1), captured=True)
    gemms = sum(LLAMA2_7B.layers * max(src.gemm(128, k, n, 2)) for k, n in LLAMA2_7B.layer_gemms())
    assert sum(max(p) for p in work.phases[: len(LLAMA2_7B.layer_gemms())]) == pytest.approx(gemms)


def test_the_gemm_fit_recovers_the_unhidden_share_it_was_given():
    from bench.published import ROWS, gemm_fit

    dev = device("h100")
    bare = roofline(replace(dev, fractions=replace(dev.fractions, gemm_unhidden=0.0))).source
    made = []
    for r in (r for r in ROWS if r.kind == "gemm" and r.device == "h100"):
        terms = bare.gemm(r.settings["m"], r.settings["k"], r.settings["n"], 2)
        made.append(replace(r, figure=max(terms) + 0.3 * min(terms)))  # test inputs, not measurements
    assert gemm_fit(made)["h100"]["unhidden"] == pytest.approx(0.3, rel=1e-9)


def test_the_tables_unhidden_shares_are_the_fit_of_the_gemm_source_rows():
    from bench.published import ROWS, gemm_fit

    fit = gemm_fit()
    assert set(fit) == {"a100-80gb", "h100"}
    for key, field_ in (("a100-80gb", "AMPERE"), ("h100", "HOPPER")):
        assert device(key).fractions.gemm_unhidden == round(fit[key]["unhidden"], 2)
        assert fit[key]["fitted"][0] == pytest.approx(1.0, abs=0.06)  # the median row, within 6%
        rows = [r for r in ROWS if r.key in fit[key]["rows"]]
        assert len(rows) == 28 * (2 if key == "a100-80gb" else 1)
        assert all(r.role == "source" and r.constant == f"devices.py: {field_}.gemm_unhidden" for r in rows)
        assert all("github.com/microsoft/vidur" in r.url and "@7d47513" in r.url for r in rows)


def test_published_lists_the_gemm_source_rows_and_their_fit(capsys):
    from bench import bench_twin
    from bench.published import ROWS

    assert bench_twin.published(None) == 0
    out = capsys.readouterr().out
    for r in ROWS:
        assert r.key in out
    assert "a100-80gb: a = 0.539" in out and "h100: a = 0.371" in out
