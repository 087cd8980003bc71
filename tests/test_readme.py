"""README.md stays a front page: at most 250 lines, its quickstart runs as printed and trains, its links
resolve, its results are the docs' front page's, and it reads as documentation, not as a lab notebook
(dated runs, machine loads and the history of the work belong on docs/benchmarks.md)."""

from __future__ import annotations

import re

from doc_blocks import DOCS, README, blocks, run_page
from doc_links import check_markdown

MAX_LINES = 250


def test_readme_is_at_most_250_lines():
    lines = len(README.read_text().splitlines())
    assert lines <= MAX_LINES, f"README.md has {lines} lines; move detail to a page under docs/"


def test_readme_quickstart_runs_as_printed_and_trains(tmp_path):
    assert [b.lang for b in blocks(README) if b.lang == "python"] == ["python"]  # one quickstart
    quickstart = next(b for b in blocks(README) if b.lang == "python")
    assert 20 <= len(quickstart.code.splitlines()) <= 35  # a loop to copy, not a framework
    scope = run_page(README, tmp_path)
    engine, actor = scope["engine"], scope["actor"]
    assert engine.policy_version == 3  # one update per step, three steps
    assert all(p.grad is not None for p in actor.parameters() if p.requires_grad)  # it trained


def test_readme_links_and_anchors_resolve():
    assert check_markdown(README) == []


def _results(path, columns: int) -> list[tuple[str, ...]]:
    text = path.read_text()
    table = text[text.index("| measured |") :].split("\n\n")[0].splitlines()[2:]
    return [tuple(cell.strip() for cell in row.split("|")[1 : 1 + columns]) for row in table]


def test_readme_results_are_the_docs_front_page_results():
    assert _results(README, 2) == _results(DOCS / "index.md", 2)


def test_readme_names_no_issue_branch_session_commit_or_machine_load():
    text = README.read_text()
    for pattern in (
        r"\bissues? #?\d+",
        r"(?<![\w`])#\d+\b",
        r"\bthis (branch|session|PR)\b",
        r"\bbranch(es)?\b",
        r"\b[0-9a-f]{7,40}\b",  # a commit
        r"\bload (of|~|at)\b|\bat a load\b|\bloaded machine\b",
    ):
        found = re.search(pattern, text, re.I)
        assert found is None, (
            f"README.md: {found.group(0)!r} ({pattern}) belongs on docs/benchmarks.md or nowhere"
        )
