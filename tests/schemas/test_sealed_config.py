"""The run's config.toml is sealed by its manifest: a hand edit of a key an iteration computes with
(the estimator, action parsing, prompt layout, the seed, old log-probs, the tiny model's width) was
taken as the run's config by every command, exit 0, with nothing recorded -- the same change given
with ``--set`` is refused without ``--force``. Now every reader and writer refuses it with one line
naming the changed key, ``graft loop --force`` accepts it and records the change, and the keys that
are not config changes (``run.iters``, retention) may still be edited."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from graft_cli.app import app
from schemas.manifest import MANIFEST_FILE
from tests.helpers.damage import one_error_line
from tests.helpers.lock_holder import tree

EDITS = {
    "advantage.estimator": ('estimator = "graft"', 'estimator = "grpo"'),
    "env.action_parsing": ('action_parsing = "graft"', 'action_parsing = "reference"'),
    "rollout.prompt_layout": None,
    "run.seed": ("seed = 0", "seed = 5"),
    "update.old_logprobs": None,
    "model.tiny_hidden": ("tiny_hidden = 32", "tiny_hidden = 64"),
}
COMMANDS = {
    "loop": ["loop", "--run", "{run}", "--iters", "3"],
    "eval": ["eval", "{run}", "--iter", "1", "--force"],
    "graph": ["graph", "{run}", "--iter", "1", "--force", "--yes"],
    "report": ["report", "{run}", "-o", "{out}"],
    "export": ["export", "{run}", "--iter", "1", "-o", "{out}"],
}


def _edit(run: Path, key: str) -> None:
    """Change ``key`` in config.toml by hand (another valid value of it)."""
    from schemas.config import RANGES, load_config  # noqa: F401 - the valid values come from the config

    path = run / "config.toml"
    text = path.read_text()
    section, name = key.split(".")
    pair = EDITS[key]
    if pair is None:  # a Literal key: its other allowed value
        import typing

        from schemas.config import Config

        value = getattr(getattr(load_config(path), section), name)
        hints = typing.get_type_hints(type(getattr(Config(), section)))
        other = next(v for v in typing.get_args(hints[name]) if v != value)
        pair = (f"{name} = {json.dumps(value)}", f"{name} = {json.dumps(other)}")
    assert re.search(rf"^{re.escape(pair[0])}$", text, re.M), (pair, text)
    path.write_text(re.sub(rf"^{re.escape(pair[0])}$", pair[1], text, count=1, flags=re.M))


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize("key", sorted(EDITS))
def test_a_hand_edited_config_is_refused(run: Path, tmp_path: Path, key: str, command: str) -> None:
    _edit(run, key)
    before = tree(run)
    out = tmp_path / "out"
    result = CliRunner().invoke(
        app, [a.replace("{run}", str(run)).replace("{out}", str(out)) for a in COMMANDS[command]]
    )
    line = one_error_line(result, f"{run}/config.toml: differs from the config the run's manifest.json seals")
    assert key in line and f"graft loop --run {run} --force" in line
    assert tree(run) == before and not out.exists()


def test_loop_force_accepts_an_edit_and_records_it(run: Path) -> None:
    _edit(run, "advantage.estimator")
    result = CliRunner().invoke(app, ["loop", "--run", str(run), "--iters", "2", "--force"])
    assert result.exit_code == 0, result.output
    manifest = json.loads((run / MANIFEST_FILE).read_text())
    assert manifest["config_changes"] == [
        {"after_iterations": [0, 1], "changed": ["advantage.estimator: 'graft' -> 'grpo'"]}
    ]
    assert manifest["config"] == (run / "config.toml").read_text()
    assert CliRunner().invoke(app, ["sql", str(run), "SELECT 1"]).exit_code == 0
    assert (
        CliRunner().invoke(app, ["graph", str(run), "--iter", "1"]).exit_code == 2
    )  # finished: refused as before


@pytest.mark.parametrize("edit", [("iters = 2", "iters = 3"), ("keep_last = 0", "keep_last = 2")])
def test_keys_that_are_not_config_changes_may_be_edited(run: Path, edit: tuple[str, str]) -> None:
    path = run / "config.toml"
    text = path.read_text()
    assert re.search(rf"^{re.escape(edit[0])}$", text, re.M)
    path.write_text(re.sub(rf"^{re.escape(edit[0])}$", edit[1], text, count=1, flags=re.M))
    result = CliRunner().invoke(app, ["sql", str(run), "SELECT count(*) FROM steps"])
    assert result.exit_code == 0, result.output


def test_a_lost_config_seal_is_refused(run: Path) -> None:
    path = run / MANIFEST_FILE
    manifest = json.loads(path.read_text())
    del manifest["config"]
    path.write_text(json.dumps(manifest))
    result = CliRunner().invoke(app, ["sql", str(run), "SELECT 1"])
    one_error_line(result, "has lost its record of 'config'")
