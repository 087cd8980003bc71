"""The code blocks of README.md and the docs pages (docs/**/*.md), as the tests run them.

Every ```` ```python ```` block runs as printed. The blocks of one page share one namespace, in the page's
order (a page may build its tiny models once and use them further down). A block that cannot run on the
CPU of the development machines and CI is preceded by the line ``<!-- notest: TAG -->``, TAG one of
``NOTEST_TAGS``: it is then only parsed, never run. Shell commands go in ```` ```bash ```` blocks, which are
never run. New pages are picked up by the glob: nothing to register.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"

# Why a block may be skipped; docs/getting-started.md lists the same tags for the reader.
NOTEST_TAGS = {
    "cuda": "needs a CUDA device",
    "torchrun": "runs in each process of a torchrun job (one per rank)",
    "multi-gpu": "needs several GPUs of one node",
    "multi-host": "needs processes on several hosts, or a service started outside the job",
}
# The languages a fenced block may name: only python runs.
FENCE_LANGUAGES = {"python", "bash", "text", "yaml", "toml"}

_FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[\w+-]*)[ \t]*$")
_NOTEST = re.compile(r"^<!--\s*notest:\s*(?P<tag>\S*)\s*-->$")


@dataclass(frozen=True, slots=True)
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    notest: str | None  # the tag of a preceding ``<!-- notest: TAG -->`` line

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def pages() -> list[Path]:
    """README.md and every page of docs/, in a stable order."""
    return [README, *sorted(DOCS.rglob("*.md"))]


def blocks(path: Path) -> list[Block]:
    """The fenced blocks of ``path`` in order. ``ValueError`` for a fence left open."""
    lines = path.read_text().splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        indent, start = opening["indent"], i
        body: list[str] = []
        i += 1
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i][len(indent) :] if lines[i].startswith(indent) else lines[i])
            i += 1
        if i == len(lines):
            raise ValueError(f"{path}:{start + 1}: a code fence is never closed")
        previous = next((lines[j].strip() for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        tag = _NOTEST.match(previous)
        found.append(Block(path, start + 1, opening["lang"], "\n".join(body) + "\n", tag and tag["tag"]))
        i += 1
    return found


def notest_lines(path: Path) -> list[tuple[int, str]]:
    """(line, tag) of every ``<!-- notest: ... -->`` line of ``path``."""
    return [
        (n, m["tag"])
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if (m := _NOTEST.match(line.strip()))
    ]


def run_page(path: Path, workdir: Path) -> dict:
    """Run the page's python blocks not tagged ``notest`` in one namespace, in order, from ``workdir`` (a
    block may write files); returns the namespace. A failing block raises with its page and line."""
    scope: dict = {"__name__": f"docs_{path.stem.replace('-', '_')}"}
    cwd = Path.cwd()
    os.chdir(workdir)
    try:
        for block in blocks(path):
            if block.lang != "python" or block.notest is not None:
                continue
            # A block's line numbers in a traceback are the page's own.
            code = "\n" * block.line + block.code
            exec(compile(code, str(path), "exec"), scope)  # noqa: S102 - the page's own example
    finally:
        os.chdir(cwd)
    return scope
