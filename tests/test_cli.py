"""``oppo-engine demo``: the README's main job runs end to end and reports bad options cleanly."""

from __future__ import annotations

import pytest

from oppo_engine.cli import main


def test_demo_drains_every_prompt_and_frees_every_page(capsys):
    assert (
        main(["demo", "--device", "cpu", "--prompts", "5", "--batch-size", "2", "--max-new-tokens", "4"]) == 0
    )
    out = capsys.readouterr().out
    assert "5 rollouts in 3 steps" in out
    assert "pages free after draining" in out


@pytest.mark.parametrize(
    ("flag", "value", "match"), [("--mode", "turbo", "mode"), ("--batch-size", "0", "batch_size")]
)
def test_demo_bad_option_exits_2_with_a_message(capsys, flag, value, match):
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--device", "cpu", flag, value])
    assert exit_info.value.code == 2
    assert match in capsys.readouterr().err
