"""bench/device_check.sh on a machine without CUDA: a dry run that skips every GPU step, brings back two
files, and refuses caps that add up past its budget."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "device_check.sh"
GPU_STEPS = (
    "build",
    "cuda-tests",
    "e2e",
    "twin",
    "decode",
    "kernel-tests",
    "groups",
    "fsdp-replica",
    "remote",
)

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the dry run is for machines without CUDA")


def run(tmp_path: Path, **env) -> subprocess.CompletedProcess:
    full = {**os.environ, "PYTHON": sys.executable, "OUT_DIR": str(tmp_path / "out"), **env}
    return subprocess.run(["bash", str(SCRIPT)], env=full, capture_output=True, text=True, timeout=120)


def test_dry_run_skips_every_gpu_step_and_packs_its_logs_into_one_archive(tmp_path):
    done = run(tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    for step in GPU_STEPS:
        assert f"== {step}: skipped: no CUDA" in done.stdout
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == ["device_check_logs.tar.gz", "summary.txt"]
    with tarfile.open(out / "device_check_logs.tar.gz") as archive:
        assert {"./machine.log", "./summary.txt"} <= set(archive.getnames())
    summary = (out / "summary.txt").read_text()
    assert all(f"{step}" in summary for step in GPU_STEPS) and "all steps passed" in summary


def test_caps_over_the_budget_are_refused_before_anything_runs(tmp_path):
    done = run(tmp_path, BUDGET_S="300")
    assert done.returncode == 2 and "over the 300s budget" in done.stderr
    assert not (tmp_path / "out").exists()
