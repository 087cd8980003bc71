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
    assert "a100-80gb: floor 3.94 us, fraction 0.602" in out and "h100: floor 3.13 us, fraction 0.765" in out


# -- the elementwise kernels: a floor each plus their bytes, fitted to the elementwise source rows -----------


def test_a_layers_elementwise_is_six_floors_plus_its_bytes_at_the_elementwise_bandwidth():
    """Llama-2-7B on the A100 at 128 tokens, by hand: (10 h + 2 q + 2 kv + 3 I) = 90,368 two-byte elements
    a token; a layer's 6 kernels a floor each; the logits' 3 reads of 4 bytes at ``stream``, as before."""
    from bench.published import LLAMA2_7B
    from oppo_engine.sim.cost import ELEMENTWISE_KERNELS, elementwise_bytes

    dev = device("a100-80gb")
    f = dev.fractions
    assert ELEMENTWISE_KERNELS == 6
    assert elementwise_bytes(LLAMA2_7B) == 180_736
    layer = 6 * f.elementwise_floor_s + 128 * 180_736 / (2.039e12 * f.elementwise)
    logits = 3 * 32_000 * 4 / (2.039e12 * f.stream)
    src = roofline(dev).source
    assert src.elementwise(LLAMA2_7B, 128, 1) == pytest.approx(32 * layer + logits, rel=1e-12)
    assert src.elementwise(LLAMA2_7B, 0, 1) == pytest.approx(logits, rel=1e-12)  # no tokens: no kernel
    # one token still pays the floors: 6 x 32 of them, whatever its bytes
    assert src.elementwise(LLAMA2_7B, 1, 0) > 6 * 32 * f.elementwise_floor_s


def test_the_vidur_kernels_bytes_are_the_twins_layer_with_the_add_twice():
    from bench.published import ELEMENTWISE_OPS, LLAMA2_7B, LLAMA3_8B, elementwise_op_bytes
    from oppo_engine.sim.cost import elementwise_bytes

    for shape in (LLAMA2_7B, LLAMA3_8B):
        ops = sum(elementwise_op_bytes(shape, op) for op in ELEMENTWISE_OPS)
        assert ops + elementwise_op_bytes(shape, "add") == elementwise_bytes(shape)
    with pytest.raises(ValueError, match="emb"):
        elementwise_op_bytes(LLAMA2_7B, "emb")


def test_a_captured_forward_pays_the_floors_and_an_eager_one_the_larger_of_launches_and_kernels():
    """The floor is device time, a launch host time: ``Work`` takes their max, never the sum."""
    from bench.published import LLAMA2_7B

    dev = device("h100")
    cost = roofline(dev)
    batch = Batch(((1, 128),), 1, 1)
    captured = cost.forward(LLAMA2_7B, batch, captured=True)
    eager = cost.forward(LLAMA2_7B, batch, captured=False)
    floors = 32 * 6 * dev.fractions.elementwise_floor_s
    assert captured.phases == eager.phases and captured.phases[-2][1] > floors
    assert captured.launch_s == dev.launch_s
    assert eager.alone_s == pytest.approx(eager.host_s + max(eager.launch_s, eager.kernels_s()))
    assert eager.alone_s < eager.host_s + eager.launch_s + eager.kernels_s()


def test_the_calibrated_cpu_profile_prices_its_elementwise_as_before():
    """A CPU profile's elementwise is its own timed cost per token and hidden unit and per logit: no floor,
    no device fraction (made-up constants, a test input)."""
    from oppo_engine.sim.cost import CostModel, HostCosts
    from oppo_engine.sim.profile import Calibrated, Profile, ThreadCosts
    from oppo_engine.sim.shapes import model_shape

    costs = ThreadCosts({16384: [(1, 2e9), (256, 5e10)]}, 1e10, 1e-4, 2e-5, 1e-10, 1e-11, 3e-9, 7e-9, 0.05)
    src = Calibrated(Profile("cpu:test", "cpu", {1: costs}, HostCosts(2e-5, 3e-6, 5e-6), 5e9, cores=2))
    shape = model_shape("small", dtype_bytes=4)
    for tokens, rows in ((1, 1), (8, 8), (300, 2), (0, 1)):
        want = 3e-9 * shape.layers * tokens * shape.hidden + 7e-9 * rows * shape.vocab
        assert src.elementwise(shape, tokens, rows) == pytest.approx(want, rel=1e-12)
    work = CostModel(src).forward(shape, Batch(((5, 20), (1, 40)), 2, 2))
    assert work.phases[-2] == (
        0.0,
        pytest.approx(3e-9 * shape.layers * 6 * shape.hidden + 7e-9 * 2 * shape.vocab),
    )
    assert src.fixed(shape, True) == src.fixed(shape, False) == (1e-4 + 2e-5 * shape.layers, 0.0)


def _made_elementwise(key: str, floor: float, fraction: float) -> list:
    """The ``elementwise`` source rows of ``key`` with figures made from a known floor and fraction (test
    inputs, not measurements)."""
    from bench.published import ROWS, _cell_bytes

    bw = device(key).hbm_bandwidth * fraction
    mine = [r for r in ROWS if r.kind == "elementwise" and r.device == key]
    return [replace(r, figure=floor + _cell_bytes(r) / bw) for r in mine]


@pytest.mark.parametrize("key", ["a100-80gb", "h100"])
def test_the_elementwise_fit_recovers_the_floor_and_fraction_it_was_given(key):
    from bench.published import elementwise_fit

    fit = elementwise_fit(_made_elementwise(key, 2.5e-6, 0.55))[key]
    assert fit["floor_s"] == pytest.approx(2.5e-6, rel=1e-9)
    assert fit["fraction"] == pytest.approx(0.55, rel=1e-9)
    assert fit["fitted"] == pytest.approx((1.0, 1.0, 1.0), rel=1e-9)


def test_the_elementwise_fit_refuses_a_layer_missing_a_cell():
    from bench.published import elementwise_fit

    rows = _made_elementwise("h100", 2.5e-6, 0.55)
    with pytest.raises(ValueError, match="lacks mlp_act"):
        elementwise_fit([r for r in rows if r.key != "vidur-h100-llama2-7b-act-t64"])


def test_the_tables_elementwise_constants_are_the_fit_of_the_elementwise_source_rows():
    from bench.published import ELEMENTWISE_TOKENS, ROWS, elementwise_fit

    fit = elementwise_fit()
    assert set(fit) == {"a100-80gb", "h100"}
    assert ELEMENTWISE_TOKENS == tuple(2**i for i in range(13))
    for key, field_, profiles in (("a100-80gb", "AMPERE", 2), ("h100", "HOPPER", 1)):
        f = device(key).fractions
        assert f.elementwise == round(fit[key]["fraction"], 2)
        assert f.elementwise_floor_s == pytest.approx(round(fit[key]["floor_s"] * 1e6, 1) * 1e-6, rel=1e-12)
        assert fit[key]["layers"] == 13 * profiles
        rows = [r for r in ROWS if r.key in fit[key]["rows"]]
        assert len(rows) == 5 * 13 * profiles
        for r in rows:
            assert r.role == "source" and r.unit == "s" and r.url and r.gpu and r.software
            assert r.constant == f"devices.py: {field_}.elementwise, {field_}.elementwise_floor_s"
            assert "github.com/microsoft/vidur" in r.url and "@7d47513" in r.url
            assert f"num_tokens {r.settings['tokens']}," in r.quote
            assert f"time_stats.{r.settings['op']}.median" in r.quote
    for h in (device("h200"), device("gh200")):  # Hopper's for every Hopper device
        assert h.fractions.elementwise_floor_s == device("h100").fractions.elementwise_floor_s
