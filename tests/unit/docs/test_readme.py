"""The README stays a front door, and the documentation's links stay whole.

CI runs the README's test command, so README.md must keep naming ``make test`` (and
``make run``, the other of the two commands); past 300 lines it is a manual again, whose
place is docs/ and bench/README.md. Every relative link in the README, the docs pages and
the benchmark write-ups must reach an existing file and, when it names an anchor, a
heading of that file (as GitHub derives anchors from headings), so a page moved or a
section renamed is caught here rather than by a reader.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
README = ROOT / "README.md"
MAX_README_LINES = 300

FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)
SCHEME = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)


def documents() -> list[Path]:
    """The pages whose links are checked: the README, the docs, the benchmark write-ups and
    the notes kept beside them."""
    pages = [README, ROOT / "bench" / "README.md"]
    pages += sorted((ROOT / "docs").glob("*.md"))
    pages += sorted((ROOT / "bench" / "results").glob("*.md"))
    return [p for p in pages if p.is_file()]


def prose(text: str) -> str:
    """``text`` without fenced code blocks and code spans, where brackets are not links."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to
    hyphens (letters, digits, ``_`` and ``-`` are kept, in any script)."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every anchor of ``page``'s headings; a repeated heading gets ``-1``, ``-2``, ..."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    for heading in HEADING.findall(FENCE.sub("", page.read_text(encoding="utf-8"))):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(page: Path, root: Path = ROOT) -> list[str]:
    """The relative links of ``page`` that reach no file, or no heading of it (paths shown
    from ``root``)."""
    root = root.resolve()
    broken = []
    for target in LINK.findall(prose(page.read_text(encoding="utf-8"))):
        if SCHEME.match(target):
            continue  # an outside address: not this repository's to keep
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no file {dest.relative_to(root)}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(root)}")
    return broken


def test_readme_is_a_front_door() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_README_LINES, (
        f"README.md has {len(lines)} lines (at most {MAX_README_LINES}): move reference "
        "material to docs/ and benchmark write-ups to bench/README.md")


def test_readme_names_the_two_commands() -> None:
    text = README.read_text(encoding="utf-8")
    assert "make test" in text  # CI runs the README's test command
    assert "make run" in text


@pytest.mark.parametrize("page", documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    assert broken_links(page) == []


def test_slug_follows_github() -> None:
    assert slug("Evaluation (Symphony §4)") == "evaluation-symphony-4"
    assert slug("A session's next turn on another node") == (
        "a-sessions-next-turn-on-another-node")
    assert slug("The `overture` command") == "the-overture-command"
    assert slug("Admission by TTFT deadline (§6.3, Algorithm 2)") == (
        "admission-by-ttft-deadline-63-algorithm-2")


def test_a_broken_link_is_caught(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# Top\n\n[here](#top) [gone](#nowhere) [file](missing.md)\n"
                    "`[not](a-link.md)`\n\n```\n[nor](this.md)\n```\n", encoding="utf-8")
    assert broken_links(page, tmp_path) == [
        "#nowhere: no heading #nowhere in page.md",
        "missing.md: no file missing.md",
    ]
