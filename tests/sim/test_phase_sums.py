"""``bench_twin.phase_sums``: a step's seconds by phase, from its lane spans (the ``--phases`` diagnosis); the
neighbour's CPU that ``calibrate`` and the matrix report (``OtherCPU``, ``neighbour_warning``); the matrix's
medians over its runs (``median_errors``) and its real figures' two statistics (``real_figures``)."""

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
