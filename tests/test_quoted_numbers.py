"""Numbers quoted in the configs and docs come from a record: a paragraph (a comment block of a config,
a paragraph or table row of a doc) that cites a results file, docs/results/*.md, quotes only numbers
that file holds (to the digits quoted), so a quote cannot drift from its measurement unnoticed. The
quickstart's numbers are tied to docs/quickstart/provenance.json (tests/loop/test_quickstart_docs.py).

A pointer to a section of a doc (``docs/results/speed.md "Advantage stages"``, ``docs/credit.md
"Similarity states"``, ``BENCHMARKS.md "..."``, or ``section "..."`` inside a results file), in the
docs, configs, benchmarks, tools, tests and the code of graft_cli/, stages/ and schemas/, names a
heading that exists in that file, so a section that moves or is renamed cannot leave a dangling
pointer behind."""

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


# ---------------------------------------------------------------------------------------------
# pointers to results sections

POINTER = re.compile(
    r'(?:(docs/[\w/-]+\.md|BENCHMARKS(?:\.md)?),?(?: sections?| table)?|(?<![-\w])(?:section|table)) "([^"]+)"'
)
POINTING = sorted(
    {
        *QUOTING,
        *REPO.glob("docs/results/*.md"),
        *REPO.glob("bench/**/*.py"),
        *REPO.glob("tools/**/*.py"),
        *REPO.glob("tests/**/*.py"),
        *REPO.glob("stages/**/*.py"),
        *REPO.glob("schemas/**/*.py"),
        *REPO.glob("graft_cli/**/*.py"),
    }
    - {Path(__file__)}  # its own planted pointers
)


def flat(path: Path) -> str:
    """The text of ``path`` on one line (comment markers of code and config files dropped), so a
    pointer broken across lines reads whole."""
    text = path.read_text()
    if path.suffix in (".py", ".toml"):
        text = re.sub(r"^\s*#+ ?", "", text, flags=re.M)
    return re.sub(r"\s+", " ", text)


def section_titles(path: Path) -> list[str]:
    """Headings of a Markdown file (outside code blocks) and the bold or italic lead-ins of its
    paragraphs (``**Same tables as a local run.**``), whitespace collapsed."""
    titles, fenced = [], False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            titles.append(line.lstrip("#").strip())
        elif not fenced and line.startswith("*"):
            titles.append(line.lstrip("*").strip())
    return [re.sub(r"\s+", " ", t) for t in titles]


def dangling_pointers(path: Path, root: Path = REPO) -> list[str]:
    """Every pointer of ``path`` to a results section whose file has no heading that starts with the
    quoted title. ``section "..."`` without a file points into ``path`` itself (checked in results
    files only); ``BENCHMARKS`` is BENCHMARKS.md."""
    shown = path.relative_to(root) if path.is_relative_to(root) else path.name
    own_results = path.parent.name == "results" and path.suffix == ".md"
    found = []
    for match in POINTER.finditer(flat(path)):
        target, title = match.groups()
        if target is None and not own_results:
            continue
        file = path if target is None else root / (target if target.endswith(".md") else f"{target}.md")
        if not (file.is_file() and any(t.startswith(title) for t in section_titles(file))):
            found.append(f'{shown}: {target or "section"} "{title}"')
    return found


# a file whose stale pointer is mended by a change under way elsewhere (the update's objectives
# registered with their aggregation rewrite its docstring): strict, so the mend turns this red until
# the entry is removed
MENDED_ELSEWHERE: set = set()
POINTING_CASES = [
    pytest.param(p, marks=pytest.mark.xfail(strict=True, reason="its pointer is mended with its rewrite"))
    if p in MENDED_ELSEWHERE
    else p
    for p in POINTING
]


@pytest.mark.parametrize("path", POINTING_CASES, ids=lambda p: str(p.relative_to(REPO)))
def test_a_pointer_to_a_results_section_names_a_heading_that_exists(path: Path) -> None:
    assert dangling_pointers(path) == []


def test_the_check_sees_a_dangling_section_pointer(tmp_path: Path) -> None:
    results = tmp_path / "docs" / "results"
    results.mkdir(parents=True)
    (results / "things.md").write_text("# Things\n\n## Protocol v2\n\n### Results of v2\n\ntext\n")
    (tmp_path / "BENCHMARKS.md").write_text("# Benchmarks\n")
    doc = tmp_path / "x.md"
    doc.write_text(
        'Fine: docs/results/things.md "Protocol v2" and docs/results/things.md\n"Results of v2". '
        'Dangling: docs/results/things.md "Protocol v9", BENCHMARKS "Protocol v2", '
        'docs/results/gone.md "Protocol v2".\n'
    )
    assert dangling_pointers(doc, tmp_path) == [
        'x.md: docs/results/things.md "Protocol v9"',
        'x.md: BENCHMARKS "Protocol v2"',
        'x.md: docs/results/gone.md "Protocol v2"',
    ]
    code = tmp_path / "stages" / "x.py"
    code.parent.mkdir()
    code.write_text('# measured (docs/results/things.md\n# "Protocol v2"); see docs/other.md "Gone"\n')
    assert dangling_pointers(code, tmp_path) == ['stages/x.py: docs/other.md "Gone"']
    (results / "things.md").write_text('# Things\n\n## A\n\nsee section "A" and section "B" below\n')
    assert dangling_pointers(results / "things.md", tmp_path) == ['docs/results/things.md: section "B"']
