"""The demo's figures from synthetic per-step records: the time-to-reward threshold and crossing, the
records.json layout, the chunk size chosen and the ablation table."""

import math
from pathlib import Path

import pytest

from oppo_engine.ppo.report import (
    ModeRun,
    StepRecord,
    accuracy_threshold,
    chunk_choice,
    format_table,
    records_json,
    reward_threshold,
    steps_to_reward,
    time_to_accuracy,
    time_to_reward,
)


def mode_run(mode, rewards, step_s, chunk=None, rollout_share=0.8):
    run = ModeRun(mode)
    elapsed = 0.0
    for i, reward in enumerate(rewards):
        s = step_s[i] if isinstance(step_s, list) else step_s
        elapsed += s
        c = chunk[i] if isinstance(chunk, list) else chunk
        run.records.append(
            StepRecord(
                step=i + 1,
                reward=reward,
                kl=0.0,
                step_s=s,
                rollout_s=rollout_share * s,
                elapsed_s=elapsed,
                rollouts=8,
                tokens=100,
                exposed_scoring_s=0.01,
                length_bias=1.0,
                chunk_size=c,
                overcommit=2,
                stale_tokens=0,
            )  # fmt: skip
        )
    return run


def test_threshold_is_ninety_percent_of_the_way_between_the_first_and_final_trailing_means():
    base = mode_run("sequential", [0.0] * 5 + [1.0] * 5 + [2.0] * 5, 1.0)
    # first trailing mean (steps 1-5) 0.0, final (steps 11-15) 2.0
    assert reward_threshold(base) == pytest.approx(1.8)


def test_time_to_reward_is_the_summed_step_time_at_the_first_crossing_of_the_trailing_mean():
    run = mode_run("oppo", [0.0] * 5 + [2.0] * 10, [1.0] * 5 + [0.5] * 10)
    # trailing means: step 5: 0.0, step 9: 1.6, step 10: 2.0 >= 1.8 -> summed time of steps 1-10
    assert time_to_reward(run, 1.8) == pytest.approx(5 * 1.0 + 5 * 0.5)
    assert steps_to_reward(run, 1.8) == 10 and steps_to_reward(run, 2.5) is None
    assert time_to_reward(run, 2.5) is None
    # one lucky step does not cross: the trailing mean does
    spike = mode_run("intra", [0.0] * 5 + [5.0] + [0.0] * 5, 1.0)  # its trailing mean peaks at 1.0
    assert time_to_reward(spike, 1.8) is None


def test_records_json_has_exactly_the_documented_keys_and_one_threshold():
    seq = mode_run("sequential", [0.0] * 5 + [2.0] * 10, 2.0)
    oppo = mode_run("oppo", [0.0] * 5 + [2.0] * 10, 1.0, chunk="off")
    missing = ModeRun("inter", unavailable="not built")
    out = records_json([seq, oppo, missing])
    assert set(out) == {"sequential", "oppo"}
    for rec in out.values():
        keys = {
            "time_to_reward_s",
            "threshold",
            "s_per_step",
            "rollout_s_per_step",
            "final_reward",
            "records",
        }
        assert set(rec) == keys
        assert rec["threshold"] == pytest.approx(1.8)
    assert out["sequential"]["time_to_reward_s"] == pytest.approx(2 * out["oppo"]["time_to_reward_s"])
    assert out["oppo"]["s_per_step"] == pytest.approx(1.0)
    assert out["oppo"]["rollout_s_per_step"] == pytest.approx(0.8)
    assert out["oppo"]["final_reward"] == pytest.approx(2.0)
    assert len(out["oppo"]["records"]) == 15 and out["oppo"]["records"][0]["chunk_size"] == "off"


def test_chunk_choice_is_the_most_frequent_arm_of_the_second_half():
    run = mode_run("intra", [0.0] * 10, 1.0, chunk=[8, 8, 8, 8, 8, "off", "off", "off", 16, "off"])
    assert chunk_choice(run) == "off (4/5)"
    assert chunk_choice(mode_run("sequential", [0.0] * 4, 1.0)) == "-"


def test_table_reports_speed_ups_against_sequential():
    seq = mode_run("sequential", [0.0] * 5 + [2.0] * 10, 2.0)
    oppo = mode_run("oppo", [0.0] * 5 + [2.0] * 10, 1.0, chunk="off")
    table = format_table([seq, oppo])
    row = next(line for line in table.splitlines() if line.startswith("time to reward (s)"))
    assert "20.0" in row and "10.0" in row
    assert table.count("2.00x") == 3  # time to reward, PPO step, rollout
    assert "off (8/8)" in table


def test_a_rule_tasks_accuracy_and_heldout_accuracy_are_reported_beside_the_reward():
    runs = [mode_run("sequential", [0.1] * 6, 2.0), mode_run("oppo", [0.1] * 6, 1.0)]
    for run in runs:
        for i, rec in enumerate(run.records):
            rec.accuracy, rec.unparsed, rec.cut_off = 0.1 * i, 1, 0.25
        run.eval_accuracy_initial, run.eval_accuracy_final = 0.04, 0.31
    table = format_table(runs)
    assert "accuracy: first -> final" in table and "0% -> 30%" in table  # the last 5 steps' mean
    assert "held-out accuracy: before -> after | 4.0% -> 31.0%" in table.replace("  ", " ").replace("  ", " ")
    out = records_json(runs)["oppo"]
    assert out["eval_accuracy_initial"] == 0.04 and out["eval_accuracy_final"] == 0.31
    assert out["records"][2]["accuracy"] == pytest.approx(0.2) and out["records"][0]["unparsed"] == 1
    assert "accuracy" not in format_table([mode_run("sequential", [0.1] * 6, 2.0)])  # other tasks: no rows


def test_time_to_accuracy_applies_the_threshold_rule_to_the_per_step_accuracy():
    accuracy = [0.0] * 5 + [0.5] * 10  # trailing means: 0.0 first, 0.5 final -> threshold 0.45
    seq = mode_run("sequential", [0.1] * 15, 2.0)
    oppo, intra = mode_run("oppo", [0.1] * 15, 1.0), mode_run("intra", [0.1] * 15, 1.0)
    for run, acc in ((seq, accuracy), (oppo, accuracy), (intra, [0.0] * 5 + [0.4] * 10)):
        for rec, a in zip(run.records, acc, strict=True):
            rec.accuracy, rec.unparsed, rec.cut_off = a, 0, 0.0
    assert accuracy_threshold(seq) == pytest.approx(0.45)
    # step 9's trailing mean is 0.4, step 10's 0.5: the summed time of steps 1-10
    assert time_to_accuracy(seq, 0.45) == pytest.approx(20.0) and time_to_accuracy(
        oppo, 0.45
    ) == pytest.approx(10.0)
    out = records_json([seq, oppo, intra])
    assert out["sequential"]["time_to_accuracy_s"] == pytest.approx(20.0)
    assert out["oppo"]["time_to_accuracy_s"] == pytest.approx(10.0)
    assert out["intra"]["time_to_accuracy_s"] is None  # its trailing accuracy peaks at 0.4: never reached
    assert "eval_accuracy_initial" not in out["oppo"]  # held-out accuracy not evaluated here
    # not a rule task: no accuracy, no threshold, no key
    plain = mode_run("sequential", [0.1] * 15, 2.0)
    assert accuracy_threshold(plain) is None and time_to_accuracy(plain, 0.45) is None
    assert "time_to_accuracy_s" not in records_json([plain])["sequential"]


def test_agreement_fields_flatten_the_step_gap_and_map_empty_classes_to_none():
    from oppo_engine.ppo.agreement import Agreement
    from oppo_engine.ppo.report import agreement_fields

    fresh = Agreement(10, 2, 1e-6, 3e-6, 1e-12, 0.0, 2e-6, 4e-6)
    empty = Agreement(0, 0, *[math.nan] * 6)
    fields = agreement_fields({"fresh": fresh, "carried_current": empty, "stale": empty})
    assert {k: v for k, v in fields.items() if k.startswith("agreement_")} == {
        "agreement_mean_abs": 1e-6,
        "agreement_max_abs": 3e-6,
        "agreement_k3": 1e-12,
        "agreement_stale_mean_abs": None,
    }
    assert set(agreement_fields(None).values()) == {None}


def _gap(fresh, carried_current=(), stale=()):
    """``agreement.measure`` over one row per class: each row's per-token ``delta`` (trainer minus
    behaviour log-prob); an empty tuple leaves the class empty (its row is masked out)."""
    import torch

    from oppo_engine.ppo.agreement import measure

    rows = (fresh, carried_current, stale)
    width = max(map(len, rows))
    delta = torch.zeros(3, width, dtype=torch.float64)
    mask = torch.zeros(3, width)
    for i, row in enumerate(rows):
        delta[i, : len(row)], mask[i, : len(row)] = torch.tensor(row, dtype=torch.float64), 1
    behaviour = -torch.rand(3, width, dtype=torch.float64)
    stale_mask = torch.tensor([[False], [False], [True]]).expand(3, width)
    return measure(behaviour + delta, behaviour, mask, stale_mask, torch.tensor([False, True, True]))


def test_a_record_keeps_every_token_class_of_the_gap_and_an_empty_class_is_none_not_zero():
    import json

    from oppo_engine.ppo.report import agreement_fields

    run = mode_run("oppo", [0.0, 1.0], 1.0)
    gaps = [_gap([0.01, -0.02], carried_current=[0.2, -0.05, 0.02]), _gap([0.03], stale=[-0.3])]
    for rec, gap in zip(run.records, gaps, strict=True):
        for name, value in agreement_fields(gap, truncated_sampling=True).items():
            setattr(rec, name, value)
    # records.json is strict JSON (no NaN) and carries each class's statistics by name
    steps = json.loads(json.dumps(records_json([run]), allow_nan=False))["oppo"]["records"]
    carried = steps[0]["agreement"]["carried_current"]
    assert (carried["tokens"], carried["sequences"]) == (3, 1)
    assert carried["mean_abs"] == pytest.approx(0.09) and carried["max_abs"] == pytest.approx(0.2)
    assert carried["frac_large"] == pytest.approx(1 / 3)
    k3 = [math.expm1(d) - d for d in (0.2, -0.05, 0.02)]
    assert carried["mean_k3"] == pytest.approx(sum(k3) / 3)
    assert carried["seq_sum_std"] == 0.0 and carried["seq_sum_max_abs"] == pytest.approx(0.17)
    assert steps[0]["agreement"]["fresh"]["max_abs"] == pytest.approx(0.02)
    assert steps[1]["agreement"]["stale"]["mean_abs"] == pytest.approx(0.3)
    # an empty class: no tokens, and no statistic (None, not a 0 that reads as perfect agreement)
    for empty in (steps[0]["agreement"]["stale"], steps[1]["agreement"]["carried_current"]):
        assert empty["tokens"] == empty["sequences"] == 0
        assert {v for k, v in empty.items() if k not in ("tokens", "sequences")} == {None}
    # the fields read before every class was recorded keep their meaning
    assert steps[1]["agreement_mean_abs"] == pytest.approx(0.03)
    assert steps[1]["agreement_stale_mean_abs"] == pytest.approx(0.3)
    assert steps[0]["agreement_stale_mean_abs"] is None
    assert [s["truncated_sampling"] for s in steps] == [True, True]
    unmeasured = agreement_fields(None)
    assert unmeasured["agreement"] is None and unmeasured["truncated_sampling"] is None


def test_the_first_step_is_shown_against_the_later_steps_with_the_cpu_it_got():
    run = mode_run("sequential", [0.1] * 4, [30.0, 10.0, 12.0, 11.0])
    for rec, cpu in zip(run.records, [15.0, 19.0, 24.0, 22.0], strict=True):
        rec.cpu_s = cpu  # the process's CPU seconds of the step
    table = format_table([run])
    row = next(line for line in table.splitlines() if line.startswith("first step s (x later median)"))
    assert "30.0 (2.7x)" in row  # 30 over the median of 10, 12 and 11
    row = next(line for line in table.splitlines() if line.startswith("CPU/wall: first step, later"))
    assert "0.50, 2.00" in row  # 15/30; the median of 1.9, 2.0, 2.0
    assert records_json([run])["sequential"]["records"][0]["cpu_s"] == 15.0
    unmeasured = format_table([mode_run("sequential", [0.1] * 4, 1.0)])
    assert "CPU/wall: first step, later" in unmeasured and "| -" in unmeasured


def _measured(run, gaps):
    """``run``'s records with ``gaps[i]`` (``agreement.measure``'s classes) as step i's engine-trainer gap."""
    from oppo_engine.ppo.report import agreement_fields

    for rec, gap in zip(run.records, gaps, strict=True):
        for name, value in agreement_fields(gap).items():
            setattr(rec, name, value)
    return run


def _cells(table, name):
    """The table row ``name``'s cells, one per mode."""
    line = next(line for line in table.splitlines() if line.startswith(name))
    return [c.strip() for c in line.split(" | ")[1:]]


def test_the_table_shows_the_carried_current_gap_where_a_mode_measured_one():
    seq = _measured(mode_run("sequential", [0.1] * 2, 2.0), [_gap([0.01]), _gap([0.03])])
    oppo = _measured(mode_run("oppo", [0.1] * 2, 1.0), [_gap([0.01], [0.2, 0.1]), _gap([0.03], stale=[0.5])])
    table = format_table([seq, oppo])
    # sequential carries nothing; oppo's one step with the class
    assert _cells(table, "  carried_current class, mean |Δ|") == ["-", "1.50e-01"]
    assert _cells(table, "engine-trainer gap, mean |Δ|") == ["2.00e-02"] * 2
    assert "carried_current" not in format_table(
        [seq, _measured(mode_run("oppo", [0.1] * 2, 1.0), [_gap([0.01])] * 2)]
    )


def test_agreement_png_draws_mean_and_max_of_each_non_empty_class_per_mode(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    from oppo_engine.ppo.report import plot

    figures, savefig = {}, Figure.savefig

    def keep(fig, path, **kwargs):  # each file's figure, to read what was drawn in it
        figures[Path(path).name] = fig
        return savefig(fig, path, **kwargs)

    monkeypatch.setattr(Figure, "savefig", keep)

    seq = _measured(mode_run("sequential", [0.1] * 3, 2.0), [_gap([0.01]), _gap([0.03]), _gap([0.02])])
    oppo = _measured(
        mode_run("oppo", [0.1] * 3, 1.0),
        [_gap([0.01], [0.2, 0.1]), _gap([0.03], stale=[0.5]), _gap([0.02, 0.04], stale=[0.25])],
    )
    paths = plot(tmp_path, [seq, oppo])
    assert [p.name for p in paths] == ["reward.png", "control.png", "agreement.png"]
    assert (tmp_path / "agreement.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    fig = figures["agreement.png"]
    drawn = {ax.get_title(): {ln.get_label(): ln for ln in ax.lines} for ax in fig.axes}
    nan = math.nan
    expected = {
        "sequential": {"fresh": ([0.01, 0.03, 0.02], [0.01, 0.03, 0.02])},
        "oppo": {  # (mean |Δ|, max |Δ|) per step; NaN: the class was empty at that step
            "fresh": ([0.01, 0.03, 0.03], [0.01, 0.03, 0.04]),
            "carried_current": ([0.15, nan, nan], [0.2, nan, nan]),
            "stale": ([nan, 0.5, 0.25], [nan, 0.5, 0.25]),
        },
    }
    for mode, classes in expected.items():
        lines = drawn[mode]
        assert set(lines) == {f"{cls}, {what} |Δ|" for cls in classes for what in ("mean", "max")}
        for cls, (means, maxima) in classes.items():
            mean_line, max_line = lines[f"{cls}, mean |Δ|"], lines[f"{cls}, max |Δ|"]
            assert list(mean_line.get_xdata()) == [1, 2, 3]
            assert list(mean_line.get_ydata()) == pytest.approx(means, nan_ok=True)
            assert list(max_line.get_ydata()) == pytest.approx(maxima, nan_ok=True)
            assert (mean_line.get_linestyle(), max_line.get_linestyle()) == ("-", "--")
            assert (
                mean_line.get_color() == max_line.get_color() == drawn["oppo"][f"{cls}, mean |Δ|"].get_color()
            )
    assert fig.axes[0].get_yscale() == "log"  # every value positive
    # nothing measured (measure_agreement=False): no agreement.png
    (tmp_path / "unmeasured").mkdir()
    unmeasured = plot(tmp_path / "unmeasured", [mode_run("sequential", [0.1] * 3, 2.0)])
    assert [p.name for p in unmeasured] == ["reward.png", "control.png"]
