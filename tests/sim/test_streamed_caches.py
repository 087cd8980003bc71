"""Two CPU terms of profile version 8, checked as formulas (made-up constants: test inputs, not measurements).

- The weights' streaming by product size (``ThreadCosts.streaming_products``): a product reads its weights at
  least as fast as a sweep of products of its own size out of memory, so its memory term is its bytes over the
  larger of the working-set table's bandwidth and the product-size table's.
- The fixed costs after the caches are taken (``ThreadCosts.evicted``): a forward's fixed costs gain the
  excess its model's weight bytes give (per forward and per layer, interpolated in log bytes), charged to
  every role's forward and taken out of the fitted forwards as priced, so the fitted constants are the same
  with or without it.
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from oppo_engine.sim.calibration import EVICTED_MB, FORWARD_GRID, _fit_evicted, _fit_with, _fixed_costs
from oppo_engine.sim.cost import HostCosts
from oppo_engine.sim.profile import Calibrated, Profile, ThreadCosts
from oppo_engine.sim.shapes import ModelShape, model_shape

from .test_profile_fit import FREE_GEMMS, TRUE
from .test_profile_fit import forward_s as fitted_terms_s

MIB = float(1 << 20)
# bench_twin's ``mid`` shape (6 layers, hidden 384, intermediate 1024, 6 heads over 2, vocabulary 512):
# 37.5 MiB of float32 weights, past the 32 MiB cache where the excess is a few hundred microseconds.
MID = ModelShape("mid", 6, 384, 6, 2, 64, 1024, 512, False, 4)
EVICTED = [(1 * MIB, 1e-5, 1e-6, 12), (16 * MIB, 1e-4, 2e-5, 12), (128 * MIB, 4e-4, 1e-5, 12)]


def costs(**fields) -> ThreadCosts:
    return dataclasses.replace(FREE_GEMMS, **fields)


def profile(ts: ThreadCosts) -> Profile:
    return Profile("test-cpu", "cpu", {1: ts}, HostCosts(0.0, 0.0, 0.0), 1e12, cores=1.0)


def test_the_excess_after_the_caches_are_taken_interpolates_in_log_bytes():
    c = costs(evicted=EVICTED)
    assert c.evicted_s(16 * MIB, 4) == pytest.approx(1e-4 + 4 * 2e-5)
    middle = math.sqrt(16 * 128) * MIB  # halfway in log bytes: each term halfway
    assert c.evicted_s(middle, 4) == pytest.approx((1e-4 + 4e-4) / 2 + 4 * (2e-5 + 1e-5) / 2)
    assert c.evicted_s(1024 * MIB, 4) == pytest.approx(4e-4 + 4 * 1e-5)  # held past the largest
    assert c.evicted_s(0.25 * MIB, 4) == pytest.approx((1e-5 + 4 * 1e-6) * 0.25)  # in proportion below
    assert c.evicted_s(0.0, 4) == 0.0
    assert costs(evicted=[(MIB, -1e-4, 1e-6, 12)]).evicted_s(MIB, 2) == 0.0  # never negative
    # the per-layer part up to the deepest copy measured (12 layers), not extrapolated past it
    assert c.evicted_s(16 * MIB, 30) == pytest.approx(1e-4 + 12 * 2e-5)
    assert costs().evicted_s(64 * MIB, 4) == 0.0  # not measured: nothing charged


def test_every_roles_forward_pays_the_excess_at_its_models_weight_bytes():
    actor, reward = MID, MID.with_head("score")
    hot = Calibrated(profile(costs(forward_s=1e-4, layer_s=2e-5)))
    taken = Calibrated(profile(costs(forward_s=1e-4, layer_s=2e-5, evicted=EVICTED)))
    for shape, actor_role in ((actor, True), (reward, False)):
        extra = costs(evicted=EVICTED).evicted_s(shape.weight_bytes, shape.layers)
        assert extra > 0
        got, base = (
            taken.fixed(shape, False, actor=actor_role)[0],
            hot.fixed(shape, False, actor=actor_role)[0],
        )
        assert got - base == pytest.approx(extra)


def test_a_product_reads_at_least_as_fast_as_a_sweep_of_its_own_size():
    table = [(4 * MIB, 1, 10e9), (512 * MIB, 1, 10e9), (4 * MIB, 16, 5e9), (512 * MIB, 16, 5e9)]
    sizes = [(0.5 * MIB, 1, 8e9), (16 * MIB, 1, 40e9), (0.5 * MIB, 16, 4e9), (16 * MIB, 16, 20e9)]
    c = costs(streaming=table, streaming_products=sizes)
    assert c.streaming_bandwidth(64 * MIB, 1) == pytest.approx(10e9)  # no product size: the table
    assert c.streaming_bandwidth(64 * MIB, 1, product_bytes=16 * MIB) == pytest.approx(40e9)
    assert c.streaming_bandwidth(64 * MIB, 1, product_bytes=0.5 * MIB) == pytest.approx(10e9)  # the table's
    # smaller than any product swept: the working-set table's rate alone, not the smallest sweep's
    slow = costs(
        streaming=[(64 * MIB, 1, 5e9)], streaming_products=[(0.5 * MIB, 1, 8e9), (16 * MIB, 1, 40e9)]
    )
    assert slow.streaming_bandwidth(64 * MIB, 1, product_bytes=0.25 * MIB) == pytest.approx(5e9)
    assert slow.streaming_bandwidth(64 * MIB, 1, product_bytes=0.5 * MIB) == pytest.approx(8e9)
    assert c.streaming_bandwidth(64 * MIB, 16, product_bytes=16 * MIB) == pytest.approx(20e9)
    assert c.streaming_bandwidth(64 * MIB, 1, product_bytes=64 * MIB) == pytest.approx(40e9)  # held
    packed = dataclasses.replace(c, streaming_packed=table, streaming_products_packed=[(16 * MIB, 1, 30e9)])
    assert packed.streaming_bandwidth(64 * MIB, 1, True, 16 * MIB) == pytest.approx(30e9)
    assert packed.streaming_bandwidth(64 * MIB, 1, False, 16 * MIB) == pytest.approx(40e9)
    # The priced memory term of a 1024 x 4096 float32 product (16 MiB) at one row: its bytes at 40 GB/s.
    _, memory = Calibrated(profile(c)).gemm(1, 1024, 4096, 4, working_set=64 * MIB)
    assert memory == pytest.approx(16 * MIB / 40e9)


def test_the_fit_takes_the_excess_out_as_priced():
    """Made-up forwards of ``mid`` (37.5 MiB: an excess of a few hundred microseconds) with the excess in
    them: the per-token constants fit to their true values, as without the excess; fitted without the
    excess in the profile, they would absorb it."""
    actor = MID
    ts = costs(forward_s=TRUE["forward_s"], layer_s=TRUE["layer_s"], evicted=EVICTED)
    extra = ts.evicted_s(actor.weight_bytes, actor.layers)
    points = [(actor, "actor", p, fitted_terms_s(actor, "actor", p, TRUE) + extra) for p in FORWARD_GRID]
    fit = ("pair_s", "kv_byte_s", "token_hidden_s", "logit_s")
    got = _fit_with(points, ts, free_scale=False, fit=fit)
    assert got.pair_s == pytest.approx(TRUE["pair_s"], rel=1e-6)
    assert got.token_hidden_s == pytest.approx(TRUE["token_hidden_s"], rel=1e-6)
    assert got.fit_error < 1e-9
    blind = _fit_with(points, dataclasses.replace(ts, evicted=[]), free_scale=False, fit=fit)
    assert blind.fit_error > 1e-6 or blind.token_hidden_s != pytest.approx(TRUE["token_hidden_s"], rel=1e-3)


def test_the_shrunk_copies_fixed_costs_are_fitted_around_their_own_small_excess():
    """The copies' forwards (a few hundred KiB of weights) carry the excess at their own bytes, in proportion
    below the smallest measured size; ``_fixed_costs`` takes it out and recovers the fixed costs."""
    tiny = model_shape("tiny", dtype_bytes=4, name="actor")
    copies = [dataclasses.replace(tiny, layers=d) for d in (1, 4)]
    copies += [dataclasses.replace(tiny.with_head("score"), layers=d) for d in (1, 4)]
    ts = costs(evicted=EVICTED)
    points = []
    for shape in copies:
        role = "actor" if shape.head == "lm" else "reward"
        for p in ((1, 1, 0), (1, 1, 1), (1, 2, 0)):
            seconds = fitted_terms_s(shape, role, p, {**TRUE, "pair_s": 0, "kv_byte_s": 0,
                                                       "token_hidden_s": 0, "logit_s": 0})  # fmt: skip
            points.append((shape, role, p, seconds + ts.evicted_s(shape.weight_bytes, shape.layers)))
    got = _fixed_costs(points, ts)
    assert got.forward_s == pytest.approx(TRUE["forward_s"], rel=1e-6)
    assert got.layer_s == pytest.approx(TRUE["layer_s"], rel=1e-6)


def test_the_excess_is_split_per_forward_and_per_layer_over_the_two_depths():
    """Made-up timings of copies at depths 1 and 12: at each streamed size the excess over back to back is
    0.3 ms + 20 us a layer; a negative slope (noise) keeps the per-layer part at 0 and the mean excess."""
    best = {(d, 0): 1e-3 + 1e-4 * d for d in (1, 12)}
    best |= {(d, mib): best[d, 0] + 3e-4 + 2e-5 * d for d in (1, 12) for mib in EVICTED_MB}
    got = _fit_evicted(best, 1, 12)
    assert [b for b, *_ in got] == [float(mib << 20) for mib in EVICTED_MB]
    for _, per_forward, per_layer, deepest in got:
        assert per_forward == pytest.approx(3e-4) and per_layer == pytest.approx(2e-5) and deepest == 12
    best |= {(12, mib): best[12, 0] + 2e-4 for mib in EVICTED_MB}  # the deeper copy gains less
    for _, per_forward, per_layer, _ in _fit_evicted(best, 1, 12):
        assert per_layer == 0.0 and per_forward == pytest.approx((3.2e-4 + 2e-4) / 2)


def test_a_version_8_profile_keeps_both_tables_through_a_save(tmp_path):
    ts = costs(
        streaming=[(64 * MIB, 1, 10e9)],
        streaming_products=[(16 * MIB, 1, 40e9)],
        streaming_products_packed=[(16 * MIB, 1, 30e9)],
        evicted=EVICTED,
    )
    path = profile(ts).save(tmp_path / "v8.json")
    loaded = Profile.load(path).costs_at(1)
    assert loaded.streaming_products == ts.streaming_products
    assert loaded.streaming_products_packed == ts.streaming_products_packed
    assert loaded.evicted == ts.evicted
    assert loaded.evicted_s(16 * MIB, 4) == ts.evicted_s(16 * MIB, 4)
