"""The user docs hold together: every relative link in README.md and docs/*.md names a file that
exists, and a link to a heading (`page.md#anchor`) names a heading that page has, as GitHub
makes anchors of headings. The generated job-file reference is checked in tests/test_cli.py, the
README's Python examples in tests/test_api.py."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.conftest import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"(?<!\!)\[[^\]]*\]\(([^)\s]+)\)|\!\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped (not '-' or '_'), spaces to '-'."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    return {anchor(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", text, re.M)}


def links(page: Path) -> list[str]:
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    return [a or b for a, b in LINK.findall(text)]


def test_links_are_found():
    found = links(REPO / "README.md")
    assert "docs/reference.md" in found and "docs/faults.md#checkpoints-that-survive-a-restart" in found
    assert "plot-example.png" in links(REPO / "docs" / "trainer.md")  # an image


def test_the_anchor_of_a_heading_is_githubs():
    assert anchor("Kueue (`k8s.queue`)") == "kueue-k8squeue"
    assert anchor("Why did it fail? (`ddpkit why`)") == "why-did-it-fail-ddpkit-why"
    assert anchor("DDP settings: static_graph by default") == "ddp-settings-static_graph-by-default"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(page):
    found = links(page)
    broken = []
    for target in found:
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, fragment = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(f"{target}: no file {linked.relative_to(REPO) if linked.is_relative_to(REPO) else linked}")
        elif fragment and linked.suffix == ".md" and fragment not in anchors(linked):
            broken.append(f"{target}: no heading with anchor #{fragment} in {linked.name}")
    assert not broken, f"{page.relative_to(REPO)}: " + "; ".join(broken)


def test_the_readme_is_a_front_door():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 260, "README.md is the front door: move the detail to docs/"
    for page in PAGES[1:]:
        assert f"(docs/{page.name})" in readme, f"README.md does not link docs/{page.name}"
