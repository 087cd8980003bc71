"""pytest set-up for the microbenchmarks: `make bench` runs `pytest bench --benchmark-only`.

pytest collects only `test_*.py` by default, and `tests/` is the only testpath, so `make test` never sees
these files. Here `bench_*.py` modules that hold pytest-benchmark functions (`def test_...`) are collected;
the command-line benchmarks beside them (`bench_e2e.py`, `bench_attention.py`) are scripts and are not
imported.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> pytest.Module | None:
    if (
        file_path.suffix == ".py"
        and file_path.name.startswith("bench_")
        and "def test_" in file_path.read_text()
    ):
        return pytest.Module.from_parent(parent, path=file_path)
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
