"""The guides in docs/: every job-file example marked `job-example` is a valid job file, and every
relative link in them and in the README points at a file (and a heading) that exists. The examples
that run end to end are run by tests/test_readme.py, which also requires every fenced block to be
marked."""

from __future__ import annotations

import re

import pytest
import yaml
from jobkit import REPO

from batchgen.job.spec import spec_problems

DOCS = sorted((REPO / "docs").glob("*.md"))
PAGES = [REPO / "README.md", *DOCS]
EXAMPLE = re.compile(r"<!-- readme-test: job-example -->\n```yaml\n(.*?)```", re.S)
LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchors(text: str) -> set[str]:
    """GitHub's anchors for a page's headings: lower case, punctuation dropped, spaces to dashes."""
    out = set()
    for heading in re.findall(r"^#+ (.+)$", text, re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        out.add(slug)
    return out


def job_examples() -> list[tuple[str, str]]:
    return [(page.name, body) for page in DOCS for body in EXAMPLE.findall(page.read_text(encoding="utf-8"))]


def test_there_are_guides_and_job_examples():
    assert len(DOCS) >= 10 and len(job_examples()) >= 8


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
