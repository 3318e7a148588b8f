"""What the CLI prints: help texts, the loop's lines off a terminal, refused starts."""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest
from typer.testing import CliRunner

from graft_cli.app import app
from schemas import read_table
from tests.helpers.loop_runs import fake_runners
from tests.helpers.paths import CONFIGS

WIDE = {"COLUMNS": "200", "TERM": "dumb"}


def test_play_help_keeps_the_bracketed_section_name() -> None:
    result = CliRunner().invoke(app, ["play", "--help"], env=WIDE)
    assert result.exit_code == 0
    assert "whose [env] section" in " ".join(result.output.split())  # rich markup used to swallow "[env]"


@pytest.mark.parametrize("command", ["rollout", "loop", "init-model", "synth"])
def test_flags_show_no_value_placeholder(command: str) -> None:
    result = CliRunner().invoke(app, [command, "--help"], env=WIDE)
    assert result.exit_code == 0
    assert "<bool>" not in result.output
    help_line = next(line for line in result.output.splitlines() if "--help" in line)
    assert "Show this message" in help_line
    assert "<int>" in result.output or "<path>" in result.output  # options with values keep theirs


def _fake_loop(monkeypatch) -> None:
    """graft loop with the fake stage runners of test_loop (no model, seconds per run)."""
    import stages.loop as loop_module

    real = loop_module.run_loop

    def fake(run, config, iters, **kwargs):  # type: ignore[no-untyped-def]
        return real(run, config, iters, runners=fake_runners([]), prepare=lambda *_: None, **kwargs)

    monkeypatch.setattr(loop_module, "run_loop", fake)


def test_loop_prints_the_initial_eval_and_unwrapped_paths(tmp_path: Path, monkeypatch) -> None:
    _fake_loop(monkeypatch)
    deep = tmp_path / ("a_rather_long_folder_name_" * 4) / "run"  # paths longer than 80 columns
    config = tmp_path / "c.toml"
    config.write_text('[run]\nname = "x"\neval_every = 1\n')
    result = CliRunner().invoke(app, ["loop", "--config", str(config), "--run", str(deep), "--iters", "2"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    # the default household world plays its own number of tasks (150) for the tiny vocabulary
    assert "building the tiny model: playing 150 train + 150 eval household tasks" in lines[1]
    initial = next(i for i, line in enumerate(lines) if line.startswith("initial"))
    first = next(i for i, line in enumerate(lines) if line.startswith("iter    0"))
    assert initial < first  # printed before the first iteration, as it happens
    rows = read_table(deep / "eval.parquet", "eval").filter(pl.col("task_type").is_null())
    success = rows.filter(pl.col("name") == "success_rate")["value"][0]
    assert f"eval {success:.3f}" in lines[initial]
    last = next(line for line in lines if line.startswith("curves:"))
    assert f"curves: {deep / 'report' / 'curves.png'}  table: {deep / 'report' / 'report.md'}" in last


def test_loop_does_not_print_an_initial_eval_it_did_not_run(tmp_path: Path, monkeypatch) -> None:
    _fake_loop(monkeypatch)
    config = tmp_path / "c.toml"
    config.write_text('[run]\nname = "x"\neval_every = 1\n')
    args = ["loop", "--config", str(config), "--run", str(tmp_path / "r")]
    assert CliRunner().invoke(app, [*args, "--iters", "1"]).exit_code == 0
    (tmp_path / "r" / "model").mkdir()
    (tmp_path / "r" / "model" / "config.json").write_text("{}")  # as if the tiny model were built
    again = CliRunner().invoke(app, [*args, "--iters", "2"])  # resumes: the initial eval exists
    assert again.exit_code == 0 and "initial" not in again.output and "iter    1" in again.output
    assert "building the tiny model" not in again.output


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model.path=no/such/model"], "model directory not found"),
        (["rollout.engine=vllm"], "vllm is not installed"),
        (["run.device=cuda"], "no CUDA device"),
        (["env.name=alfworld", "env.options={}", "env.data=/no/such/alfworld"], "/no/such/alfworld"),
    ],
)
def test_a_start_that_cannot_run_writes_nothing(tmp_path: Path, overrides: list[str], message: str) -> None:
    import importlib.util

    import torch

    if "rollout.engine=vllm" in overrides and importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is installed here")
    if "run.device=cuda" in overrides and torch.cuda.is_available():
        pytest.skip("a CUDA device is available here")
    run_dir = tmp_path / "r"
    sets = [a for o in overrides for a in ("--set", o)]
    result = CliRunner().invoke(
        app, ["loop", "--config", str(CONFIGS / "quickstart.toml"), "--run", str(run_dir), *sets]
    )
    assert result.exit_code == 2
    assert result.output.startswith("error: ") and message in result.output
    assert not (run_dir / "config.toml").exists()  # the fixed command needs no --force
    fixed = CliRunner().invoke(
        app, ["loop", "--config", str(CONFIGS / "quickstart.toml"), "--run", str(run_dir), "--iters", "0"]
    )
    assert fixed.exit_code == 0, fixed.output


def test_run_eta_and_its_format():
    # no whole-run ETA in the loop's lines
    from graft_cli.commands.loop import RunEta, format_eta

    assert format_eta(12.4) == "12s" and format_eta(245) == "4m05s" and format_eta(3725) == "1h02m"
    eta = RunEta(target=5)
    eta.started -= 10.0  # one iteration took 10 s
    assert eta.after(0) == format_eta(40.0)  # four left
    assert eta.after(4) == ""  # the last one


def test_stage_commands_say_what_they_computed(tmp_path):
    # stage commands printed only "wrote ..."
    from typer.testing import CliRunner

    from graft_cli.app import app
    from schemas import write_table
    from stages.credit.synth import synth_steps

    steps = tmp_path / "steps.parquet"
    write_table(synth_steps(groups=2, group_size=3, horizon=4, seed=1), "steps", steps)
    out = tmp_path / "o"
    result = CliRunner().invoke(app, ["graph", str(steps), "-o", str(out)])
    assert result.exit_code == 0 and "graph: groups=2, nodes=" in result.output
    result = CliRunner().invoke(app, ["solve", str(out)])
    assert (
        result.exit_code == 0 and "solve: sweeps_max=" in result.output and "residual_max=" in result.output
    )
    result = CliRunner().invoke(app, ["advantage", str(steps), "-o", str(out)])
    assert result.exit_code == 0 and "advantage: advantage_mean=" in result.output


def test_a_hub_id_says_how_to_download(tmp_path):
    import pytest

    from schemas.errors import GraftError
    from stages.policy.models import check_model_dir

    with pytest.raises(
        GraftError, match=r"Hub id.*huggingface-cli download Qwen/Qwen2.5-1.5B-Instruct --local-dir"
    ):
        check_model_dir("Qwen/Qwen2.5-1.5B-Instruct")
    with pytest.raises(GraftError, match="model directory not found"):
        check_model_dir(tmp_path / "missing")
