"""README.md and docs/*.md: every relative link and image points to an existing file, every docs
page is linked from the README's index, and the README stays short. No engine, no network."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
MAX_README_LINES = 250

# [text](target) and ![alt](target), with an optional "title"; <target> form too.
INLINE = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
# [label]: target (reference definitions)
REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$", re.MULTILINE)
# <img src="...">
IMG_SRC = re.compile(r"<img\s[^>]*src=\"([^\"]+)\"", re.IGNORECASE)
FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"`[^`\n]*`")


def markdown_files() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def links_in(markdown: str) -> list[str]:
    """Link and image targets of Markdown text, outside code blocks and code spans."""
    text = CODE_SPAN.sub("", FENCE.sub("", markdown))
    return [m.group(1) for pattern in (INLINE, REFERENCE, IMG_SRC) for m in pattern.finditer(text)]


def links(path: Path) -> list[str]:
    return links_in(path.read_text(encoding="utf-8"))


def is_relative(target: str) -> bool:
    return not re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) and not target.startswith(("#", "//"))


def resolve(path: Path, target: str) -> Path:
    file_part = unquote(target.split("#", 1)[0].split("?", 1)[0])
    return (path.parent / file_part).resolve()


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_to_existing_files(path: Path) -> None:
    missing = [t for t in links(path) if is_relative(t) and not resolve(path, t).exists()]
    assert not missing, f"{path.relative_to(ROOT)}: links to missing files: {missing}"


def test_every_docs_page_is_in_the_readme_index() -> None:
    linked = {resolve(README, t) for t in links(README) if is_relative(t)}
    orphans = [p.relative_to(ROOT).as_posix() for p in sorted(DOCS.glob("*.md")) if p.resolve() not in linked]
    assert not orphans, f"docs pages not linked from README.md: {orphans}"


def test_readme_is_short() -> None:
    n_lines = len(README.read_text(encoding="utf-8").splitlines())
    assert n_lines <= MAX_README_LINES, f"README.md has {n_lines} lines (at most {MAX_README_LINES})"


def test_link_parser_sees_links_and_skips_code() -> None:
    text = '[a](x.md) ![i](img/p.png "t") `[no](code.md)`\n```\n[no](fenced.md)\n```\n[r]: ref.md\n<img src="b.png">\n'
    assert sorted(links_in(text)) == ["b.png", "img/p.png", "ref.md", "x.md"]
    assert not is_relative("https://example.org") and not is_relative("#anchor") and is_relative("a.md#b")
