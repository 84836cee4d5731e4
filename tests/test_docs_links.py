"""Every relative link in README.md and docs/*.md points to a file that exists, and every
``#anchor`` to a heading of its target (GitHub's anchor rule: lower case, punctuation dropped,
spaces to hyphens)."""
import re
from pathlib import Path

import pytest

from ditron_ops.testing.docs import doc_pages

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *doc_pages(ROOT)]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")


def anchor(heading: str) -> str:
    text = re.sub(r"[`*]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {anchor(m) for m in re.findall(r"^#{1,6} (.+)$", text, re.M)}


def links(page: Path) -> list:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return [a or b for a, b in LINK.findall(text)]


def test_anchor_rule():
    assert anchor("Errors and environment") == "errors-and-environment"
    assert anchor("`gemm_rs` and `gemm_ar`: GEMM fused") == "gemm_rs-and-gemm_ar-gemm-fused"


def test_pages_have_links():
    assert len(links(ROOT / "README.md")) >= 10


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_relative_links_resolve(page):
    bad = []
    for target in links(page):
        if re.match(r"^[a-z]+:", target):          # http:, https:, mailto:
            continue
        path, _, frag = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{target}: no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
        elif frag and dest.suffix == ".md" and frag not in anchors(dest):
            bad.append(f"{target}: no heading #{frag} in {dest.name}")
    assert not bad, f"{page.name}: " + "; ".join(bad)
