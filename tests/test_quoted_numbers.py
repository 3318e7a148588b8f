"""Numbers quoted in the configs and docs come from a record: a paragraph (a comment block of a config,
a paragraph or table row of a doc) that cites a results file, docs/results/*.md, quotes only numbers
that file holds (to the digits quoted), so a quote cannot drift from its measurement unnoticed. The
quickstart's numbers are tied to docs/quickstart/provenance.json (tests/loop/test_quickstart_docs.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.helpers.paths import REPO

NUMBER = re.compile(r"(?<![\w.])[-−]?\d+\.\d{2,}(?![\w.]\d)")
CITE = re.compile(r"docs/results/[\w-]+\.md")


def paragraphs(text: str, comments: bool) -> list[str]:
    """Config files: runs of comment lines (a trailing comment is its own block). Docs: runs of
    non-empty lines, and every table row on its own."""
    blocks: list[str] = []
    current: list[str] = []
    for line in text.splitlines():
        if comments:
            stripped = line.strip()
            if stripped.startswith("#"):
                current.append(stripped[1:])
                continue
            if "#" in line:
                blocks.append(line.split("#", 1)[1])
        elif line.startswith("|"):
            blocks.append(line)
            continue
        elif line.strip():
            current.append(line)
            continue
        if current:
            blocks.append(" ".join(current))
            current = []
    if current:
        blocks.append(" ".join(current))
    return blocks


def recorded(number: str, source: set[float], places: int) -> bool:
    value = float(number.replace("−", "-"))
    return any(abs(round(s, places) - value) < 1e-9 or abs(round(-s, places) - value) < 1e-9 for s in source)


def numbers_in(text: str) -> set[float]:
    return {float(n.replace("−", "-")) for n in re.findall(r"[-−]?\d+\.\d+", text)}


def unrecorded(path: Path) -> list[str]:
    """Every number of ``path`` that the results files its paragraph cites do not hold."""
    text = path.read_text()
    shown = path.relative_to(REPO) if path.is_relative_to(REPO) else path.name
    provenance = numbers_in((REPO / "docs" / "quickstart" / "provenance.json").read_text())
    found = []
    for block in paragraphs(text, comments=path.suffix == ".toml"):
        cited = {c for c in CITE.findall(block) if (REPO / c).is_file()}
        if not cited:
            continue
        source = set().union(*(numbers_in((REPO / c).read_text()) for c in cited)) | provenance
        for number in NUMBER.findall(block):
            places = len(number.split(".")[1])
            if not recorded(number, source, places):
                found.append(f"{shown}: {number} (cites {', '.join(sorted(cited))})")
    return found


QUOTING = sorted(
    [*REPO.glob("configs/**/*.toml"), *REPO.glob("docs/*.md"), REPO / "README.md", REPO / "BENCHMARKS.md"]
)


@pytest.mark.parametrize("path", QUOTING, ids=lambda p: str(p.relative_to(REPO)))
def test_a_quoted_number_is_in_the_results_file_it_cites(path: Path) -> None:
    assert unrecorded(path) == []


def test_the_check_sees_a_number_the_record_does_not_hold(tmp_path: Path) -> None:
    doc = tmp_path / "x.md"
    doc.write_text("Measured: 0.531 and 0.999 (docs/results/learning-household.md).\n\nNo citation: 0.999.\n")
    assert unrecorded(doc) == ["x.md: 0.999 (cites docs/results/learning-household.md)"]
