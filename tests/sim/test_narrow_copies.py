"""The per-token constants fitted with the models' narrow copies, and the packed actor's width ladder.

A wide model's forwards are mostly its projections, so they barely determine the per-token constants
(``pair_s``, ``kv_byte_s``, ``token_hidden_s``, ``logit_s``); and each of their columns scales its kind of
work by one width, where the work is several (the norms and residuals over the hidden size, the MLP's
activation over the intermediate, a cost per token besides), so a constant fitted at one width prices that
width. ``calibrate`` on the CPU times each model's narrow copy (``ladder_head_dims``' first rung:
``shrunk_copy`` at the model's own depth, head_dim ``SHRUNK_HEAD_DIM``) over ``FORWARD_GRID`` and fits those
constants to its forwards and the model's together (``_fit``'s ``narrow``); the packed actor's every rung
times its products in forward at the sizes between its shrunk copies' and its own
(``ThreadCosts.packed_in_forward``). The forward times here are made up (exact sums of known constants, and
a per-token term the columns do not have: a test input, not a measurement)."""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, Qwen2Config

from oppo_engine.sim import calibration
from oppo_engine.sim.calibration import (
    FORWARD_GRID,
    SHRUNK_HEAD_DIM,
    _batch,
    _fit,
    _ladder_copies,
    ladder_head_dims,
    shrunk_config,
)
from oppo_engine.sim.shapes import model_shape

from .test_fixed_costs import GQA8, NIL, TABLES, TRUE, shrunk, timed

# A per-token cost of every layer that no column has: the work per token that does not grow with the hidden
# size (made up; what the engine's forwards show is described in docs/twin.md, "The per-token constants").
PER_TOKEN = 4e-7


def with_per_token(points, per_token=PER_TOKEN):
    """``points`` with ``per_token`` seconds more per layer and token of each forward."""
    return [
        (shape, role, point, s + per_token * shape.layers * _batch(role, *point).tokens)
        for shape, role, point, s in points
    ]


def narrow(config, roles=("actor", "reward"), ts=TABLES):
    """Made-up forwards of ``config``'s narrow copy (its first rung) over ``FORWARD_GRID``."""
    (d, *_) = ladder_head_dims(model_shape(config, dtype_bytes=None).head_dim)
    return timed(shrunk_config(config, config.num_hidden_layers, d), roles, FORWARD_GRID, ts)


def noised(points, noise: float):
    """``points`` each ``1 ± noise`` times as long, alternately (a fixed pattern)."""
    return [(sh, r, p, s * (1 + (noise if i % 2 == 0 else -noise))) for i, (sh, r, p, s) in enumerate(points)]


@pytest.mark.parametrize(
    ("head_dim", "rungs"),
    [(8, ()), (16, ()), (24, (16,)), (32, (16,)), (64, (16, 32)), (128, (16, 32, 64))],
)
def test_the_ladder_runs_from_the_shrunk_head_dim_up_to_below_the_models_own(head_dim, rungs):
    assert ladder_head_dims(head_dim) == rungs
    config = Qwen2Config(vocab_size=512, hidden_size=8 * head_dim, intermediate_size=16 * head_dim,
                         num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2)  # fmt: skip
    for d in rungs:  # each rung: the model at its depth and head layout, narrowed to head_dim d
        shape = model_shape(shrunk_config(config, 3, d), dtype_bytes=None)
        assert (shape.layers, shape.heads, shape.kv_heads, shape.head_dim) == (3, 8, 2, d)
        assert shape.hidden == shape.intermediate == 8 * d


def test_a_wide_models_noise_moves_its_per_token_constants_less_with_its_narrow_copy():
    """gqa8's forwards are 90% projections here (the made-up GEMM tables): 3% of noise on them (a fixed
    pattern) puts ``token_hidden_s`` at 14x its value and ``kv_byte_s`` at 5x, fitted from them alone; with
    its narrow copy's forwards (hidden 128, where the per-token work is a larger share), 1.8x and 2.1x, and
    with the same noise on the copy's too, 4.9x and 3.3x."""
    exact = shrunk(GQA8, ts=TABLES, **NIL)  # the fixed costs as the shrunk copies give them (held)
    points = timed(GQA8, ts=TABLES, noise=0.03)
    old = _fit(points, TABLES, exact)
    new = _fit(points, TABLES, exact, narrow(GQA8))
    noisy = _fit(points, TABLES, exact, noised(narrow(GQA8), 0.03))
    for name, off, fixed, both in (("token_hidden_s", 10, 2, 5.5), ("kv_byte_s", 4, 2.5, 3.5)):
        ratio = [getattr(c, name) / TRUE[name] for c in (old, new, noisy)]
        assert ratio[0] > off and 1 / fixed < ratio[1] < fixed and 1 / both < ratio[2] < both, (name, ratio)
    # the fixed costs stay the shrunk copies' (held); the narrow copies move only the per-token constants
    assert (new.forward_s, new.layer_s) == (old.forward_s, old.layer_s) == (noisy.forward_s, noisy.layer_s)


def test_a_per_token_cost_the_columns_lack_is_priced_between_the_two_widths():
    """Each layer costs ``PER_TOKEN`` more per token than the columns say (work that does not grow with
    the hidden size). Fitted from gqa8's forwards alone ``token_hidden_s`` takes it per unit of gqa8's hidden
    size (1024), and prices a narrower model's per-token work low (``small``'s, hidden 256: -46%); from its
    narrow copy's alone (hidden 128), high (+60%). Fitted with both, it lies between the two."""
    exact = shrunk(GQA8, ts=TABLES, **NIL)
    points = with_per_token(timed(GQA8, ts=TABLES))
    copies = with_per_token(narrow(GQA8))
    wide = _fit(points, TABLES, exact).token_hidden_s
    thin = _fit(copies, TABLES, exact).token_hidden_s
    both = _fit(points, TABLES, exact, copies).token_hidden_s
    assert wide < both < thin
    small = model_shape("small", dtype_bytes=4)
    truth = TRUE["token_hidden_s"] * small.hidden + PER_TOKEN
    assert wide * small.hidden / truth - 1 == pytest.approx(-0.46, abs=0.02)


def test_the_narrow_copies_recover_the_constants_their_columns_have():
    """Where every per-token cost is one the columns have, the narrow copies' forwards add nothing but
    measurements: the fit recovers every constant exactly, as from the model's own forwards."""
    exact = shrunk(GQA8, ts=TABLES, **NIL)
    costs = _fit(timed(GQA8, ts=TABLES), TABLES, exact, narrow(GQA8))
    for name, value in TRUE.items():
        assert getattr(costs, name) == pytest.approx(value, rel=1e-6), name


def test_the_fit_error_and_unfitted_marks_are_the_models_own():
    """The narrow copies are fitted with, not judged: ``fit_error`` is over the models' own forwards (exact
    here: 0, however far off a narrow copy's), and a constant whose feature only a copy had (a vocabulary
    head: the actor's copy beside a reward and a critic) is still marked unfitted."""
    exact = shrunk(GQA8, roles=("reward", "critic"), ts=TABLES, **NIL)
    points = timed(GQA8, roles=("reward", "critic"), ts=TABLES)
    off = with_per_token(narrow(GQA8, roles=("actor", "reward")), 1e-5)
    costs = _fit(points, TABLES, exact, off)
    assert costs.unfitted == {"logit_s": 0}
    free = _fit(points, TABLES, exact)
    assert free.fit_error < 1e-9
    assert costs.fit_error == pytest.approx(
        calibration._fit_with(points, costs, free_scale=False, fit=()).fit_error, rel=1e-12
    )
    assert costs.fit_error > 0.01  # the copies' extra cost moved the constants, and it shows in the models'


def _pair(head_dim: int, layers: int = 2):
    config = dict(vocab_size=512, hidden_size=2 * head_dim, intermediate_size=4 * head_dim,
                  num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
    actor = AutoModelForCausalLM.from_config(Qwen2Config(**config), dtype=torch.float32).eval()
    reward = AutoModelForSequenceClassification.from_config(
        Qwen2Config(**config, num_labels=1), dtype=torch.float32
    ).eval()
    return {"actor": actor, "reward": reward}


def test_the_ladders_copies_every_rung_for_the_packed_actor_the_first_for_every_role():
    models = _pair(64, layers=3)
    got = _ladder_copies(models, True, lambda _line: None)
    assert sorted(got) == [("actor", 16), ("actor", 32), ("reward", 16)]
    for (role, d), copy in got.items():
        shape = model_shape(copy, dtype_bytes=None)
        assert type(copy) is type(models[role])
        assert (shape.layers, shape.heads, shape.kv_heads, shape.head_dim) == (3, 2, 1, d)
    # where the actor does not pack (a GPU, a dtype oneDNN cannot pack): the first rung of each role
    assert sorted(_ladder_copies(models, False, lambda _line: None)) == [("actor", 16), ("reward", 16)]
    # a model no wider than its shrunk copies has no ladder
    assert _ladder_copies(_pair(SHRUNK_HEAD_DIM), True, lambda _line: None) == {}


def test_a_ladder_that_cannot_be_made_is_named_and_the_fit_falls_back(monkeypatch):
    def refuse(model, layers, head_dim=SHRUNK_HEAD_DIM):
        raise ValueError("calibrate: cannot shrink Weird")

    monkeypatch.setattr(calibration, "shrunk_copy", refuse)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert _ladder_copies(_pair(64), True, lambda _line: None) == {}
    (w,) = [w for w in caught if issubclass(w.category, RuntimeWarning)]
    assert "cannot shrink Weird" in str(w.message) and "per-token constants" in str(w.message)


def test_calibrate_fits_with_the_narrow_copies_and_times_the_ladders_products(monkeypatch):
    """``calibrate`` (its timings replaced by made-up ones: the wiring, not the machine) hands ``_fit`` the
    narrow copies' forwards over ``FORWARD_GRID`` of both roles, and ``_time_packed_calls`` the packed actor's
    every rung over ``FORWARD_GRID`` beside the actor and its shrunk copies."""
    models = _pair(64)
    fits, calls = [], []

    def fit(points, ts, shrunk_points=None, narrow_points=None):
        fits.append((points, shrunk_points, narrow_points))
        raise _Stop

    def packed_calls(runs):
        calls.extend((b.role, model_shape(b.model, dtype_bytes=None).head_dim, grid) for b, _, grid in runs)
        return {}

    monkeypatch.setattr(calibration, "_fit", fit)
    monkeypatch.setattr(calibration, "_time_packed_calls", packed_calls)
    monkeypatch.setattr(calibration, "_time_gemms", lambda *a, **k: {2048: [(1, 1e9)]})
    monkeypatch.setattr(calibration, "_time_streaming", lambda *a, **k: [(1e6, 1, 1e9)])
    monkeypatch.setattr(calibration, "_time_bandwidth", lambda *a, **k: 1e10)
    monkeypatch.setattr(calibration, "_time_repack", lambda packs, timed, stream=None: (1, 1, 1e-6))
    monkeypatch.setattr(calibration, "_timer", lambda device: lambda fn, reps: 1e-3)
    monkeypatch.setattr(calibration, "ROUNDS", 1)
    saved = torch.get_num_threads()
    try:
        with pytest.raises(_Stop):
            calibration.calibrate(models["actor"], models["reward"], threads=(1,))
    finally:
        torch.set_num_threads(saved)
    ((points, shrunk_points, narrow_points),) = fits
    assert sorted({(s.name, p) for s, _, p, _ in narrow_points}) == sorted(
        (f"{role}@hd16", p) for role in ("actor", "reward") for p in FORWARD_GRID
    )
    assert {(s.layers, s.head_dim, s.hidden) for s, *_ in narrow_points} == {(2, 16, 32)}
    assert {s.head_dim for s, *_ in points} == {64} and {s.head_dim for s, *_ in shrunk_points} == {16}
    if calibration.packing(torch.device("cpu"), torch.float32):
        assert ("actor", 16, FORWARD_GRID) in calls and ("actor", 32, FORWARD_GRID) in calls
        assert ("actor", 64, FORWARD_GRID) in calls  # the actor's own
        assert all(role == "actor" for role, *_ in calls)


class _Stop(Exception):
    """Raised by the recording ``_fit``: what calibrate does after the fit is not this test's."""


@pytest.mark.parametrize("role", ["actor", "reward"])
def test_the_timed_rows_share_their_context_and_are_made_once(role):
    """The engine's rows come to a forward with their context cached and their slots appended by the
    scheduler (priced apart). The bench used to append each row's ``ctx`` slots inside the timed call (48-52
    ns per row and context token, which the fit read as KV bytes), then made and freed each row in it (7 us a
    row, 0.17 us a context page on ``tiny``'s copies, read as per-context costs). Now a context of whole pages
    is made once and forked to every row, and a point's rows are made at its first forward and kept: a
    later forward, from any callable of the point, appends nothing, and takes no page."""
    models = _pair(SHRUNK_HEAD_DIM)
    bench = calibration._RoleBench(role, models[role], torch.device("cpu"), grid=((4, 1, 64), (2, 3, 5)))
    appended = []
    append = bench.cache.append_slots

    def spy(seq_id, count):
        appended.append(count)
        return append(seq_id, count)

    bench.cache.append_slots = spy
    run = bench.call(4, 1, 64)
    run()
    assert appended == [64, 1, 1, 1, 1]  # the context once, then each row's one new token
    used, sequences = bench.cache.num_pages_used, bench.cache.num_sequences
    assert sequences == 5  # the context and the point's four rows
    for again in (run, bench.call(4, 1, 64), run):
        appended.clear()
        again()
        assert appended == []
        assert (bench.cache.num_sequences, bench.cache.num_pages_used) == (sequences, used)
    # a context that ends inside a page is appended to each row (a fork would copy its last page)
    appended.clear()
    bench.call(2, 3, 5)()
    assert appended == [5, 3, 5, 3]
    bench.release()  # every point's rows freed; the context kept for the next
    assert bench.cache.num_sequences == 1


def test_a_point_that_does_not_fit_beside_the_kept_rows_releases_them_first():
    """The bench's arena is sized for any one point of its grid, not all of them kept at once: a point
    whose rows do not fit beside the kept ones frees those first (the callables of the freed points make
    theirs again at their next forward); one that cannot fit alone is refused by name."""
    models = _pair(SHRUNK_HEAD_DIM)
    bench = calibration._RoleBench("reward", models["reward"], torch.device("cpu"), grid=((8, 64, 0),))
    free = bench.cache.num_available_pages()
    first = bench.call(8, 64, 0)
    first()
    assert bench.cache.num_available_pages() == free - 8 * 4
    big = (free - 8 * 4) // 4 + 1  # rows of 64 tokens (4 pages each) that fit only without the kept ones
    bench.call(big, 64, 0)()
    assert bench.cache.num_available_pages() == free - big * 4
    first()  # made again, the big point's rows released
    assert bench.cache.num_available_pages() == free - 8 * 4
    with pytest.raises(RuntimeError, match="cannot hold"):
        bench.call(free // 4 + 1, 64, 0)()
    assert bench.cache.num_sequences == 0 and bench.cache.num_available_pages() == free  # nothing kept
    # so is a context too long for the arena, and nothing of it is kept for the next call to trust
    too_long = (free + 1) * bench.cache.page_size
    for _ in range(2):
        with pytest.raises(RuntimeError, match="cannot hold"):
            bench.call(1, 1, too_long)()
        assert bench.cache.num_sequences == 0 and bench.cache.num_available_pages() == free
