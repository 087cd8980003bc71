"""Test set-up shared by every suite.

Without CUDA the Triton kernels run under the interpreter, which must be chosen before triton is imported.
Tests marked ``cuda`` are skipped where no CUDA device exists.
"""

import os
import tempfile

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# A profile calibrated on this machine (oppo-engine calibrate) would give every engine of the tests a chunk
# prior that a fresh machine lacks: the tests read profiles only from where they write them.
os.environ["OPPO_ENGINE_PROFILES"] = tempfile.mkdtemp(prefix="oppo-profiles-")

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
