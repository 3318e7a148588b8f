"""ALFWorld evaluation splits: valid_seen = in-distribution, valid_unseen =
out-of-distribution, or both reported separately. Uses the games of ../shared/data/alfworld, split into
two folders by symlinks (the shared data has only valid_seen)."""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest

from schemas.errors import GraftError
from stages.envs.registry import make_env
from stages.evaluate import eval_rows
from stages.observe.report import RunTables, per_type_table
from tests.helpers.alfworld import DATA, needs_alfworld


@pytest.fixture(scope="module")
def two_splits(tmp_path_factory) -> Path:
    needs_alfworld()
    root = tmp_path_factory.mktemp("alfworld")
    folders = sorted(p for p in (DATA / "json_2.1.1" / "valid_seen").iterdir() if p.is_dir())
    for i, folder in enumerate(folders):
        split = root / "json_2.1.1" / ("valid_seen" if i % 2 == 0 else "valid_unseen")
        split.mkdir(parents=True, exist_ok=True)
        (split / folder.name).symlink_to(folder)
    (root / "logic").symlink_to(DATA / "logic")
    return root


def _splits(env) -> set[str]:
    return {t.task_id.split("/")[1] for t in env.tasks("eval", len(env.games("eval")), seed=0)}


def test_eval_split_option_selects_the_folders(two_splits):
    seen = make_env("alfworld", data=str(two_splits), eval_split="valid_seen")
    unseen = make_env("alfworld", data=str(two_splits), eval_split="valid_unseen")
    both = make_env("alfworld", data=str(two_splits))  # default "both"
    assert _splits(seen) == {"valid_seen"} and _splits(unseen) == {"valid_unseen"}
    assert _splits(both) == {"valid_seen", "valid_unseen"}
    assert len(both.games("eval")) == len(seen.games("eval")) + len(unseen.games("eval"))
    with pytest.raises(GraftError, match="eval_split"):
        make_env("alfworld", data=str(two_splits), eval_split="unseen")
    # The shared data has no valid_unseen folder: asking for it is an error, not a silent fallback.
    with pytest.raises(GraftError, match="eval_split 'valid_unseen' has no folder"):
        make_env("alfworld", data=str(DATA), eval_split="valid_unseen").tasks("eval", 2, seed=0)


def test_both_splits_are_reported_separately(two_splits):
    env = make_env("alfworld", data=str(two_splits))
    seen = [t for t in env.tasks("eval", len(env.games("eval")), 0) if "/valid_seen/" in t.task_id][:2]
    unseen = [t for t in env.tasks("eval", len(env.games("eval")), 0) if "/valid_unseen/" in t.task_id][:1]
    tasks = seen + unseen
    # One-step episodes: seen wins once of two, unseen loses.
    outcomes = [10.0, 0.0, 0.0]
    steps = pl.DataFrame(
        {
            "traj_id": [f"t{i}" for i in range(3)],
            "task_id": [t.task_id for t in tasks],
            "task_type": [t.task_type for t in tasks],
            "step": [0, 0, 0],
            "reward": [0.0, 0.0, 0.0],
            "outcome": outcomes,
        }
    )
    rows = eval_rows(steps, 10.0, 0, "ck", env.split_of).filter(
        (pl.col("name") == "success_rate") & pl.col("task_type").is_null()
    )
    by_split = dict(zip(rows["split"].to_list(), rows["value"].to_list(), strict=True))
    assert by_split == {None: pytest.approx(1 / 3), "valid_seen": 0.5, "valid_unseen": 0.0}
    # One split evaluated: no per-split rows (they would repeat the overall ones).
    single = eval_rows(steps.head(2), 10.0, 0, "ck", env.split_of)
    assert single["split"].null_count() == single.height
    # The report has the union and one row per split.
    evals = eval_rows(steps, 10.0, 0, "ck", env.split_of).with_columns(pl.lit(1).alias("x"))
    md = per_type_table([RunTables("alf", pl.DataFrame(), evals, "alfworld")]).splitlines()
    labels = [line.split("|")[1].strip() for line in md[2:]]
    assert labels == ["alf @ 1 updates", "alf [valid_seen] @ 1 updates", "alf [valid_unseen] @ 1 updates"]
    # All ± s.e. (√(p(1 − p)/(n − 1)) over the row's episodes; one episode: none), then the episodes
    assert [line.split("|")[-3].strip() for line in md[2:]] == ["33.3 ± 33.3", "50.0 ± 50.0", "0.0"]
    assert [line.split("|")[-2].strip() for line in md[2:]] == ["3", "2", "1"]
