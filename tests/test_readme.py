"""README.md's "bring your own PPO loop" runs as printed: it trains through the public API, handles
policy_versions, and asserts the policy-lag bound on every rollout it gets."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"
MARKER = "<!-- doctest: bring-your-own-ppo-loop -->"


def _example() -> str:
    text = README.read_text()
    assert MARKER in text, "the README lost its tested example"
    block = re.search(r"```python\n(.*?)```", text[text.index(MARKER) :], re.S)
    assert block is not None
    return block.group(1)


def test_readme_ppo_loop_runs_as_printed():
    code = _example()
    assert 30 <= len(code.splitlines()) <= 60  # a loop to copy, not a framework
    scope: dict = {"__name__": "readme_example"}
    exec(compile(code, str(README), "exec"), scope)  # noqa: S102 - the README's own example
    engine, actor = scope["engine"], scope["actor"]
    assert engine.policy_version == 4  # one update per step, four steps
    assert all(p.grad is not None for p in actor.parameters() if p.requires_grad)  # it trained


def test_readme_ppo_loop_runs_with_truncated_importance_weights():
    code = _example().replace('OFF_POLICY = "recompute"', 'OFF_POLICY = "truncated_is"')
    assert '"truncated_is"' in code.split("for step")[0]
    scope: dict = {"__name__": "readme_example"}
    exec(compile(code, str(README), "exec"), scope)  # noqa: S102
    assert scope["engine"].policy_version == 4
