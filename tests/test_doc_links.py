"""Every link between the project's Markdown documents leads somewhere: the file exists and, for a
``#fragment``, a heading of that file makes that anchor (as GitHub makes them: lowercase, punctuation
dropped, spaces as hyphens, ``-1``, ``-2`` for repeats). Renaming a section breaks no link unseen."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ["README.md", "CONTRIBUTING.md", "learner/benchmarks/README.md", "k8s/README.md"]


def _prose(path: Path) -> str:
    """``path``'s text without its fenced code blocks (whose ``#`` lines are comments, not headings)."""
    return re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S)


def anchors(path: Path) -> set[str]:
    """The anchors GitHub makes for ``path``'s headings."""
    made: set[str] = set()
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#{1,6} (.*)$", _prose(path), flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        repeat = seen.get(slug, 0)
        seen[slug] = repeat + 1
        made.add(slug if repeat == 0 else f"{slug}-{repeat}")
    return made


def test_the_anchor_rule_matches_githubs() -> None:
    """(The rule itself, on headings of the kinds the documents have.)"""
    doc = ROOT / "README.md"
    made = anchors(doc)
    assert {"quickstart", "slow-envs---overlap-update", "resuming---resume", "the-step-socket"} <= made


@pytest.mark.parametrize("doc", DOCS)
def test_every_link_between_the_documents_leads_somewhere(doc: str) -> None:
    path = ROOT / doc
    broken = []
    for link in re.findall(r"\]\(([^)\s]+)\)", _prose(path)):
        if re.match(r"[a-z]+:", link):
            continue  # (https:, mailto:: outside the repository)
        file, _, fragment = link.partition("#")
        target = (path.parent / file).resolve() if file else path
        if not target.exists():
            broken.append(f"{link} (no file {target.relative_to(ROOT)})")
        elif fragment and target.suffix == ".md" and fragment not in anchors(target):
            broken.append(f"{link} (no heading of {target.relative_to(ROOT)} makes #{fragment})")
    assert not broken, f"{doc}: links that lead nowhere: {broken}"
