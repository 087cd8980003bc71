"""The actor's packed products as its forward calls them.

A bare GEMM is timed in a loop of one product: its weights and oneDNN's code and state stay hot in the
core's caches and predictors. Inside the engine's actor forward the interpreter's work between two products
has taken them, and a product takes longer: measured on ``small``'s actor, 1.2-2.0x its bare time at 1-32
rows, 1.04-1.2x at 128-512 (1.06-1.4x on its shrunk copies' products, which the fixed costs fitted from
the copies absorbed, a layer's worth, while ``small``'s larger products lost more: its decode forwards were
priced 7-16% low in the matrix, the column predicted fast from every row). ``calibrate`` now times each packed
product inside the actor's forwards and its copies' (``_time_packed_calls``), keeps its ratio to the bare
price where that price is the product's compute term (``_packed_in_forward``), and the twin scales that term
by it (``ThreadCosts.packed_in_forward``): the actor's packed products only, the scorers' unpacked ones as
before. Times and tables here are made up (a test input, not a measurement)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from engine_models import SMALL_LINEAR_SKIP, small_linear_reproduces_onednn

from oppo_engine import ops
from oppo_engine.sim.calibration import (
    CALL_REPEATS,
    PACK_HINT,
    SHRUNK_GRID,
    _batch,
    _fixed_costs,
    _linear,
    _packed_in_forward,
    _time_packed_calls,
)
from oppo_engine.sim.cost import Batch, CostModel, HostCosts
from oppo_engine.sim.profile import EXCESS_SIZE_EXPONENT, Calibrated, Profile, ThreadCosts
from oppo_engine.sim.shapes import model_shape

from .test_fixed_costs import TINY, shrunk_config, shrunk_depths

# Made-up tables: flat per-call GEMMs (a dispatch's 10 us, then FLOPs) and a fast streaming table, so that
# the small products here are priced by their compute term.
GEMM = {kn: [(1, 2.0 * kn / 1e-5), (16, 2.0 * 16 * kn / 2e-5), (256, 2.0 * 256 * kn / 2e-4)]
        for kn in (2048, 16384, 180224)}  # fmt: skip
STREAMING = [(1e6, 1, 1e12), (1e9, 1, 1e12), (1e6, 16, 1e12), (1e9, 16, 1e12)]
PACKED = ThreadCosts(GEMM, 1e10, 0, 0, 0, 0, 0, 0, 0, STREAMING, gemm_packed=GEMM, streaming_packed=STREAMING)
# Inside a forward: 1.5x at one row, 1.2x at sixteen, at every size (measured up to 1 M elements: every
# product of the models here is within the sizes measured).
RATIOS = {kn: [(1, 1.5), (16, 1.2)] for kn in (2048, 1 << 20)}
IN_FORWARD = dataclasses.replace(PACKED, packed_in_forward=RATIOS)


def _source(costs: ThreadCosts) -> Calibrated:
    return Calibrated(Profile("cpu:test", "cpu", {1: costs}, HostCosts(0, 0, 0), 1.0))


def test_a_packed_product_is_priced_as_the_actors_forward_calls_it():
    bare, inside = _source(PACKED), _source(IN_FORWARD)
    # Linear in rows between the measured ones, held past them.
    for m, want in ((1, 1.5), (16, 1.2), (8, 1.5 - 0.3 * 7 / 15), (64, 1.2)):
        for k, n in ((64, 32), (256, 704), (704, 256)):
            f, mem = inside.gemm(m, k, n, 4, 1, 1e7, packed=True)
            f0, mem0 = bare.gemm(m, k, n, 4, 1, 1e7, packed=True)
            assert f == pytest.approx(want * f0) and mem == mem0
            # The scorers' unpacked products: their bare price, as before.
            assert inside.gemm(m, k, n, 4, 1, 1e7, packed=False) == bare.gemm(
                m, k, n, 4, 1, 1e7, packed=False
            )
    # Sizes between the measured ones: in log size; past the ends: held.
    assert IN_FORWARD.in_forward(1, 4096) == pytest.approx(1.5)
    assert IN_FORWARD.in_forward(1, 10**7) == pytest.approx(1.5)
    assert PACKED.in_forward(1, 4096) == 1.0

    # A whole forward of the actor: its products' compute terms scale, nothing else moves.
    shape = model_shape("small", dtype_bytes=4, name="actor")
    batch = Batch(tuple((1, 40) for _ in range(1)), 1, 1)
    w0 = CostModel(bare).forward(shape, batch, packed=True, actor=True)
    w1 = CostModel(inside).forward(shape, batch, packed=True, actor=True)
    assert w1.host_s == w0.host_s and w1.phases[-2:] == w0.phases[-2:]
    assert sum(f for f, _ in w1.phases[:-2]) == pytest.approx(1.5 * sum(f for f, _ in w0.phases[:-2]))
    reward = model_shape("small", head="score", dtype_bytes=4, name="reward")
    assert CostModel(inside).forward(reward, batch) == CostModel(bare).forward(reward, batch)


def test_the_ratio_is_measured_where_the_bare_price_is_the_compute_term():
    """Per size and rows, the median call inside the forwards over the bare price; a product whose weights'
    streaming is its price (a wide model's, from memory) is left to the streaming table."""
    # Weights stream fast out of a small working set, slowly out of a large one.
    slow = dataclasses.replace(
        PACKED, streaming_packed=[(w, r, 1e12 if w < 1e7 else 1e8) for w, r, _ in STREAMING]
    )
    bare = _source(PACKED)
    f1 = bare.gemm(1, 64, 32, 4, 1, 1e6, True)[0]
    f16 = bare.gemm(16, 64, 32, 4, 1, 1e6, True)[0]
    calls = {
        (1, 64, 32): (1e6, [1.4 * f1, 1.5 * f1, 9.0 * f1]),  # the median: a burst of load moves one call
        (16, 64, 32): (1e6, [1.2 * f16] * 3),
        (16, 32, 64): (1e6, [1.2 * f16] * 3),  # the other orientation of one size: the same point
        (1, 704, 256): (1e9, [5e-3] * 3),  # 720 KB of weights at 1e8 B/s: priced by its streaming
    }
    ratios = _packed_in_forward(calls, slow, 4)
    assert set(ratios) == {2048}
    assert ratios[2048] == [(1, pytest.approx(1.5)), (16, pytest.approx(1.2))]


def _copies(truth: ThreadCosts, forward_s=1e-4, layer_s=2e-5, own_layer_s=1.8e-5):
    """Made-up forwards of ``TINY``'s shrunk copies (actor and reward) at its two depths: the fixed costs
    (the actor's own per layer beside them) and their projections as ``truth`` prices them, the actor's
    packed and grouped as the engine runs them."""
    src = _source(truth)
    points = []
    for depth in shrunk_depths(TINY.num_hidden_layers):
        config = shrunk_config(TINY, depth)
        for role, head in (("actor", "lm"), ("reward", "score")):
            shape = model_shape(config, head=head, dtype_bytes=4, name=role)
            packed = role == "actor"
            for point in SHRUNK_GRID:
                batch = _batch(role, *point)
                gemms = shape.layers * sum(
                    max(src.gemm(batch.tokens, k, n, 4, 1, shape.weight_bytes, packed))
                    for k, n in shape.layer_gemms(grouped=packed)
                )
                gemms += max(src.gemm(batch.head_rows, *shape.head_gemm(), 4, 1, shape.weight_bytes, packed))
                fixed = forward_s + shape.layers * (layer_s + (own_layer_s if packed else 0.0))
                points.append((shape, role, point, fixed + gemms))
    return points


def test_the_copies_products_slowdown_is_not_fitted_into_the_actors_fixed_costs():
    """The copies' packed products take longer inside their forwards too; priced at their bare time, that
    landed in the actor's fixed cost per layer, which every real layer then paid on top of its own products'
    slowdown. With the measured ratio the fit takes it out with the rest of their projections."""
    copies = _copies(IN_FORWARD)
    fixed = _fixed_costs(copies, IN_FORWARD)
    assert fixed.layer_s == pytest.approx(2e-5, rel=1e-6)
    assert fixed.actor_layer_s == pytest.approx(1.8e-5, rel=1e-6)
    assert fixed.forward_s == pytest.approx(1e-4, rel=1e-6)
    # Without it (a version 5 profile's fit): the products' extra half charged per layer as the actor's own.
    blind = _fixed_costs(copies, PACKED)
    assert blind.actor_layer_s > 1.8e-5 * 1.3


def test_a_version_5_profile_loads_without_the_ratios_and_warns(tmp_path):
    profile = Profile("cpu:test", "cpu", {1: PACKED}, HostCosts(1e-5, 1e-6, 1e-6), 1.0)
    data = {**profile.to_json(), "version": 5}
    for c in data["threads"].values():
        del c["packed_in_forward"]
    path = tmp_path / "v5.json"
    path.write_text(json.dumps(data))
    with pytest.warns(UserWarning, match="version 5 priced the actor's packed products at their bare time"):
        assert Profile.load(path) == profile
    saved = Profile("cpu:test", "cpu", {1: IN_FORWARD}, HostCosts(1e-5, 1e-6, 1e-6), 1.0)
    assert Profile.load(saved.save(tmp_path / "v6.json")) == saved


def test_a_sizes_value_held_past_its_rows_is_not_mixed_with_measured_ones():
    """The LM head's size is called only at the rows sampled (here up to 32, at 1.4x): at 512 rows, where
    the sizes on both sides of it were measured (1.0x), a size between them gets theirs, not the held 1.4x
    (a mix gave mid's 384 x 384 projections 1.26x from small's profile); where no size was measured at
    the rows asked, the held values are all there is."""
    ratios = {16384: [(1, 1.5), (512, 1.0)], 131072: [(1, 1.6), (32, 1.4)], 360448: [(1, 1.3), (512, 1.0)]}
    costs = dataclasses.replace(PACKED, packed_in_forward=ratios)
    assert costs.in_forward(512, 147456) == pytest.approx(1.0)
    assert costs.in_forward(16, 131072) == pytest.approx(1.6 + (16 - 1) / 31 * (1.4 - 1.6))
    assert costs.in_forward(2048, 131072) == pytest.approx(1.0)  # measured neighbours at their last rows
    only_short = dataclasses.replace(PACKED, packed_in_forward={131072: [(1, 1.6), (32, 1.4)]})
    assert only_short.in_forward(512, 131072) == pytest.approx(1.4)
    assert dataclasses.replace(PACKED, packed_in_forward={2048: []}).in_forward(4, 2048) == 1.0


def test_timing_the_products_is_one_at_a_time_and_times_only_its_own_thread():
    """``_time_packed_calls`` swaps ``ops.packed_linear`` process-wide: two calibrations on two threads take
    turns (the original is put back, not a wrapper of a wrapper), and another thread's packed products
    meanwhile run untimed."""
    import threading

    import torch

    from oppo_engine import ops
    from oppo_engine.sim import calibration

    if not ops.packed_linear_supported(torch.ones(8, 8)):
        pytest.skip("no packed products here")
    original = ops.packed_linear
    w = torch.randn(16, 32)
    packed = ops.pack_linear_weight(w, 4)
    x = torch.randn(4, 32)
    inside = threading.Event()
    release = threading.Event()

    class Bench:
        def __init__(self, wait: bool):
            self.wait = wait

        def call(self, *point):
            def fn():
                ops.packed_linear(x, packed, None)
                if self.wait and ops.packed_linear is not original:
                    inside.set()
                    release.wait(10)

            return fn

    results = {}

    def calibrate(name, wait):
        results[name] = calibration._time_packed_calls([(Bench(wait), 1e6, [(4,)])])

    first = threading.Thread(target=calibrate, args=("first", True))
    first.start()
    assert inside.wait(10)
    second = threading.Thread(target=calibrate, args=("second", False))
    second.start()
    ops.packed_linear(x, packed, None)  # this thread's product while the first times its own
    release.set()
    first.join(10)
    second.join(10)
    assert ops.packed_linear is original
    for name in ("first", "second"):
        (key,) = results[name]
        assert key == (4, 32, 16)
        assert len(results[name][key][1]) == calibration.CALL_REPEATS, name  # its own calls only


def test_a_product_larger_than_every_size_measured_is_charged_the_excess_in_seconds():
    """The ratio was measured on the calibration's own products. A larger product (another model's) is
    charged what the largest measured size's ratio added in seconds at its rows, grown as the square root of
    the weights (``EXCESS_SIZE_EXPONENT``), not that ratio: on a ``tiny`` profile (33 K-element products,
    1.5-2.7x at 1-16 rows) gqa8's 1-4 M-element decode products were priced compute-bound, and its steps 19%
    high. Within the sizes measured, nothing changes. A size with no measurement (an empty list) is not the
    largest measured."""
    assert EXCESS_SIZE_EXPONENT == 0.5
    ratios = {2048: [(1, 3.0), (16, 2.0)], 16384: [(1, 2.5)], 1 << 22: []}
    costs = dataclasses.replace(PACKED, packed_in_forward=ratios)
    bare, inside = _source(PACKED), _source(costs)

    def compute(source, m, k, n):
        return source.gemm(m, k, n, 4, 1, 1e7, packed=True)[0]

    # within the sizes measured: the ratio, as before (16 K elements: its own; 2 K - 16 K: in log size)
    assert compute(inside, 1, 128, 128) == pytest.approx(2.5 * compute(bare, 1, 128, 128))
    assert compute(inside, 1, 64, 32) == pytest.approx(3.0 * compute(bare, 1, 64, 32))
    # past them: the largest size's excess at these rows (1.5x of a 16 K product's bare price at one row; at
    # 16 rows 2 K's 2.0 - 1, 16 K measured at one row only), grown as the square root of the weights
    for k, n in ((1024, 4096), (4096, 1024), (384, 1024)):
        grown = (k * n / 16384) ** 0.5
        big, edge = compute(bare, 1, k, n), compute(bare, 1, 128, 128)
        assert compute(inside, 1, k, n) == pytest.approx(big + 1.5 * edge * grown)
        # at 16 rows: the running maximum over rows 1-16 of the same charge, each row at its own ratio
        want = max(
            compute(bare, r, k, n) + (costs.in_forward(r, 16384) - 1) * compute(bare, r, 128, 128) * grown
            for r in range(1, 17)
        )
        assert compute(inside, 16, k, n) == pytest.approx(want)
        # never less for more rows, and never below the bare price (its ratios are all above 1)
        f = [compute(inside, m, k, n) for m in range(1, 40)]
        assert all(b >= a for a, b in zip(f, f[1:], strict=False))
        assert all(x >= compute(bare, m, k, n) for m, x in enumerate(f, start=1))
    # against the ratio held (2.5x): 1024 x 4096's made-up bare price grows faster than the square root of
    # its weights past 16 K, so it is charged less; 384 x 1024's slower (a flat 10 us a call up to 180 K
    # weights), so more -- the excess follows its own law, not the product's
    assert compute(inside, 1, 1024, 4096) < 2.5 * compute(bare, 1, 1024, 4096)
    assert compute(inside, 1, 384, 1024) > 2.5 * compute(bare, 1, 384, 1024)


def test_the_scaled_price_never_falls_with_more_rows():
    """The ratio can fall with rows faster than the bare price grows (measured 1.2-2.0x at 1-32 rows): a
    product scaled alone priced four rows below one (20.1 us against 18.2 us on a profile of ``small``).
    The price is the running maximum over the rows up to ``m``: never less for more rows, and where the
    scaled price itself grows it is unchanged."""
    steep = dataclasses.replace(
        PACKED, packed_in_forward={kn: [(1, 2.0), (4, 1.2), (16, 1.2)] for kn in (2048, 180224)}
    )
    bare, inside = _source(PACKED), _source(steep)
    for k, n in ((64, 32), (256, 704), (704, 256)):
        f = [inside.gemm(m, k, n, 4, 1, 1e7, packed=True)[0] for m in range(1, 300)]
        f0 = [bare.gemm(m, k, n, 4, 1, 1e7, packed=True)[0] for m in range(1, 300)]
        assert 1.2 * f0[3] < 2.0 * f0[0]  # scaled alone, four rows (1.2x) priced below one row (2.0x) ...
        assert all(b >= a for a, b in zip(f, f[1:], strict=False))  # ... but never less for more rows
        assert f[3] == pytest.approx(2.0 * f0[0])  # held at one row's price
        assert f[0] == pytest.approx(2.0 * f0[0]) and f[-1] == pytest.approx(1.2 * f0[-1])  # unchanged


@pytest.mark.skipif(not small_linear_reproduces_onednn(), reason=SMALL_LINEAR_SKIP)
def test_a_few_bf16_rows_are_timed_as_the_engine_multiplies_them():
    """The engine's packs multiply up to ``packed.SMALL_ROWS`` (64) bf16 rows with ``ops.small_linear``
    (bitwise oneDNN's product, faster), more with oneDNN's: the calibration's bare products do the same, and
    its in-forward timing records those calls too."""
    w = (torch.randn(96, 64, generator=torch.Generator().manual_seed(0)) * 0.1).bfloat16()
    spy = []
    real = ops.small_linear
    product = _linear(w, packed=True)
    pack = ops.pack_linear_weight(w, PACK_HINT)
    try:
        ops.small_linear = lambda x, b, r: spy.append(x.shape[0]) or real(x, b, r)
        for rows in (3, 8, 16, 40, 80):
            x = torch.randn(1, rows, 64).bfloat16()
            assert torch.equal(product(x), ops.packed_linear(x, pack, None))
    finally:
        ops.small_linear = real
    # 80 rows: oneDNN's; the probes' own products are not counted (they call the ops themselves)
    assert spy == [3, 8, 16, 40]

    class Bench:  # a "forward" of two products: one of 2 rows, one of 8 (both small_linear)
        @staticmethod
        def call(rows):
            x = torch.randn(1, rows, 64).bfloat16()
            return lambda: product(x)

    calls = _time_packed_calls([(Bench, 1e6, [(2,), (8,)])])
    assert set(calls) == {(2, 64, 96), (8, 64, 96)}
    assert all(len(seconds) == CALL_REPEATS for _, seconds in calls.values())
    assert ops.small_linear is real
