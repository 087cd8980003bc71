"""Internal link check of the built docs site and of the Markdown files outside it (README.md).

``python -m tests.doc_links site README.md`` (``make docs`` runs it after ``mkdocs build --strict``): every
relative ``href``/``src`` of every page under the site must name a file of the site, and a ``#fragment``
an ``id`` in that page; every relative link of a Markdown file must name a file of the repository, and a
fragment a heading of the target (GitHub's anchors). External links are not followed (CI is offline);
an absolute path (``/x``) is an error, since the site must open from disk as well as from a server.
"""

from __future__ import annotations

import re
import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit


class _Page(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.ids: set[str] = set()
        self.links: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for name, value in attrs:
            if value is None:
                continue
            if name == "id" or (tag == "a" and name == "name"):
                self.ids.add(value)
            elif name in ("href", "src") and tag in ("a", "link", "img", "script", "source"):
                self.links.append(value)


def _external(url: str) -> bool:
    parts = urlsplit(url)
    return bool(parts.scheme) or url.startswith("//")


def check_site(site: Path) -> list[str]:
    """Broken internal links of the HTML pages under ``site``, one message each."""
    pages: dict[Path, _Page] = {}
    for path in sorted(site.rglob("*.html")):
        if path.parent == site and path.name == "404.html":
            continue  # served in place of any missing URL, so its links are absolute by design
        page = _Page()
        page.feed(path.read_text(encoding="utf-8"))
        pages[path.resolve()] = page
    errors = []
    for path, page in pages.items():
        where = path.relative_to(site.resolve())
        for url in page.links:
            if _external(url):
                continue
            parts = urlsplit(url)
            if parts.path.startswith("/"):
                errors.append(f"{where}: absolute link {url!r}")
                continue
            target = (path.parent / unquote(parts.path)).resolve() if parts.path else path
            if target.is_dir():
                target = target / "index.html"
            if not target.exists():
                errors.append(f"{where}: {url!r} names no file of the site")
            elif parts.fragment and target.suffix == ".html":
                if unquote(parts.fragment) not in pages[target].ids:
                    errors.append(f"{where}: {url!r}: no id {parts.fragment!r} in {target.name}")
    return errors


_CODE_FENCE = re.compile(r"^```.*?^```", re.S | re.M)
_INLINE_CODE = re.compile(r"`[^`\n]*`")
_MD_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]|<[^>]+>", "", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _prose(text: str) -> str:
    return _INLINE_CODE.sub("", _CODE_FENCE.sub("", text))


def check_markdown(path: Path) -> list[str]:
    """Broken relative links of one Markdown file, one message each."""
    errors = []
    for url in _MD_LINK.findall(_prose(path.read_text())):
        if _external(url):
            continue
        parts = urlsplit(url)
        if parts.path.startswith("/"):
            errors.append(f"{path.name}: absolute link {url!r}")
            continue
        target = (path.parent / unquote(parts.path)).resolve() if parts.path else path.resolve()
        if not target.exists():
            errors.append(f"{path.name}: {url!r} names no file")
        elif parts.fragment and target.suffix == ".md":
            anchors = {github_anchor(h) for h in _HEADING.findall(_prose(target.read_text()))}
            if parts.fragment not in anchors:
                errors.append(f"{path.name}: {url!r}: no heading {parts.fragment!r} in {target.name}")
    return errors


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m tests.doc_links SITE_DIR [FILE.md ...]", file=sys.stderr)
        return 2
    site, markdown = Path(argv[0]), [Path(a) for a in argv[1:]]
    if not (site / "index.html").exists():
        print(f"{site}/index.html is missing: run mkdocs build first", file=sys.stderr)
        return 2
    errors = check_site(site) + [e for md in markdown for e in check_markdown(md)]
    for error in errors:
        print(error)
    checked = sum(1 for p in site.rglob("*.html") if p.relative_to(site) != Path("404.html"))
    print(f"internal links: {checked} pages and {len(markdown)} Markdown files checked, {len(errors)} broken")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
