"""The documentation's links hold: README.md is a front door of at most 120 lines, every page of
docs/ is reachable from it, and no relative link, image or #anchor points nowhere.

Checked in README.md, docs/*.md, runtime/README.md and bench/README.md: every relative link and
image resolves to a file or folder inside the repository (a link out of it breaks on GitHub and
on a fresh clone), every ``#anchor``, in the page or in another Markdown page, names a heading of
its target by GitHub's slug rules, and every absolute link is a well-formed http(s) URL (not
fetched: no network). Links inside code blocks and code spans are not links.
"""

from __future__ import annotations

import re
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = REPO / "docs"
README_MAX_LINES = 120


def checked_pages(repo: Path = REPO) -> list[Path]:
    pages = [repo / "README.md", *sorted((repo / "docs").glob("*.md"))]
    pages += [p for p in (repo / "runtime" / "README.md", repo / "bench" / "README.md") if p.is_file()]
    return [p for p in pages if p.is_file()]


FENCE = re.compile(r"^\s{0,3}(`{3,}|~{3,})")
CODE_SPAN = re.compile(r"(`+)(?:(?!\1)[^\n]|\n(?![ \t]*\n))+?\1")
# [text](target) and ![alt](target): the text may hold one level of brackets (an image in a link)
# and run over lines, not over paragraphs.
_TEXT = r"(?:[^\[\]\n]|\n(?![ \t]*\n)|\[[^\[\]\n]*\])*"
INLINE_LINK = re.compile(
    r"!?\[" + _TEXT + r"\]\(\s*(<[^>\n]*>|[^()\s]*(?:\([^()\s]*\)[^()\s]*)*)"
    r"(?:\s+(?:\"[^\"]*\"|'[^']*'|\([^)]*\)))?\s*\)"
)
REFERENCE_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)")
HTML_LINK = re.compile(r"<(?:a|img)\b[^>]*?\b(?:href|src)\s*=\s*\"([^\"]*)\"", re.IGNORECASE)
HTML_ANCHOR = re.compile(r"<[a-z]+\b[^>]*?\b(?:id|name)\s*=\s*\"([^\"]*)\"", re.IGNORECASE)
ATX_HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)(?:\s+#+)?\s*$")
HOST = re.compile(
    r"^(?:[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?\.)*[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?$"
)


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of every line outside fenced code blocks."""
    out: list[tuple[int, str]] = []
    fence: str | None = None
    for number, line in enumerate(text.splitlines(), start=1):
        m = FENCE.match(line)
        if fence is None and m:
            fence = m.group(1)[0] * len(m.group(1))
            continue
        if fence is not None:
            if line.strip().startswith(fence) and set(line.strip()) <= {fence[0]}:
                fence = None
            continue
        out.append((number, line))
    return out


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading's text: markup dropped, lowercase, every character but
    letters, digits, spaces, ``-`` and ``_`` removed, each space a ``-``."""
    text = re.sub(r"!?\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\([^)]*\)", r"\1", heading)  # links: their text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = text.strip().lower()
    text = "".join(ch for ch in text if ch.isalnum() or ch in " -_")
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every anchor a page defines: its headings' slugs (a repeated one gets -1, -2, ...) and
    explicit HTML ids."""
    seen: dict[str, int] = {}
    found: set[str] = set()
    for _, line in prose_lines(page.read_text(encoding="utf-8")):
        m = ATX_HEADING.match(line)
        if m:
            slug = github_slug(m.group(2))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            found.add(slug if n == 0 else f"{slug}-{n}")
        found.update(HTML_ANCHOR.findall(line))
    return found


@dataclass(frozen=True)
class Link:
    page: Path
    line: int
    target: str


def links(page: Path) -> list[Link]:
    """Every link and image of a page, outside code, with the line it starts on."""
    kept = dict(prose_lines(page.read_text(encoding="utf-8")))
    total = max(kept, default=0)
    lines = [kept.get(n, "") for n in range(1, total + 1)]  # code blocks blanked, lines kept in place
    out: list[Link] = []
    for number, line in enumerate(lines, start=1):
        m = REFERENCE_DEF.match(line)
        if m and ATX_HEADING.match(line) is None:
            out.append(Link(page, number, m.group(1).strip("<>")))
            lines[number - 1] = ""
    text = "\n".join(lines)
    text = CODE_SPAN.sub(lambda s: re.sub(r"[^\n]", " ", s.group(0)), text)

    def line_of(offset: int) -> int:
        return text.count("\n", 0, offset) + 1

    out += [Link(page, line_of(m.start()), m.group(1).strip("<>")) for m in INLINE_LINK.finditer(text)]
    out += [Link(page, line_of(m.start()), m.group(1)) for m in HTML_LINK.finditer(text)]
    return sorted(out, key=lambda link: link.line)


def problem(link: Link, repo: Path = REPO) -> str | None:
    """What is wrong with one link, or None."""
    target = link.target
    where = f"{link.page.relative_to(repo)}:{link.line}: {target!r}"
    if not target:
        return f"{where}: empty link"
    parts = urllib.parse.urlsplit(target)
    if parts.scheme:
        if parts.scheme == "mailto":
            return None if re.fullmatch(r"[^@\s]+@[^@\s]+", parts.path) else f"{where}: malformed mailto"
        if parts.scheme not in ("http", "https"):
            return f"{where}: scheme {parts.scheme!r} (only http, https or a relative path)"
        host = parts.hostname or ""
        if not parts.netloc or not HOST.match(host) or ("." not in host and host != "localhost"):
            return f"{where}: malformed URL (host {host!r})"
        if any(ch.isspace() for ch in target):
            return f"{where}: malformed URL (whitespace)"
        return None
    if target.startswith("//"):
        return f"{where}: protocol-relative URL"
    path, _, anchor = target.partition("#")
    path = urllib.parse.unquote(path)
    if path.startswith("/"):
        return f"{where}: absolute path (links must be relative to the page)"
    dest = (link.page.parent / path).resolve() if path else link.page.resolve()
    if not dest.is_relative_to(repo.resolve()):
        return f"{where}: points outside the repository"
    if not dest.exists():
        return f"{where}: {dest.relative_to(repo.resolve())} does not exist"
    if anchor and dest.suffix == ".md":
        if anchor not in anchors(dest):
            return f"{where}: no heading #{anchor} in {dest.relative_to(repo.resolve())}"
    elif anchor and dest.is_dir():
        return f"{where}: an anchor on a folder"
    return None


def problems(page: Path, repo: Path = REPO) -> list[str]:
    return [p for link in links(page) if (p := problem(link, repo)) is not None]


@pytest.mark.parametrize("page", checked_pages(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_link_and_anchor_resolves(page: Path) -> None:
    found = problems(page)
    assert not found, "broken links:\n" + "\n".join(found)


def test_every_docs_page_is_linked_from_the_readme() -> None:
    linked = {
        (README.parent / urllib.parse.unquote(link.target.partition("#")[0])).resolve()
        for link in links(README)
        if not urllib.parse.urlsplit(link.target).scheme and link.target.partition("#")[0]
    }
    pages = sorted(DOCS.glob("*.md"))
    assert pages, "docs/ has no pages"
    orphans = [str(p.relative_to(REPO)) for p in pages if p.resolve() not in linked]
    assert not orphans, "pages of docs/ not linked from README.md: " + ", ".join(orphans)


def test_the_readme_is_a_front_door() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines (at most {README_MAX_LINES}): move the detail to a page of docs/"
    )


def test_the_checker_catches_what_it_is_for(tmp_path: Path) -> None:
    """The checks can fail: a broken file link, a missing anchor (in the page and across pages),
    a link out of the repository and a malformed URL are each reported; code is not a link."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text(
        "# Page A\n\n## How the canary verdict decides\n\n## Notes\n\n## Notes\n\n### Closing hashes ##\n"
    )
    page = tmp_path / "README.md"
    page.write_text(
        "# Title\n\n"
        "[ok](docs/a.md) [ok](docs/a.md#how-the-canary-verdict-decides) [ok](docs/a.md#notes-1) [ok](docs/a.md#closing-hashes) [ok](#title)\n"
        "![ok](docs/a.md) [ok](https://github.com/batchpilot/batchpilot) `[code](missing.md)`\n"
        "```\n[fenced](missing.md)\n```\n"
        "[gone](docs/missing.md) [bad anchor](docs/a.md#no-such-heading) [bad here](#nope)\n"
        "[out](../outside.md) [bad url](https:/example.com/x) [bad host](http://-bad-/x)\n"
        "[a link over\ntwo lines](docs/gone-too.md)\n"
    )
    found = problems(page, tmp_path)
    assert len(found) == 7, found
    assert any("README.md:10: 'docs/gone-too.md'" in p for p in found), found
    assert any("docs/missing.md does not exist" in p for p in found)
    assert any("no heading #no-such-heading in docs/a.md" in p for p in found)
    assert any("no heading #nope in README.md" in p for p in found)
    assert any("../outside.md" in p and "outside the repository" in p for p in found)
    assert sum("malformed URL" in p for p in found) == 2
    assert github_slug("Metrics (`GET /metrics`)") == "metrics-get-metrics"
    assert github_slug("The pod's HTTP loop") == "the-pods-http-loop"
    assert github_slug("`make up`: a local stack to drive by hand") == "make-up-a-local-stack-to-drive-by-hand"
    assert (
        github_slug("Admin endpoints (for the tuner; next to `/metrics`)")
        == "admin-endpoints-for-the-tuner-next-to-metrics"
    )
