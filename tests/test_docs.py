"""The README is one screen and every link in it and in docs/ leads somewhere."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    return {slug(line.lstrip("#")) for line in page.read_text().splitlines() if line.startswith("#")}


def test_the_readme_is_one_screen_and_links_every_docs_page():
    text = (ROOT / "README.md").read_text()
    assert len(text.encode()) <= 10 * 1024
    for page in (ROOT / "docs").glob("*.md"):
        assert f"(docs/{page.name})" in text, page.name


def test_every_link_resolves():
    broken = []
    for page in PAGES:
        for target in LINK.findall(page.read_text()):
            if target.startswith(("http://", "https://")):
                continue
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            if not resolved.exists() or (anchor and resolved.is_file() and anchor not in anchors(resolved)):
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, broken


def test_each_docs_page_starts_with_the_question_it_answers():
    for page in (ROOT / "docs").glob("*.md"):
        lines = page.read_text().splitlines()
        assert lines[0].startswith("# ") and lines[2].startswith("*") and lines[2].rstrip().endswith("?*"), page.name
