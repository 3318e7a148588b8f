"""A finished iteration is its manifest: byte flips, swapped and deleted files anywhere in a finished
iteration (its tables, evaluation, manifest and checkpoint) are refused by every reader -- graft sql,
report, eval, export, the loop on resume and the stage commands -- with one line naming the file and
what to run, and the refusal changes nothing in the run. The intact run is served by each of them
(so a reader that refused everything would fail here too).

One real finished micro run (2 iterations, tests/loop/test_loop.py) is copied once per module; each case
damages one file, runs the readers, then puts the file back."""

from __future__ import annotations

import random
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from graft_cli.app import app
from tests.helpers.loop_runs import micro_run

RUN_IS = "{run}"


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Path:
    source = micro_run(tmp_path_factory.mktemp("ref"))
    copy = tmp_path_factory.mktemp("hostile") / "run"
    shutil.copytree(source, copy)
    return copy


def _listing(root: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != ".lock"
    }


def _invoke(root: Path, args: list[str], out: Path) -> object:
    return CliRunner().invoke(app, [a.replace(RUN_IS, str(root)).replace("{out}", str(out)) for a in args])


def _refusal(result, names: str) -> str:  # type: ignore[no-untyped-def]
    """The one error line of a refused command; it names ``names`` and a command to run."""
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert names in lines[0], lines[0]
    assert "graft " in lines[0] or "remove it" in lines[0], lines[0]
    return lines[0]


# readers of the whole run or of iteration 1 (the output folder is fresh per call)
READERS = {
    "sql": ["sql", RUN_IS, "SELECT count(*) AS n FROM steps"],
    "report": ["report", RUN_IS, "-o", "{out}"],
    "eval": ["eval", RUN_IS, "--iter", "1", "--force"],
    "export": ["export", RUN_IS, "--iter", "1", "-o", "{out}"],
    "loop": ["loop", "--run", RUN_IS, "--iters", "2"],
}
# the stage command that reads a file of iteration 1 (with --force: it keeps that file)
STAGE_READER = {
    "steps.parquet": ["graph", RUN_IS, "--iter", "1", "--force", "--yes"],
    "metrics_rollout.parquet": ["graph", RUN_IS, "--iter", "1", "--force", "--yes"],
    "nodes.parquet": ["solve", RUN_IS, "--iter", "1", "--force", "--yes"],
    "edges.parquet": ["solve", RUN_IS, "--iter", "1", "--force", "--yes"],
    "values.parquet": ["advantage", RUN_IS, "--iter", "1", "--force", "--yes"],
    "advantages.parquet": ["update", RUN_IS, "--iter", "1", "--force", "--yes"],
    "manifest.json": ["solve", RUN_IS, "--iter", "1", "--force", "--yes"],
}
TABLES = [
    "steps.parquet",
    "nodes.parquet",
    "edges.parquet",
    "values.parquet",
    "advantages.parquet",
    "update.parquet",
    "metrics_rollout.parquet",
    "metrics_update.parquet",
    "metrics_loop.parquet",
    "eval.parquet",
    "eval_episodes.parquet",
]


def _flip(path: Path, rng: random.Random) -> None:
    data = bytearray(path.read_bytes())
    position = rng.randrange(len(data))
    data[position] ^= 1 << rng.randrange(8)
    path.write_bytes(bytes(data))


@pytest.fixture
def damage(finished: Path) -> Iterator:  # type: ignore[type-arg]
    """``damage(relative path, how)``: flip a byte of it, swap in iteration 0's copy, or delete it; the
    file is restored afterwards."""
    saved: dict[Path, bytes] = {}
    rng = random.Random(36)

    def apply(rel: str, how: str) -> None:
        path = finished / rel
        saved.setdefault(path, path.read_bytes())
        if how == "flip":
            _flip(path, rng)
        elif how == "swap":
            other = finished / rel.replace("iter_0001", "iter_0000")
            path.write_bytes(other.read_bytes())
        else:
            path.unlink()

    yield apply
    for path, data in saved.items():
        path.write_bytes(data)


def _refused_by(finished: Path, tmp_path: Path, readers: dict[str, list[str]], names: str) -> None:
    before = _listing(finished)
    for label, args in readers.items():
        out = tmp_path / f"out-{label}"
        result = _invoke(finished, args, out)
        _refusal(result, names)
        assert _listing(finished) == before, label  # the refusal wrote nothing into the run
        assert not out.exists(), label


def test_every_reader_serves_the_intact_run(finished: Path, tmp_path: Path) -> None:
    before = _listing(finished)
    for label in ("sql", "report", "export", "loop"):
        result = _invoke(finished, READERS[label], tmp_path / label)
        assert result.exit_code == 0, (label, result.output)
    assert "nothing to do" in _invoke(finished, READERS["loop"], tmp_path).output
    assert _listing(finished) == before
    # graft eval --force replaces the evaluation and records it: the run stays one that verifies
    evaluation = finished / "iter_0001" / "eval.parquet"
    saved = evaluation.read_bytes()
    assert _invoke(finished, READERS["eval"], tmp_path).exit_code == 0
    assert evaluation.read_bytes() == saved  # the same checkpoint, the same seeds
    assert _invoke(finished, READERS["sql"], tmp_path).exit_code == 0


# without its done-marker the iteration is unfinished and its tables unchanged: served (next test)
SQL_CASES = [
    (t, h) for t in TABLES for h in ("flip", "swap", "delete") if (t, h) != ("metrics_loop.parquet", "delete")
]


@pytest.mark.parametrize(("table", "how"), SQL_CASES)
def test_sql_refuses_any_changed_table(finished: Path, tmp_path: Path, damage, table: str, how: str) -> None:  # type: ignore[no-untyped-def]
    damage(f"iter_0001/{table}", how)
    _refused_by(finished, tmp_path, {"sql": READERS["sql"]}, f"iter_0001/{table}")


@pytest.mark.parametrize("table", ["steps.parquet", "values.parquet", "eval.parquet"])
def test_a_swap_behind_a_removed_done_marker_is_refused(
    finished: Path, tmp_path: Path, damage, table: str
) -> None:  # type: ignore[no-untyped-def]
    from schemas.manifest import forget_finished
    from schemas.rundir import Run

    record = (finished / "manifest.json").read_text()
    forget_finished(Run(finished), 1)  # the state --force leaves: the record first, then the marker
    try:
        damage("iter_0001/metrics_loop.parquet", "delete")
        assert _invoke(finished, READERS["sql"], tmp_path).exit_code == 0  # unfinished, nothing changed
        damage(f"iter_0001/{table}", "swap")
        readers = {"sql": READERS["sql"], "report": READERS["report"], "loop": READERS["loop"]}
        _refused_by(finished, tmp_path, readers, f"iter_0001/{table}")
    finally:
        (finished / "manifest.json").write_text(record)


@pytest.mark.parametrize("table", TABLES)
def test_every_reader_refuses_a_changed_table(finished: Path, tmp_path: Path, damage, table: str) -> None:  # type: ignore[no-untyped-def]
    how = {"metrics_loop.parquet": "flip", "eval.parquet": "swap"}.get(
        table, ["flip", "swap", "delete"][TABLES.index(table) % 3]
    )
    damage(f"iter_0001/{table}", how)
    # graft eval --force replaces the evaluation's own files rather than refusing them
    evaluation = ("eval.parquet", "eval_episodes.parquet")
    readers = {k: v for k, v in READERS.items() if not (k == "eval" and table in evaluation)}
    if table in STAGE_READER:
        readers["stage"] = STAGE_READER[table]
    _refused_by(finished, tmp_path, readers, f"iter_0001/{table}")


@pytest.mark.parametrize("how", ["flip", "delete"])
def test_a_changed_or_deleted_manifest_is_refused(finished: Path, tmp_path: Path, damage, how: str) -> None:  # type: ignore[no-untyped-def]
    damage("iter_0001/manifest.json", how)
    readers = {**READERS, "stage": STAGE_READER["manifest.json"]}
    _refused_by(finished, tmp_path, readers, "iter_0001/")


@pytest.mark.parametrize(
    ("file", "how"),
    [
        ("model.safetensors", "flip"),
        ("model.safetensors", "delete"),
        ("config.json", "flip"),
        ("tokenizer.json", "delete"),
        ("graft_checkpoint.json", "flip"),
    ],
)
def test_readers_of_a_checkpoint_refuse_a_changed_file(
    finished: Path, tmp_path: Path, damage, file: str, how: str
) -> None:  # type: ignore[no-untyped-def]
    damage(f"checkpoints/iter_0001/{file}", how)
    readers = {
        "eval": READERS["eval"],
        "export": READERS["export"],
        "loop": ["loop", "--run", RUN_IS, "--iters", "3"],  # iteration 2 acts with this checkpoint
        "rollout": ["rollout", RUN_IS, "--iter", "2", "--no-progress"],
    }
    _refused_by(finished, tmp_path, readers, "checkpoints/iter_0001/")


def test_a_checkpoint_swapped_whole_is_refused_by_every_reader(finished: Path, tmp_path: Path) -> None:
    target = finished / "checkpoints" / "iter_0001"
    keep = target.with_name("kept")
    target.rename(keep)
    shutil.copytree(finished / "checkpoints" / "iter_0000", target)  # consistent in itself
    try:
        _refused_by(finished, tmp_path, READERS, "checkpoints/iter_0001/")
    finally:
        shutil.rmtree(target)
        keep.rename(target)


def test_the_acting_checkpoint_of_a_replay_is_verified_before_anything_is_removed(
    finished: Path, tmp_path: Path, damage
) -> None:  # type: ignore[no-untyped-def]
    damage("checkpoints/iter_0000/model.safetensors", "flip")
    line = _refusal(
        _invoke(finished, ["rollout", RUN_IS, "--iter", "1", "--force", "--yes", "--no-progress"], tmp_path),
        "checkpoints/iter_0000/model.safetensors",
    )
    assert line.endswith("--force removed nothing")
    assert (finished / "iter_0001" / "metrics_loop.parquet").is_file()


@pytest.mark.parametrize("how", ["flip", "swap"])
@pytest.mark.parametrize("table", ["eval.parquet", "eval_episodes.parquet"])
def test_the_initial_evaluation_is_verified_too(
    finished: Path, tmp_path: Path, damage, how: str, table: str
) -> None:  # type: ignore[no-untyped-def]
    evaluation = finished / table
    saved = evaluation.read_bytes()
    if how == "swap":
        evaluation.write_bytes((finished / "iter_0000" / table).read_bytes())
    else:
        damage(table, "flip")
    try:
        readers = {k: READERS[k] for k in ("sql", "report", "loop")}
        _refused_by(finished, tmp_path, readers, f"{finished}/{table}")
        # the remedy names the run's own evaluation of the initial policy, not a --checkpoint one
        line = _refusal(_invoke(finished, READERS["sql"], tmp_path), f"{finished}/{table}")
        assert "--iter -1 --force" in line and "--checkpoint DIR" not in line
    finally:
        evaluation.write_bytes(saved)


def test_a_footer_edit_that_renames_a_column_is_refused(finished: Path, tmp_path: Path, damage) -> None:  # type: ignore[no-untyped-def]
    # the page checksums do not cover the footer: graft sql served the table with a renamed column
    path = finished / "iter_0001" / "advantages.parquet"
    data = path.read_bytes()
    assert b"norm_group_size" in data
    damage("iter_0001/advantages.parquet", "flip")  # saves the file for the restore
    path.write_bytes(data.replace(b"norm_group_size", b"norm_group_sizf"))
    _refused_by(
        finished,
        tmp_path,
        {"sql": READERS["sql"], "report": READERS["report"]},
        "iter_0001/advantages.parquet",
    )
