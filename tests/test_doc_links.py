"""Every relative Markdown link in the docs resolves: the file exists, and an ``#anchor``
names a heading of that file (GitHub's rule: lowercase, punctuation dropped, spaces to
hyphens, a repeated heading numbered ``-1``, ``-2``, ...) or an explicit ``<a name>``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted(
    [*(ROOT / "docs").glob("*.md"), ROOT / "README.md", ROOT / "bench" / "README.md"]
)

FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)
NAMED = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"", re.I)


def slug(heading: str) -> str:
    text = re.sub(r"<[^>]+>", "", heading)  # inline HTML
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)  # links keep their text
    text = text.lower()
    text = re.sub(r"[^\w\- ]", "", text)  # punctuation (backticks, dots, apostrophes...)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text())
    found: set[str] = set(NAMED.findall(text))
    seen: dict[str, int] = {}
    for heading in HEADING.findall(text):
        base = slug(heading)
        n = seen.get(base, 0)
        found.add(base if n == 0 else f"{base}-{n}")
        seen[base] = n + 1
    return found


def links(path: Path) -> list[str]:
    text = CODE.sub("", FENCE.sub("", path.read_text()))
    return [t for t in LINK.findall(text) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


def test_slug_follows_github():
    assert slug("Coding agents' sessions") == "coding-agents-sessions"
    assert slug("On the H200: `bench/device.sh`") == "on-the-h200-benchdevicesh"
    assert slug("MLX's own settings") == "mlxs-own-settings"
    assert slug("H200: 8 / 32 clients") == "h200-8--32-clients"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_and_anchors_resolve(doc: Path):
    broken = []
    for target in links(doc):
        file_part, _, anchor = target.partition("#")
        dest = (doc.parent / file_part).resolve() if file_part else doc
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, f"{doc.relative_to(ROOT)}: " + "; ".join(broken)
