"""bench_e2e drives the real engine (tiny preset) through the public API, every mode.

No timing is asserted (a loaded machine must not fail the suite): only what the bench measures and
writes -- tokens, rollouts, pages, the call order of the PPO loop it imitates, the files.
"""

import csv
import re

import pytest

from bench import bench_e2e, e2e_report
from oppo_engine.obs.metrics import StepMetrics

TINY = ["--preset", "tiny", "--batch-size", "2", "--prompt-len-cap", "8", "--response-len-cap", "8"]


def _speedups(out: str) -> dict[str, str]:
    return dict(re.findall(r"^(speedup_oppo_vs_\w+)=(.*)$", out, re.M))


def _run(tmp_path, *extra: str) -> dict:
    return bench_e2e.main([*TINY, "--out", str(tmp_path), *extra])


def test_engine_modes_run_through_the_public_api_and_the_speedups_are_printed(capsys, tmp_path):
    res = _run(tmp_path, "--modes", "hf,sequential,oppo", "--steps", "3", "--warmup", "1", "--trace")
    out = capsys.readouterr().out

    seq = res["sequential"]
    assert seq.available and seq.steps == 3
    steps = [r for r in csv.DictReader((tmp_path / "steps.csv").open()) if r["mode"] == "sequential"]
    assert len(steps) == 3  # the warm-up step is not measured
    # ignore_eos: each step generates exactly the response lengths the workload drew for its 2 prompts
    assert all(int(r["rollouts"]) == 2 and int(r["tokens_generated"]) >= 2 for r in steps)
    want = sum(float(r["tokens_generated"]) for r in steps) / sum(float(r["wall_s"]) for r in steps)
    assert seq.tokens_per_s == pytest.approx(want)
    assert 0 < seq.peak_pages <= seq.total_pages

    assert res["hf"].available and res["hf"].tokens_per_s > 0
    assert res["oppo"].available and res["oppo"].steps == 3
    speed = _speedups(out)
    # Numbers, not nan: both modes ran. (Their size is not asserted: with 8 prompts, oppo may decode every
    # remaining token while its warm-up step's batch is scored, leaving the measured steps none.)
    assert all(float(speed[k]) >= 0 for k in ("speedup_oppo_vs_sequential", "speedup_oppo_vs_hf"))
    rows = {r["mode"]: r for r in csv.DictReader((tmp_path / "summary.csv").open())}
    assert rows["sequential"]["available"] == "True" and rows["oppo"]["available"] == "True"
    assert (tmp_path / "trace_hf.json").exists() and (tmp_path / "trace_sequential.json").exists()


def test_engine_and_hf_generate_the_same_token_counts_per_step(tmp_path):
    res = _run(tmp_path, "--modes", "hf,sequential", "--steps", "2", "--warmup", "0")
    steps = list(csv.DictReader((tmp_path / "steps.csv").open()))
    by_mode = {m: [int(r["tokens_generated"]) for r in steps if r["mode"] == m] for m in ("hf", "sequential")}
    assert by_mode["hf"] == by_mode["sequential"]  # same workload rows, same lengths, step by step
    assert res["sequential"].steps == res["hf"].steps == 2


def test_bad_arguments_are_rejected():
    with pytest.raises(SystemExit):
        bench_e2e.parse_args(["--modes", "hf,turbo"])
    with pytest.raises(SystemExit):
        bench_e2e.parse_args(["--batch-size", "4", "--steps", "3", "--warmup", "1", "--num-prompts", "15"])
    args = bench_e2e.parse_args(["--batch-size", "4", "--steps", "3", "--warmup", "1"])
    assert args.num_prompts == 20 and args.modes == list(bench_e2e.ALL_MODES)


def test_a_fixed_overcommit_reaches_the_overcommitting_modes_only(tmp_path):
    _run(tmp_path, "--modes", "sequential,inter", "--steps", "2", "--warmup", "0", "--overcommit", "3",
         "--max-policy-lag", "none")  # fmt: skip
    steps = list(csv.DictReader((tmp_path / "steps.csv").open()))
    assert {r["overcommit"] for r in steps if r["mode"] == "inter"} == {"3"}
    assert {r["overcommit"] for r in steps if r["mode"] == "sequential"} == {"0"}


def test_fewer_than_three_steps_print_no_speedup_line_and_say_why(capsys, tmp_path):
    _run(tmp_path, "--modes", "sequential,oppo", "--steps", "1", "--warmup", "0")
    out = capsys.readouterr().out
    assert "speedup_" not in out
    assert "no speed-up line: --steps 1 is below 3" in out


def _record(mode: str, wall_s: float) -> e2e_report.StepRecord:
    metrics = StepMetrics(wall_s, wall_s, 0.0, 1, 1, None, 0, 0, 1, {}, None)
    return e2e_report.StepRecord(mode, 0, metrics)


def test_a_mode_whose_step_times_spread_more_than_twice_is_warned_about():
    records = {
        "steady": [_record("steady", t) for t in (1.0, 1.5, 1.9)],
        "noisy": [_record("noisy", t) for t in (1.0, 1.2, 2.5)],
        "single": [_record("single", 1.0)],
    }
    lines = e2e_report.spread_warnings(records)
    assert len(lines) == 1 and lines[0].startswith("WARNING [noisy] step times spread 2.5x")
