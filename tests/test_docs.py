"""The docs pages (docs/**/*.md) show code that runs, links that resolve, and defaults that are the code's.

Every ```python block of a page runs as printed; the blocks of one page share one namespace, in the
page's order (``doc_blocks.run_page``). A block tagged ``<!-- notest: TAG -->`` (TAG one of
``doc_blocks.NOTEST_TAGS``) is only parsed. README.md's blocks run in tests/test_readme.py. A new page is
picked up by the glob.
"""

from __future__ import annotations

import ast
import dataclasses
import re

import pytest
import yaml
from doc_blocks import DOCS, FENCE_LANGUAGES, NOTEST_TAGS, ROOT, blocks, notest_lines, pages, run_page
from doc_links import check_markdown, check_site

DOC_PAGES = [p for p in pages() if p.is_relative_to(DOCS)]
RUNNABLE = [p for p in DOC_PAGES if any(b.lang == "python" and b.notest is None for b in blocks(p))]
GETTING_STARTED = DOCS / "getting-started.md"
DEFAULTS = DOCS / "defaults.md"


def _rel(path) -> str:
    return str(path.relative_to(ROOT))


def _trained_four_steps(scope: dict) -> None:
    engine, actor = scope["engine"], scope["actor"]
    assert engine.policy_version == 4  # one update per step, four steps
    assert all(p.grad is not None for p in actor.parameters() if p.requires_grad)


# What a page's blocks must have done, beyond not raising (by page name).
AFTERWARDS = {"getting-started.md": _trained_four_steps}


@pytest.mark.parametrize("page", RUNNABLE, ids=_rel)
def test_every_python_block_of_the_page_runs_as_printed(page, tmp_path):
    scope = run_page(page, tmp_path)
    AFTERWARDS.get(page.name, lambda _: None)(scope)


def test_every_notest_tag_is_known_precedes_a_python_block_and_is_listed_for_the_reader():
    listed = set(re.findall(r"^\| `([\w-]+)` \|", GETTING_STARTED.read_text(), re.M))
    assert listed == set(NOTEST_TAGS), (
        f"getting-started.md lists {sorted(listed)}, the tests {sorted(NOTEST_TAGS)}"
    )
    for page in pages():
        lines = page.read_text().splitlines()
        fences = {b.line: b for b in blocks(page)}
        for line, tag in notest_lines(page):
            where = f"{_rel(page)}:{line}"
            assert tag in NOTEST_TAGS, f"{where}: unknown notest tag {tag!r} (known: {sorted(NOTEST_TAGS)})"
            following = next((n for n in range(line + 1, len(lines) + 1) if lines[n - 1].strip()), None)
            block = fences.get(following)
            assert block is not None and block.lang == "python", (
                f"{where}: the next line opens no python block"
            )


def test_skipped_blocks_are_still_python_and_every_fence_names_its_language():
    for page in pages():
        for block in blocks(page):
            assert block.lang in FENCE_LANGUAGES, f"{block.where}: fence language {block.lang!r}"
            if block.lang == "python":
                ast.parse(block.code, block.where)  # a shell command in a python block fails here


def test_every_page_is_in_the_nav():
    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]

    def entries(node) -> set[str]:
        if isinstance(node, str):
            return {node}
        if isinstance(node, list):
            return set().union(*(entries(n) for n in node))
        return set().union(*(entries(v) for v in node.values()))

    missing = {_rel(p) for p in DOC_PAGES} - {f"docs/{e}" for e in entries(nav)}
    assert not missing, f"add these pages to nav: in mkdocs.yml: {sorted(missing)}"


def test_link_check_reports_a_missing_page_and_a_missing_anchor(tmp_path):
    site = tmp_path / "site"
    (site / "api").mkdir(parents=True)
    (site / "index.html").write_text(
        '<h2 id="modes">Modes</h2><a href="api/engine.html#step">ok</a><a href="#modes">ok</a>'
        '<a href="gone.html">missing page</a><a href="api/engine.html#nope">missing anchor</a>'
        '<a href="https://example.org/x">external</a><a href="/abs.html">absolute</a>'
    )
    (site / "api" / "engine.html").write_text('<div id="step"></div><a href="../index.html#modes">ok</a>')
    errors = check_site(site)
    assert len(errors) == 3, errors
    assert any("gone.html" in e for e in errors) and any("'nope'" in e for e in errors)
    assert any("absolute" in e for e in errors)

    md = tmp_path / "README.md"
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "page.md").write_text("# A page\n\n## Two overlaps\n")
    md.write_text(
        "[a](docs/page.md#two-overlaps) [b](docs/page.md#three) [c](docs/none.md) `[d](docs/code.md)`\n"
    )
    errors = check_markdown(md)
    assert len(errors) == 2 and "three" in errors[0] and "none.md" in errors[1], errors


def _defaults_table(title: str) -> dict[str, str]:
    """Name -> documented default of the defaults page's table whose first header cell is ``title``."""
    text = DEFAULTS.read_text()
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


def test_defaults_tables_match_the_code():
    from oppo_engine import EngineConfig, SamplingParams
    from oppo_engine.control import ChunkControl, DeltaControl
    from oppo_engine.ppo import PPOConfig

    for cls in (EngineConfig, ChunkControl, DeltaControl, SamplingParams, PPOConfig):
        title = cls.__name__
        documented = _defaults_table(title)
        defaults = {
            f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING
        }
        assert documented, title
        for name, value in documented.items():
            assert name in defaults, f"{title}.{name} is documented but not a field with a default"
            assert ast.literal_eval(value) == defaults[name], (
                f"{title}.{name}: docs {value}, code {defaults[name]!r}"
            )


def test_the_ppo_loop_runs_with_truncated_importance_weights(tmp_path):
    loop = next(b for b in blocks(GETTING_STARTED) if 'OFF_POLICY = "recompute"' in b.code)
    code = loop.code.replace('OFF_POLICY = "recompute"', 'OFF_POLICY = "truncated_is"')
    scope: dict = {"__name__": "docs_ppo_loop"}
    exec(compile(code, loop.where, "exec"), scope)  # noqa: S102 - the page's own example
    _trained_four_steps(scope)
