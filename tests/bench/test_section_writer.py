"""bench/section_writer.py: the one writer of result sections (a section replaced in place, others kept,
each stamped with its command and commit)."""

from __future__ import annotations

import sys
from pathlib import Path

from tests.helpers.paths import REPO

sys.path.insert(0, str(REPO / "bench"))

from section_writer import provenance, write_section  # noqa: E402


def test_a_section_is_replaced_in_place_and_the_others_kept(tmp_path: Path) -> None:
    path = tmp_path / "speed-things.md"
    write_section(path, "One", "first body", command="python bench/one.py")
    write_section(path, "Two", "second body", command="python bench/two.py --x 1")
    write_section(path, "One", "new first body", command="python bench/one.py --again")
    text = path.read_text()
    assert text.startswith("# Speed things\n")
    assert text.index("## One") < text.index("## Two")  # replaced where it stood
    assert "first body" not in text.replace("new first body", "")
    assert "Command: `python bench/one.py --again` · commit " in text
    assert "Command: `python bench/two.py --x 1` · commit " in text and "second body" in text
    assert text.count("## One") == 1


def test_the_stamp_names_the_commit() -> None:
    import subprocess

    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO
    ).stdout.strip()
    stamp = provenance("python bench/x.py")
    assert stamp.startswith("Command: `python bench/x.py` · commit ")
    assert head and head in stamp
