"""A run directory is data, not code (docs/design.md §11): settings that can run code are
honoured from a saved run only when the command line repeats them, or with ``graft --trust-run``."""

from __future__ import annotations

from pathlib import Path

import pytest

from schemas.config import Config
from schemas.errors import GraftError
from schemas.rundir import create_run, open_run
from schemas.trust import trust_saved_runs


def _run_with(tmp_path: Path, **settings) -> Path:  # type: ignore[no-untyped-def]
    config = Config()
    config.model.trust_remote_code = settings.get("trust_remote_code", False)
    config.env.name = settings.get("env", "household")
    return create_run(tmp_path / "run", config).root


@pytest.mark.parametrize(
    ("settings", "key", "value"),
    [
        ({"trust_remote_code": True}, "model.trust_remote_code", "true"),
        ({"env": "subprocess:run"}, "env.name", "subprocess:run"),
    ],
)
def test_saved_code_running_settings_must_be_repeated(tmp_path, settings, key, value):
    run = open_run(_run_with(tmp_path, **settings))
    with pytest.raises(GraftError, match=rf"{key} = {value} runs code from the run directory.*--set {key}="):
        run.load_config()
    with pytest.raises(GraftError, match="runs code"):
        run.load_config(["run.seed=3"])  # other overrides do not vouch for it
    repeated = run.load_config([f"{key}={value}" if key != "env.name" else f'{key}="{value}"'])
    assert (repeated.model.trust_remote_code, repeated.env.name)[key == "env.name"] in (True, value)
    trust_saved_runs(True)
    try:
        assert run.load_config().model.trust_remote_code == settings.get("trust_remote_code", False)
    finally:
        trust_saved_runs(False)


def test_a_plain_run_needs_nothing(tmp_path):
    assert open_run(_run_with(tmp_path)).load_config().env.name == "household"


def test_cli_refuses_in_one_line_and_trust_run_lets_it_through(tmp_path, runner):
    from graft_cli.app import app

    root = _run_with(tmp_path, trust_remote_code=True)
    result = runner.invoke(app, ["eval", str(root), "--iter", "0"])
    assert result.exit_code == 2
    assert "model.trust_remote_code = true runs code from the run directory" in result.output
    assert "Traceback" not in result.output
    trusted = runner.invoke(app, ["--trust-run", "eval", str(root), "--iter", "0"])
    assert (
        "runs code from the run directory" not in trusted.output
    )  # it fails later, for lack of a checkpoint
    again = runner.invoke(app, ["eval", str(root), "--iter", "0"])  # trust does not outlive its command
    assert "runs code from the run directory" in again.output


def test_version(runner):
    from graft_cli.app import app

    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output.startswith("graft ")
