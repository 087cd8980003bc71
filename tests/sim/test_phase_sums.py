"""``bench_twin.phase_sums``: a step's seconds by phase, from its lane spans (the ``--phases`` diagnosis); the
neighbour's CPU that ``calibrate`` and the matrix report (``OtherCPU``, ``neighbour_warning``); the matrix's
medians over its runs (``median_errors``), its real figures' two statistics (``real_figures``) and its carry
table (``carry_errors``); ``--drift``'s summary (``drift_summary``)."""

import pytest

from bench.bench_twin import STATISTICS, median_errors, phase_sums, real_figures
from oppo_engine.sim.calibration import NEIGHBOUR_CORES, OtherCPU, neighbour_warning


def test_phase_sums_splits_forwards_by_kind_and_overlap():
    spans = [
        ("actor", "forward", 0.0, 10.0, 40),  # a prompt forward (40 tokens > 8 rows), beside the reward's
        ("reward", "prefill", 2.0, 9.0, 30),  # overlaps the actor for 7 of its 7: beside
        ("actor", "forward", 10.0, 12.0, 8),  # a decode, alone
        ("actor", "forward", 12.0, 14.0, 8),  # a decode, beside for 1.5 of its 2
        ("reward", "prefill", 12.5, 16.0, 16),  # beside for 1.5 of its 3.5: alone
    ]
    out = phase_sums(spans, wall=17.0, rows=8)
    assert out["actor prompt fwd beside"] == 10.0 and out["actor prompt fwd beside tokens n"] == 40
    assert out["actor decode alone"] == 2.0 and out["actor decode alone n"] == 1
    assert out["actor decode beside"] == 2.0 and out["actor decode beside n"] == 1
    assert out["reward prefill beside"] == 7.0 and out["reward prefill beside tokens n"] == 30
    assert out["reward prefill alone"] == 3.5 and out["reward prefill alone n"] == 1
    # the spans cover [0, 16]: one second of the 17 outside them
    assert out["host (outside spans)"] == pytest.approx(1.0)
    assert out["step"] == 17.0


def test_other_cpu_excludes_this_process():
    with OtherCPU() as other:
        sum(i * i for i in range(200_000))  # this process's own work is not counted
    assert other.cores is None or 0.0 <= other.cores


def test_calibrate_warns_of_a_neighbour_above_the_threshold():
    assert neighbour_warning(None) is None  # /proc/stat not there: nothing to say
    assert neighbour_warning(0.0) is None
    assert neighbour_warning(NEIGHBOUR_CORES) is None
    message = neighbour_warning(0.8)
    assert message is not None and "0.80 cores" in message and "hand-overs" in message


def test_median_errors_takes_each_workload_and_arm_over_the_runs():
    runs = [
        {("tiny", "small"): [0.1, -0.3, 0.0], ("small", "tiny"): [0.0, 0.0, 0.0]},
        {("tiny", "small"): [0.3, -0.1, 0.2], ("small", "tiny"): None},  # refused in one run
        {("tiny", "small"): [0.2, -0.2, -0.4], ("small", "tiny"): [0.0, 0.0, 0.0]},
    ]
    out = median_errors(runs)
    # per position, not the median of the run's medians nor of its worst
    assert out["tiny", "small"] == pytest.approx([0.2, -0.2, 0.0])
    assert out["small", "tiny"] is None


def test_real_figures_are_the_median_and_the_fastest_of_the_rounds():
    seq, oppo = ("sequential", None, None), ("oppo", 16, "half")
    rounds = [  # measure()'s per round: {arm: (median step s, exposed scoring s)}
        {seq: (0.30, 0.1), oppo: (0.20, 0.0)},
        {seq: (0.24, 0.1), oppo: (0.26, 0.0)},  # a round of each arm in a spell
        {seq: (0.27, 0.1), oppo: (0.21, 0.0)},
    ]
    out = real_figures(rounds, (seq, oppo))
    assert set(out) == set(STATISTICS)
    assert out["median"] == {seq: 0.27, oppo: 0.21}
    # per arm: its own fastest round, whichever round that was, and never the exposed scoring
    assert out["fastest"] == {seq: 0.24, oppo: 0.20}


def test_carry_sets_each_prediction_against_the_columns_own_calibration():
    from bench.bench_twin import carry_errors

    shapes = ["tiny", "small", "mid"]
    twins = {  # predicted s/step per cell, in the order of its errors (workload x arm)
        ("tiny", "tiny"): [0.10, 0.05],
        ("tiny", "small"): [0.33, 0.11],
        ("tiny", "mid"): [0.50, 0.20],
        ("small", "tiny"): [0.12, 0.04],
        ("small", "small"): [0.30, 0.10],
        ("small", "mid"): None,  # refused
        ("mid", "tiny"): [0.09, 0.05],
        ("mid", "small"): [0.27, 0.12],
        ("mid", "mid"): None,  # the column's own calibration refused: nothing to set the column against
    }
    out = carry_errors(twins, shapes)
    assert out["tiny", "tiny"] == [0.0, 0.0] and out["small", "small"] == [0.0, 0.0]
    # over the column's diagonal (small's own), not the row's (tiny's), position by position
    assert out["tiny", "small"] == pytest.approx([0.10, 0.10])
    assert out["small", "tiny"] == pytest.approx([0.20, -0.20])
    assert out["mid", "small"] == pytest.approx([-0.10, 0.20])
    assert out["small", "mid"] is None
    assert out["tiny", "mid"] is None and out["mid", "mid"] is None


def test_drift_summary_sets_one_fixed_prediction_against_every_round():
    from bench.bench_twin import drift_summary

    seq, oppo = ("sequential", None, None), ("oppo", 16, "half")
    first = {seq: (0.10, 0.0), oppo: (0.08, 0.0)}  # predict()'s: {arm: (step s, exposed s)}
    last = {seq: (0.11, 0.0), oppo: (0.08, 0.0)}
    rounds = [  # measure()'s, one per round
        {seq: (0.10, 0.01), oppo: (0.08, 0.0)},
        {seq: (0.20, 0.01), oppo: (0.16, 0.0)},  # a spell: twice as slow
        {seq: (0.095, 0.01), oppo: (0.10, 0.0)},
    ]
    out = drift_summary(first, last, rounds)
    s, o = out[seq], out[oppo]
    assert (s["min"], s["median"], s["max"]) == (0.095, 0.10, 0.20)
    assert s["twin"] == 0.10 and s["twin last"] == 0.11
    # the first prediction against each round, never against the rounds' median or the last prediction
    assert s["error min"] == pytest.approx(-0.5) and s["error max"] == pytest.approx(0.10 / 0.095 - 1)
    assert s["error median"] == pytest.approx(0.0)
    assert s["within 10%"] == pytest.approx(2 / 3)  # +5.3% and 0 in, -50% out
    assert s["last error median"] == pytest.approx(0.10)
    assert o["error median"] == pytest.approx(-0.2) and o["within 10%"] == pytest.approx(1 / 3)
