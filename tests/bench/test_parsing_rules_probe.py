"""bench/probes/parsing_rules.py: one hand-written response per class, and the counts of a run."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import polars as pl
import pytest

from bench.probes.parsing_rules import CLASSES, classify, count_classes, run_turns

WELL_FORMED = "<think>goal: x. next: go to bed 1</think><action>go to bed 1</action>"


@pytest.mark.parametrize(
    ("response", "graft_valid", "expected"),
    [
        (WELL_FORMED, True, "both valid, same action"),
        # the reference keeps the first span, graft the last
        (
            "<think>t</think><action>go to bed 1</action><action>open drawer 1</action>",
            True,
            "both valid, different action",
        ),
        ("<action>go to bed 1</action>", True, "graft valid, reference invalid"),  # no think block
        ("<think>想</think><action>go to bed 1</action>", True, "graft valid, reference invalid"),  # CJK
        # well-formed, the world refused it (graft's recorded verdict): only graft penalises it
        ("<think>t</think><action>fly to the moon</action>", False, "graft invalid, reference valid"),
        ("<think>go to bed 1", False, "both invalid"),
        ("<think>t</think>go to bed 1</action>", False, "both invalid"),  # no opening tag
    ],
)
def test_each_class_by_hand(response: str, graft_valid: bool, expected: str) -> None:
    assert expected in CLASSES
    assert classify("alfworld", response, graft_valid) == expected


def test_upper_case_tags_and_inner_whitespace_are_one_action() -> None:
    # both rules lower-case; graft collapses inner whitespace, the comparison does too
    response = "<think>t</think><ACTION> Go  to bed 1 </ACTION>"
    assert classify("alfworld", response, True) == "both valid, same action"


def test_run_turns_reads_every_iteration(tmp_path: Path) -> None:
    for i, rows in enumerate([[(WELL_FORMED, True)], [("junk", False), ("<action>a</action>", True)]]):
        (tmp_path / f"iter_{i:04d}").mkdir()
        pl.DataFrame({"response": [r for r, _ in rows], "valid": [v for _, v in rows]}).write_parquet(
            tmp_path / f"iter_{i:04d}" / "steps.parquet"
        )
    turns = run_turns(tmp_path)
    assert turns == [(WELL_FORMED, True), ("junk", False), ("<action>a</action>", True)]
    assert count_classes("alfworld", turns) == Counter(
        {"both valid, same action": 1, "both invalid": 1, "graft valid, reference invalid": 1}
    )
