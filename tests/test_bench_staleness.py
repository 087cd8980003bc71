"""bench_staleness runs the three configurations side by side and reports what each returned (no timing
is asserted): the defaults' returned tokens never lag more than max_policy_lag=2 versions."""

from bench import bench_staleness


def test_staleness_bench_reports_each_configuration_and_the_defaults_keep_the_lag_bound(capsys):
    summary = bench_staleness.main(["--batch-size", "4", "--steps", "4", "--response-len-cap", "24"])
    out = capsys.readouterr().out
    assert set(summary) == {"defaults", "no_lag", "former"}
    assert summary["defaults"]["max_lag"] <= 2 and summary["defaults"]["max_deferred"] <= 2
    assert all(0.0 <= s["stale_share"] <= 1.0 and s["tokens_per_s"] > 0 for s in summary.values())
    assert "throughput_defaults_vs_former=" in out and "throughput_defaults_vs_no_lag=" in out
