"""bench/correction_curves.py's summary: per-run held-out curves, the medians of its steps, the mean and
spread of the gain per arm, from the runs' own JSON lines (no training here: the runs are slow)."""

import json

import pytest

from bench import correction_curves as cc


def _run(path, initial, evals, final, step_s):
    recs = [dict(event="start")]
    for i, s in enumerate(step_s, 1):
        recs.append(
            dict(event="step", step=i, accuracy=0.5, step_s=s, update_s=s - 4, rollout_s=4.0, load=[1.0, 1.5])
        )
        if i in evals:
            recs.append(dict(event=f"heldout_step_{i}", steps=i, accuracy=evals[i]))
    recs.append(dict(event="end", initial=initial, final=final, gain_points=round(100 * (final - initial), 1),
                     steps=len(step_s)))  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))


def test_the_summary_reads_each_finished_run_and_skips_an_unfinished_one(tmp_path, monkeypatch):
    monkeypatch.setattr(cc, "RESULTS", tmp_path)
    _run(tmp_path / "correction_none_s0.jsonl", 0.41, {2: 0.5}, 0.6, [10, 20, 30, 40])
    _run(tmp_path / "correction_none_s1.jsonl", 0.41, {2: 0.45}, 0.5, [10, 10, 10, 10])
    _run(tmp_path / "correction_tis_s0.jsonl", 0.41, {2: 0.55}, 0.65, [11, 11, 11, 11])
    (tmp_path / "correction_tis_s1.jsonl").write_text(json.dumps(dict(event="start")) + "\n")  # killed
    summary = cc.main(["--summarize", "--seeds", "0", "1", "--arms", "none", "tis"])
    rows = {(r["arm"], r["seed"]): r for r in summary["rows"]}
    assert set(rows) == {("none", 0), ("none", 1), ("tis", 0)}
    assert rows[("none", 0)]["curve"] == {2: 0.5, 4: 0.6}
    assert rows[("none", 0)]["step_s"] == 25 and rows[("none", 0)]["update_s"] == 21
    assert summary["means"]["none"]["runs"] == 2
    assert summary["means"]["none"]["gain_points"] == pytest.approx((19 + 9) / 2)
    assert summary["means"]["none"]["gain_sd"] == pytest.approx(7.1, abs=0.05)
    assert summary["means"]["tis"]["gain_sd"] is None
    assert (tmp_path / "correction_summary.json").exists() and (tmp_path / "correction_curves.png").exists()
    assert cc._initial("", ["none", "tis"], [0, 1]) == 0.41
