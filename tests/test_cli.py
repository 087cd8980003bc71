"""``oppo-engine demo``: bad options are refused with a message before anything is built or trained.
(The demo end to end: tests/test_ppo.py::test_demo_writes_table_plots_and_traces.)"""

from __future__ import annotations

import pytest

from oppo_engine.cli import main


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["--batch-size", "0"], "batch_size"),
        (["--modes", "sequential,turbo"], "turbo"),
        (["--steps", "0"], "--steps"),
        (["--task", "polite", "--actor", "/nonexistent"], "--actor and --reward go together"),
        (["--nproc", "0"], "--nproc must be >= 1"),
        (["--fsdp"], "--fsdp runs under torchrun"),
        (["--max-policy-lag", "0"], "max_policy_lag"),
        (["--max-policy-lag", "two"], "an int >= 1 or 'none'"),
        (["--overcommit", "64"], "overcommit"),  # Δ > B under a lag bound: refused by the engine's config
        (["--task", "math", "--reward", "/nonexistent"], "--task math is scored by a rule: no --reward"),
        (["--task", "math", "--batch-size", "0"], "batch_size"),
        (["--task", "polite", "--rollout-dtype", "bf16"], "applies to --task math only"),
        (["--rollout-dtype", "fp16"], "invalid choice"),
    ],
)
def test_demo_bad_option_exits_2_with_a_message(tmp_path, capsys, args, match):
    cache = tmp_path / "cache"
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--device", "cpu", "--cache", str(cache), "--out", str(tmp_path / "out"), *args])
    assert exit_info.value.code == 2
    assert match in capsys.readouterr().err
    assert not cache.exists()  # refused before the task was built


def test_bare_command_prints_help_not_an_argparse_error(capsys):
    assert main([]) == 0
    out = capsys.readouterr()
    assert "usage: oppo-engine" in out.out and "demo" in out.out and "bench" in out.out
    assert "required" not in out.err


@pytest.mark.parametrize(
    ("args", "prog", "defaults"),
    [
        (["--help"], "usage: oppo-engine", []),
        (
            ["demo", "--help"],
            "usage: oppo-engine demo",
            [
                "(None: 30; 18 with --task math)",
                "(None: 32, also with --task math)",
                "(default: math)",
                "torch device",
            ],
        ),
        (["bench", "--help"], "usage: oppo-engine bench", ["(default: tiny)", "(default: 3)"]),
        (["trace", "--help"], "usage: oppo-engine trace", ["(default: longtail)"]),
        (
            ["serve-scorers", "--help"],
            "usage: oppo-engine serve-scorers",
            ["(default: 16)", "tcp://HOST:PORT"],
        ),
    ],
)
def test_every_help_shows_its_program_name_and_defaults(capsys, args, prog, defaults):
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(prog), out[:80]
    for text in defaults:
        assert text in " ".join(out.split()), text  # argparse wraps lines
    assert "python -m bench" not in out


def _wait_policy(env: dict[str, str]) -> list[str]:
    import subprocess
    import sys

    code = (
        "import os, sys; assert 'torch' not in sys.modules; import oppo_engine.cli; "
        "print(os.environ.get('OMP_WAIT_POLICY', '-'), os.environ.get('GOMP_SPINCOUNT', '-'), "
        "'torch' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return done.stdout.split()


def test_the_cli_bounds_openmp_threads_spinning_at_barriers_before_torch_loads_unless_told_otherwise():
    import os

    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    assert _wait_policy(env) == ["-", "2000", "True"]  # a short spin, set before torch (its OpenMP) loaded
    assert _wait_policy(env | {"OMP_WAIT_POLICY": "PASSIVE"}) == ["PASSIVE", "-", "True"]  # the user's wins
    assert _wait_policy(env | {"GOMP_SPINCOUNT": "0"}) == ["-", "0", "True"]
