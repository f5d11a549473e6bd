"""The guides in docs/: every job-file example is a valid job file, and every relative link in
them and in the README points at a file (and a heading) that exists. Examples that run end to end
are run by tests/test_readme.py (and the guide's own tests)."""

from __future__ import annotations

import re

import pytest
import yaml
from jobkit import REPO

from batchgen.job.spec import spec_problems

DOCS = sorted((REPO / "docs").glob("*.md"))
PAGES = [REPO / "README.md", *DOCS]
FENCE = re.compile(r"```(\w*)\n(.*?)```", re.S)
LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchors(text: str) -> set[str]:
    """GitHub's anchors for a page's headings: lower case, punctuation dropped, spaces to dashes."""
    out = set()
    for heading in re.findall(r"^#+ (.+)$", text, re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        out.add(slug)
    return out


def job_examples() -> list[tuple[str, str]]:
    found = []
    for page in DOCS:
        for lang, body in FENCE.findall(page.read_text(encoding="utf-8")):
            if lang == "yaml":
                data = yaml.safe_load(body)
                if isinstance(data, dict) and {"model", "input", "output"} <= set(data):
                    found.append((page.name, body))
    return found


def test_there_are_guides_and_job_examples():
    assert len(DOCS) >= 2 and len(job_examples()) >= 3


@pytest.mark.parametrize(("page", "body"), job_examples(), ids=lambda x: x if x.endswith(".md") else "")
def test_every_job_example_in_the_guides_is_a_valid_job_file(page, body):
    assert spec_problems(yaml.safe_load(body)) == [], f"{page}:\n{body}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_resolve(page):
    text = page.read_text(encoding="utf-8")
    for target in LINK.findall(text):
        if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        assert dest.exists(), f"{page.name}: link to {target} (no {dest})"
        if anchor and dest.suffix == ".md":
            assert anchor in anchors(dest.read_text(encoding="utf-8")), f"{page.name}: no heading for #{anchor}"
