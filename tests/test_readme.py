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


def _table(title: str) -> dict[str, str]:
    """Name -> documented default of the README's defaults table whose first header cell is ``title``."""
    text = README.read_text()
    start = text.index(f"| `{title}`")
    rows = {}
    for line in text[start:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        name_cell, value_cell = line.split("|")[1:3]
        names = re.findall(r"`(\w+)`", name_cell)
        values = re.findall(r"`([^`]+)`", value_cell)
        assert len(names) == len(values), line
        rows.update(zip(names, values, strict=True))
    return rows


def test_readme_defaults_tables_match_the_code():
    import ast
    import dataclasses

    from oppo_engine import EngineConfig
    from oppo_engine.control import ChunkControl, DeltaControl

    for cls, title in (
        (EngineConfig, "EngineConfig"),
        (ChunkControl, "ChunkControl"),
        (DeltaControl, "DeltaControl"),
    ):
        documented = _table(title)
        defaults = {
            f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING
        }
        assert documented, title
        for name, value in documented.items():
            assert name in defaults, f"{title}.{name} is documented but not a field with a default"
            assert ast.literal_eval(value) == defaults[name], (
                f"{title}.{name}: README {value}, code {defaults[name]!r}"
            )
