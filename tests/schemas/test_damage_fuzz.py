"""The damage fuzzer's fast sample (tests/helpers/damage_fuzz.py; hundreds of cases: ``python -m
bench.damage``): a finished micro run, one random damage, one reader or writer; each case is refused
with one ``error:`` line leaving everything outside the damaged path as it was, or gives the undamaged
run's results -- never a lost file, a silently wrong result, a write outside the run or a traceback.
The controls check the classifier itself: an undamaged copy is identical, and a planted wrong result
or a planted write outside is caught."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.helpers.damage_fuzz import (
    CHEAP,
    FAILURES,
    Case,
    Reference,
    classify,
    draw_case,
    fresh_places,
    other_run,
    reference_answer,
    run_case,
    snapshot,
)

SAMPLE_SEEDS = range(16)


@pytest.fixture(scope="module")
def runs(source: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    work = tmp_path_factory.mktemp("fuzz")
    return source, other_run(source, work), work


@pytest.fixture(scope="module")
def answers() -> dict[str, Reference]:
    return {}


@pytest.mark.parametrize("seed", SAMPLE_SEEDS)
def test_one_damage_is_refused_or_changes_nothing(
    runs: tuple[Path, Path, Path], answers: dict[str, Reference], seed: int
) -> None:
    reference, other, work = runs
    case = draw_case(seed, reference, CHEAP)
    outcome = run_case(case, reference, other, work, answers)
    assert outcome.kind not in FAILURES, (case, outcome.why)
    assert outcome.kind in ("refused", "identical")


def test_the_classifier_catches_what_it_must(
    runs: tuple[Path, Path, Path], answers: dict[str, Reference]
) -> None:
    reference, other, work = runs
    places = fresh_places(reference, other, work, "control")
    answer = reference_answer("sql", places)
    before = (snapshot(places.run), snapshot(places.other), snapshot(places.outside))
    case = Case(0, "none", "-", "sql")
    from tests.helpers.damage_fuzz import run_command

    code, output = run_command("sql", places)
    assert classify(case, places, *before, code, output, answer).kind == "identical"
    assert classify(case, places, *before, 0, output + "1", answer).kind == "silent wrong"
    assert classify(case, places, *before, 1, "Traceback", answer).kind == "crash"
    (places.outside / "planted").write_text("x")
    assert classify(case, places, *before, code, output, answer).kind == "escape"
    (places.outside / "planted").unlink()
    (places.run / "iter_0000" / "steps.parquet").unlink()
    assert classify(case, places, *before, 2, "error: refused", answer).kind == "lost"
    shutil.rmtree(work / "control")
