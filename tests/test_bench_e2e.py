import csv
import re
import time
from types import SimpleNamespace

import pytest

import oppo_engine
from bench import bench_e2e
from oppo_engine.obs.metrics import StepMetrics

TINY = ["--preset", "tiny", "--batch-size", "2", "--prompt-len-cap", "8", "--response-len-cap", "8"]


class FakeEngine:
    """Stands in for RolloutEngine through the public API only; 'oppo' steps take a third of the time."""

    calls: list[tuple[str, str]] = []

    def __init__(self, *, actor, reward, config, sampling, eos_token_id):
        self.mode, self.batch_size = config.mode, config.batch_size
        self.queue: list[tuple[list[int], int]] = []

    def _log(self, what: str) -> None:
        FakeEngine.calls.append((self.mode, what))

    def add_prompts(self, prompts, sampling=None):
        assert len(sampling) == len(prompts) and all(s.ignore_eos for s in sampling)
        self.queue += [(p, s.max_new_tokens) for p, s in zip(prompts, sampling, strict=True)]

    def step(self):
        self._log("step")
        batch, self.queue = self.queue[: self.batch_size], self.queue[self.batch_size :]
        time.sleep(0.03 if self.mode == "oppo" else 0.09)
        tokens = sum(n for _, n in batch)
        rollouts = [SimpleNamespace(prompt_ids=p, response_ids=[20] * n, reward=0.0) for p, n in batch]
        metrics = StepMetrics(1.0, 0.5, 0.1, tokens, len(batch), 4, 1, 1, 7, {"actor": 0.9}, None)
        return SimpleNamespace(rollouts=rollouts, metrics=metrics)

    def cache_stats(self):
        return {"total_pages": 64, "free_pages": 57}

    def update_policy(self):
        self._log("update_policy")

    def release_memory(self):
        self._log("release_memory")

    def resume(self):
        self._log("resume")

    def close(self):
        self._log("close")


class HalfBuiltEngine(FakeEngine):
    """Constructs, but its step has not landed; sequential mode has no engine at all."""

    def __init__(self, **kw):
        if kw["config"].mode == "sequential":
            raise NotImplementedError("scheduler pending")
        super().__init__(**kw)

    def step(self):
        raise NotImplementedError


def _install(monkeypatch, engine_cls) -> None:
    FakeEngine.calls = []
    # NOTE: through the module dict, so the package's lazy __getattr__ (which imports the real engine)
    # is neither triggered nor shadowed after the test.
    for name, value in (
        ("RolloutEngine", engine_cls),
        ("EngineConfig", SimpleNamespace),
        ("SamplingParams", SimpleNamespace),
    ):
        monkeypatch.setitem(vars(oppo_engine), name, value)


def _speedups(out: str) -> dict[str, str]:
    return dict(re.findall(r"^(speedup_oppo_vs_\w+)=(.*)$", out, re.M))


def test_unimplemented_engine_modes_are_reported_not_crashed(monkeypatch, capsys, tmp_path):
    _install(monkeypatch, HalfBuiltEngine)
    res = bench_e2e.main(
        [
            *TINY,
            "--modes",
            "hf,sequential,oppo",
            "--steps",
            "1",
            "--warmup",
            "0",
            "--out",
            str(tmp_path),
            "--trace",
        ]
    )
    out = capsys.readouterr().out
    assert res["hf"].available and res["hf"].tokens_per_s > 0
    assert "not implemented: scheduler pending" in res["sequential"].reason
    assert "not implemented" in res["oppo"].reason
    assert ("oppo", "close") in FakeEngine.calls  # the half-built engine was still closed
    speed = _speedups(out)
    assert speed["speedup_oppo_vs_sequential"].startswith("nan (")
    assert speed["speedup_oppo_vs_hf"].startswith("nan (oppo: ")
    rows = {r["mode"]: r for r in csv.DictReader((tmp_path / "summary.csv").open())}
    assert rows["hf"]["available"] == "True" and rows["oppo"]["available"] == "False"
    assert (tmp_path / "trace_hf.json").exists()


def test_engine_modes_run_through_the_public_api_and_report_speedups(monkeypatch, capsys, tmp_path):
    _install(monkeypatch, FakeEngine)
    res = bench_e2e.main(
        [*TINY, "--modes", "sequential,oppo", "--steps", "2", "--warmup", "1", "--out", str(tmp_path)]
    )
    out = capsys.readouterr().out
    speed = _speedups(out)
    assert float(speed["speedup_oppo_vs_sequential"]) > 1.5  # 0.09 s vs 0.03 s per step, same tokens
    assert speed["speedup_oppo_vs_hf"] == "nan (hf: not in --modes)"
    # per engine: each step is resume -> step -> update_policy -> release_memory, then close once
    seq = [what for mode, what in FakeEngine.calls if mode == "oppo"]
    assert seq == ["release_memory"] + ["resume", "step", "update_policy", "release_memory"] * 3 + ["close"]
    steps = [r for r in csv.DictReader((tmp_path / "steps.csv").open()) if r["mode"] == "oppo"]
    assert len(steps) == 2  # warmup not measured
    want = sum(float(r["tokens_generated"]) for r in steps) / sum(float(r["wall_s"]) for r in steps)
    assert res["oppo"].tokens_per_s == pytest.approx(want)
    assert res["oppo"].peak_pages == 7 and res["oppo"].total_pages == 64
    assert float(steps[0]["wall_s"]) < 0.5  # the bench's own clock, not the engine's reported 1.0 s


def test_bad_arguments_are_rejected():
    with pytest.raises(SystemExit):
        bench_e2e.parse_args(["--modes", "hf,turbo"])
    with pytest.raises(SystemExit):
        bench_e2e.parse_args(["--batch-size", "4", "--steps", "3", "--warmup", "1", "--num-prompts", "15"])
    args = bench_e2e.parse_args(["--batch-size", "4", "--steps", "3", "--warmup", "1"])
    assert args.num_prompts == 20 and args.modes == list(bench_e2e.ALL_MODES)
