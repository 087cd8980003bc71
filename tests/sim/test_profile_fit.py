"""A profile too small to fit a constant: the calibration marks each per-forward constant whose term stayed
under ``FIT_SHARE`` of every timed forward (its value is noise) with the largest amount of its feature the
calibration's models had, and a plan for a shape with more of that feature is refused with a ValueError
naming the feature. The fit is run on made-up forward times (exact sums of known constants: a test input,
not a measurement)."""

from __future__ import annotations

import dataclasses

import pytest

from oppo_engine.sim import plan
from oppo_engine.sim.calibration import FORWARD_GRID, _batch, _fit_with
from oppo_engine.sim.cost import HostCosts
from oppo_engine.sim.profile import FEATURES, FIT_SHARE, Profile, ThreadCosts
from oppo_engine.sim.shapes import attention_pairs, model_shape

# GEMMs (and weight streaming) priced as free: the made-up forward times are the fitted terms alone.
FREE_GEMMS = ThreadCosts({1: [(1, 1e30)]}, 1e30, 0, 0, 0, 0, 0, 0, 0)
ACTOR = model_shape("tiny", dtype_bytes=4, name="actor")
REWARD = model_shape("tiny", head="score", dtype_bytes=4, name="reward")


def forward_s(shape, role, point, c: dict) -> float:
    """A forward's seconds from the constants ``c``, by the terms the calibration fits."""
    batch = _batch(role, *point)
    pairs = sum(attention_pairs(n, ctx) for n, ctx in batch.chunks)
    context = sum(ctx for _, ctx in batch.chunks)
    logit_rows = batch.head_rows if shape.head == "lm" else 0
    return (
        c["forward_s"]
        + c["layer_s"] * shape.layers
        + c["pair_s"] * shape.layers * shape.q_width * pairs
        + c["kv_byte_s"] * shape.layers * shape.kv_width * 2 * shape.dtype_bytes * context
        + c["token_hidden_s"] * shape.layers * batch.tokens * shape.hidden
        + c["logit_s"] * logit_rows * shape.vocab
    )


TRUE = dict(forward_s=1e-4, layer_s=2e-5, pair_s=1e-9, kv_byte_s=1e-11, token_hidden_s=1e-9, logit_s=1e-9)


def fitted(**constants) -> ThreadCosts:
    c = {**TRUE, **constants}
    points = [
        (s, r, p, forward_s(s, r, p, c))
        for s, r in ((ACTOR, "actor"), (REWARD, "reward"))
        for p in FORWARD_GRID
    ]
    return _fit_with(points, FREE_GEMMS, free_scale=False)


def test_every_constant_with_a_measurable_term_is_fitted():
    costs = fitted()
    assert costs.unfitted == {}
    assert costs.pair_s == pytest.approx(TRUE["pair_s"], rel=1e-6) and costs.fit_error < 1e-9


def test_a_term_the_timed_forwards_do_not_show_is_marked_unfitted_with_the_calibrations_reach():
    """No attention cost in the timed forwards (a model too small for it to show): its constant is noise,
    recorded with the largest layers x query width the calibration ran (the tiny actor's and reward's)."""
    costs = fitted(pair_s=0.0)
    assert set(costs.unfitted) == {"pair_s"}
    assert costs.unfitted["pair_s"] == max(FEATURES["pair_s"][1](s) for s in (ACTOR, REWARD))
    # A term present but below the share in every forward is as unmeasured as an absent one.
    tiny = fitted(pair_s=TRUE["pair_s"] * 1e-4)
    assert "pair_s" in tiny.unfitted and FIT_SHARE == 0.02


def _profile(costs: ThreadCosts) -> Profile:
    return Profile("cpu:test", "cpu", {1: costs}, HostCosts(2e-5, 3e-6, 5e-6), 5e9, cores=2)


def test_a_shape_with_more_of_an_unfitted_feature_is_refused_naming_it(tmp_path):
    gemm = {kn: [(1, 2e9), (16, 2e10), (256, 5e10)] for kn in (16384, 1048576)}
    costs = dataclasses.replace(fitted(pair_s=0.0), gemm=gemm, bandwidth=1e10)
    profile = _profile(costs)
    assert Profile.load(profile.save(tmp_path / "p.json")) == profile  # the mark survives the file
    profile.check_shape(ACTOR, "actor")  # the calibration's own shape: priced
    small = model_shape("small", dtype_bytes=4, name="small")
    assert FEATURES["pair_s"][1](small) > costs.unfitted["pair_s"]
    with pytest.raises(
        ValueError, match=r"could not fit attention per query-key pair .* the actor model \(small"
    ):
        profile.check_shape(small, "actor")
    with pytest.raises(ValueError, match=r"constant pair_s .* too small to price it"):
        plan("small", reward="rule", device=profile, gpus=1, placement="cpu", batch_size=2, lengths=8,
             prompt_lengths=8, steps=1)  # fmt: skip
    fitted_profile = _profile(dataclasses.replace(costs, unfitted={}))
    fitted_profile.check_shape(small, "actor")  # nothing unfitted: nothing refused
