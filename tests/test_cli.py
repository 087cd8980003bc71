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
        (["--actor", "/nonexistent"], "--actor and --reward go together"),
    ],
)
def test_demo_bad_option_exits_2_with_a_message(tmp_path, capsys, args, match):
    cache = tmp_path / "cache"
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--device", "cpu", "--cache", str(cache), "--out", str(tmp_path / "out"), *args])
    assert exit_info.value.code == 2
    assert match in capsys.readouterr().err
    assert not cache.exists()  # refused before the task was built
