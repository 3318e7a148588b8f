"""Progress and live logging: the update's progress bar (terminal only, with ETA), the
optional TensorBoard logger fed from the metrics rows, and the update panels of `graft report`."""

from __future__ import annotations

import io
import struct
import sys
from pathlib import Path

import polars as pl
import pytest
from typer.testing import CliRunner

from graft_cli.app import app
from schemas import read_table, write_table
from schemas.config import Config
from schemas.errors import GraftError
from schemas.rundir import Run, create_run
from stages.loop import run_loop
from stages.observe.progress import terminal_progress
from tests.helpers.loop_runs import fake_runners
from tests.helpers.paths import CONFIGS

# ---------------------------------------------------------------------------------------------
# progress


def test_progress_is_silent_off_a_terminal(capsys) -> None:
    assert not sys.stderr.isatty()  # pytest captures stderr
    update, close = terminal_progress("update iter 0", 3)
    update(1, "loss 0.5")
    close()
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""


def test_progress_on_a_terminal_shows_count_and_eta() -> None:
    from rich.console import Console

    buffer = io.StringIO()
    console = Console(file=buffer, force_terminal=True, width=120)
    update, close = terminal_progress("update iter 4", 3, console=console)
    for done in (1, 2):
        update(done, f"loss {done / 10:.2f}")
    console.print()  # rich draws on refresh; print forces a render of the live bar
    close()
    text = buffer.getvalue()
    assert "update iter 4" in text and "2/3" in text and "eta" in text and "loss 0.20" in text


def test_the_update_stage_reports_every_optimizer_step(tmp_path: Path, monkeypatch) -> None:
    import stages.update.runner as runner_module
    from stages.update import run_update
    from tests.helpers.update_rows import make_run

    seen: list[tuple[str, int, list[int]]] = []

    def recording(label: str, total: int, console=None):  # type: ignore[no-untyped-def]
        seen.append((label, total, []))
        return (lambda done, note="": seen[-1][2].append(done)), (lambda: None)

    monkeypatch.setattr(runner_module, "terminal_progress", recording)
    run, config = make_run(tmp_path, "choose", epochs=2, minibatch_size=5)
    run_update(run, 0, config)
    table = read_table(run.table_path(0, "update"), "update")
    steps = table.filter((pl.col("epoch") >= 0) & (pl.col("name") == "loss")).height
    rows = int(table.filter((pl.col("epoch") == -1) & (pl.col("name") == "rows"))["value"][0])
    label, total, done = seen[0]
    assert label == "update iter 0" and total == 2 * -(-rows // 5) == steps  # epochs x ceil(rows / 5)
    assert done == list(range(1, steps + 1))  # one tick per optimizer step


# ---------------------------------------------------------------------------------------------
# TensorBoard event files, read back with a TFRecord reader written here


def read_event_scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in the event files of ``folder``: tag -> [(step, value)].

    TFRecord framing: uint64 length, uint32 masked CRC of the length, the record (an ``Event``
    protobuf), uint32 masked CRC of the record.
    """
    from tensorboardX.proto.event_pb2 import Event

    out: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(folder.glob("events.out.tfevents.*")):
        data = path.read_bytes()
        pos = 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos : pos + 8])
            record = data[pos + 12 : pos + 12 + length]
            pos += 12 + length + 4
            event = Event.FromString(record)
            for value in event.summary.value:
                out.setdefault(value.tag, []).append((event.step, value.simple_value))
    return out


def _runners_with_rollout_metrics() -> dict:
    runners = fake_runners([])
    rollout = runners["rollout"]

    def with_metrics(run: Run, it: int, config: Config) -> None:
        rollout(run, it, config)
        rows = pl.DataFrame(
            {
                "iter": pl.Series([it, it], dtype=pl.Int32),
                "stage": ["rollout", "rollout"],
                "name": ["success_rate", "success_rate"],
                "value": [0.25 + it, 0.5 + it],
                "task_type": [None, "pick"],
            }
        )
        write_table(rows, "metrics", run.iter_dir(it) / "metrics_rollout.parquet")

    return {**runners, "rollout": with_metrics}


def test_tensorboard_logger_writes_the_metrics_rows(tmp_path: Path) -> None:
    config = Config()
    config.run.eval_every = 1
    config.log.tensorboard = True
    run = create_run(tmp_path / "r", config)
    runners = {**_runners_with_rollout_metrics(), "update": _runners_with_update_metrics()["update"]}
    run_loop(run, config, 2, runners=runners, prepare=lambda *_: None)
    scalars = read_event_scalars(run.root / "tensorboard")
    assert scalars["rollout/success_rate"] == [(0, 0.25), (1, 1.25)]
    assert scalars["rollout/success_rate/pick"] == [(0, 0.5), (1, 1.5)]
    assert [step for step, _ in scalars["update/loss"]] == [1, 2]  # the policy each update produced
    for it in (0, 1):  # the loop's own seconds, at the iteration's step
        loop_rows = read_table(run.iter_dir(it) / "metrics_loop.parquet", "metrics")
        total = loop_rows.filter(pl.col("name") == "seconds_iteration")["value"][0]
        assert (it, pytest.approx(total, rel=1e-6)) in scalars["loop/seconds_iteration"]
    # evaluations: the initial policy at step 0, iteration i's checkpoint at i + 1 (float32 in the file)
    evals = {
        s: read_table(p, "eval").filter(pl.col("name").eq("success_rate") & pl.col("task_type").is_null())[
            "value"
        ][0]
        for s, p in [
            (0, run.initial_eval_path),
            (1, run.table_path(0, "eval")),
            (2, run.table_path(1, "eval")),
        ]
    }
    got = dict(scalars["eval/success_rate"])
    assert got.keys() == evals.keys()
    for step, value in evals.items():
        assert got[step] == pytest.approx(value, rel=1e-6)


def test_logging_is_off_by_default(tmp_path: Path) -> None:
    config = Config()
    config.run.eval_every = 0
    run = create_run(tmp_path / "r", config)
    run_loop(run, config, 1, runners=fake_runners([]), prepare=lambda *_: None)
    assert not (run.root / "tensorboard").exists()


def test_missing_tensorboardx_refuses_the_start_before_the_run_exists(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # import fails as if not installed
    from stages.observe.live_log import require_backend

    config = Config()
    config.log.tensorboard = True
    with pytest.raises(GraftError, match=r"pip install -e '\.\[log\]' in the graft checkout"):
        require_backend(config)
    run_dir = tmp_path / "never"
    args = ["loop", "--config", str(CONFIGS / "quickstart.toml"), "--run", str(run_dir)]
    result = CliRunner().invoke(app, [*args, "--set", "log.tensorboard=true"])
    assert result.exit_code == 2 and "tensorboardX" in result.output
    assert not run_dir.exists()


# ---------------------------------------------------------------------------------------------
# graft report: update panels


def _runners_with_update_metrics() -> dict:
    runners = fake_runners([])
    update = runners["update"]

    def with_metrics(run: Run, it: int, config: Config) -> None:
        update(run, it, config)
        names = ["loss", "entropy", "clip_fraction", "grad_norm", "lr"]
        rows = pl.DataFrame(
            {
                "iter": pl.Series([it] * len(names), dtype=pl.Int32),
                "stage": ["update"] * len(names),
                "name": names,
                "value": [1.0 - 0.25 * it, 2.0, 0.1 * it, 3.0 + it, 1e-3],
                "task_type": pl.Series([None] * len(names), dtype=pl.String),
            }
        )
        write_table(rows, "metrics", run.iter_dir(it) / "metrics_update.parquet")

    return {**runners, "update": with_metrics}


def test_report_draws_the_update_panels(tmp_path: Path) -> None:
    from stages.observe.report import load_run_tables, update_curve

    config = Config()
    config.run.eval_every = 0
    run = create_run(tmp_path / "r", config)
    run_loop(run, config, 3, runners=_runners_with_update_metrics(), prepare=lambda *_: None)
    metrics = load_run_tables(run).metrics
    loss = update_curve(metrics, "loss")
    assert loss["x"].to_list() == [1, 2, 3]  # the update of iteration i makes the policy after i + 1
    assert loss["value"].to_list() == [1.0, 0.75, 0.5]
    assert update_curve(metrics, "grad_norm")["value"].to_list() == [3.0, 4.0, 5.0]
    assert update_curve(metrics, "kl").height == 0  # beta = 0: no KL rows, the panel says so
    result = CliRunner().invoke(app, ["report", str(run.root), "-o", str(tmp_path / "rep")])
    assert result.exit_code == 0, result.output
    png = (tmp_path / "rep" / "update.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 1000
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "## Policy update" in md and "](update.png)" in md


def test_report_without_update_metrics_has_no_update_panels(tmp_path: Path) -> None:
    from stages.observe.report import write_report

    config = Config()
    config.run.eval_every = 0
    run = create_run(tmp_path / "r", config)
    run_loop(run, config, 1, runners=_runners_with_rollout_metrics(), prepare=lambda *_: None)
    paths = write_report([run.root], tmp_path / "rep")
    assert [p.name for p in paths] == ["curves.png", "report.md"]
    assert not (tmp_path / "rep" / "update.png").exists()
    assert "Policy update" not in (tmp_path / "rep" / "report.md").read_text()


def test_a_kill_before_the_log_line_loses_no_scalars(tmp_path: Path, monkeypatch) -> None:
    # a kill between an iteration's tables and its log line lost its scalars for good
    import stages.observe.live_log as live_log

    config = Config()
    config.run.eval_every = 0
    config.log.tensorboard = True
    run = create_run(tmp_path / "r", config)
    real = live_log.TensorBoardLogger.log_iteration

    def killed(self, run_, iteration):  # type: ignore[no-untyped-def]
        if iteration == 1:
            raise KeyboardInterrupt  # the iteration's tables are written, its log line is not
        return real(self, run_, iteration)

    monkeypatch.setattr(live_log.TensorBoardLogger, "log_iteration", killed)
    with pytest.raises(KeyboardInterrupt):
        run_loop(run, config, 3, runners=_runners_with_rollout_metrics(), prepare=lambda *_: None)
    monkeypatch.setattr(live_log.TensorBoardLogger, "log_iteration", real)
    run_loop(run, config, 3, runners=_runners_with_rollout_metrics(), prepare=lambda *_: None)
    scalars = read_event_scalars(run.root / "tensorboard")
    assert sorted(step for step, _ in scalars["rollout/success_rate"]) == [0, 1, 2]


def test_scalars_are_on_disk_before_the_ledger_says_they_are_logged(tmp_path: Path, monkeypatch) -> None:
    # tensorboardX writes events from a queue in its own thread and flush() does not wait for it: a kill
    # right after an iteration was logged lost its last scalars (the eval/* ones) for good
    import time

    import tensorboardX.event_file_writer as event_file_writer

    from stages.observe.live_log import TensorBoardLogger

    run = create_run(tmp_path / "r", Config())
    rows = {"iter": [0, 0], "checkpoint": ["iter_0000"] * 2, "name": ["success_rate", "mean_turns"]}
    write_table(
        pl.DataFrame({**rows, "value": [0.5, 3.0], "task_type": [None, None]}),
        "eval",
        run.table_path(0, "eval"),
    )
    real = event_file_writer.EventsWriter.write_event

    def slow(self, event):  # type: ignore[no-untyped-def]
        time.sleep(0.3)  # a loaded machine: the writer thread is behind
        return real(self, event)

    monkeypatch.setattr(event_file_writer.EventsWriter, "write_event", slow)
    logger = TensorBoardLogger(tmp_path / "tb")
    assert logger.log_iteration(run, 0) == 2  # returns: the ledger says iteration 0 is logged
    scalars = read_event_scalars(tmp_path / "tb")  # what a kill at this moment leaves
    assert scalars == {"eval/success_rate": [(1, 0.5)], "eval/mean_turns": [(1, 3.0)]}
    logger.close()
