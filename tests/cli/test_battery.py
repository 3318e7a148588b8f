"""Hostile inputs that used to end in a traceback: each is one clear line, exit 2,
and a refused start writes nothing."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

from graft_cli.app import app
from schemas.errors import GraftError
from stages.envs.base import Episode
from stages.envs.registry import make_env
from tests.helpers.examples import CORRIDOR_ENV
from tests.helpers.paths import CONFIGS, EXAMPLES, REPO

CONFIG = str(CONFIGS / "quickstart.toml")


def _loop_start(tmp_path: Path, *sets: str) -> tuple[str, Path]:
    """(the one error line, the run directory) of a quickstart start with these --set items."""
    run = tmp_path / "run"
    args = ["loop", "--config", CONFIG, "--run", str(run)]
    for item in sets:
        args += ["--set", item]
    return _one_line(CliRunner().invoke(app, args)), run


def _one_line(result) -> str:  # type: ignore[no-untyped-def]
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1, result.output
    return lines[0]


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (
            ["--set", "run.seed=18446744073709551616"],
            "'run.seed' = 18446744073709551616 is invalid; must be in [0, 2**63 - 1]",
        ),
        (["--set", "sft.lr=1e39"], "'sft.lr' = 1e+39 is invalid; must be in [0, 10]"),
        (["--set", "run.name=\udcff"], "not valid UTF-8 text"),
        (["--iters", "-2"], "--iters -2: must be >= 0"),
        (["--set", "env.name=subprocess:run"], "env.name 'subprocess:run': its constructor raised TypeError"),
    ],
)
def test_a_refused_loop_start_is_one_line_and_writes_nothing(tmp_path, args, expected):
    run = tmp_path / "run"
    line = _one_line(CliRunner().invoke(app, ["loop", "--config", CONFIG, "--run", str(run), *args]))
    assert expected in line
    assert not run.exists()


@pytest.mark.parametrize(
    "command", [["play", "household"], ["synth", "{tmp}/s"], ["demos", "household", "-o", "{tmp}/d"]]
)
@pytest.mark.parametrize("seed", ["-1", str(2**64)])
def test_command_line_seeds_are_checked(tmp_path, command, seed):
    args = [a.replace("{tmp}", str(tmp_path)) for a in command]
    assert f"--seed {seed}: must be in [0, 2**63 - 1]" in _one_line(
        CliRunner().invoke(app, [*args, "--seed", seed])
    )


class _Wrapped:
    """A game whose reset/step return what a broken plug-in might."""

    def __init__(self, game, bad_reset=None, bad_step=None):  # type: ignore[no-untyped-def]
        self.game, self.bad_reset, self.bad_step = game, bad_reset, bad_step

    def reset(self, task):  # type: ignore[no-untyped-def]
        obs = self.game.reset(task)
        return self.bad_reset(obs) if self.bad_reset else obs

    def step(self, action):  # type: ignore[no-untyped-def]
        result = self.game.step(action)
        return self.bad_step(result) if self.bad_step else result

    def expert_action(self):  # type: ignore[no-untyped-def]
        return self.game.expert_action()


def _env(bad_reset=None, bad_step=None):  # type: ignore[no-untyped-def]
    env = make_env(CORRIDOR_ENV, max_turns=5, invalid_penalty=-0.1, data="", length=3)
    new_game = env.new_game
    env.new_game = lambda: _Wrapped(new_game(), bad_reset, bad_step)
    return env


@pytest.mark.parametrize(
    "bad",
    [
        lambda o: replace(o, admissible=None),
        lambda o: replace(o, admissible=["go east", 3]),
        lambda o: replace(o, text=o.text.encode()),
        lambda o: "not an observation",
    ],
)
def test_bad_reset_data_is_a_clear_error_before_any_turn(examples_on_path, bad):  # noqa: F811
    env = _env(bad_reset=bad)
    with pytest.raises(TypeError, match="reset"):
        Episode(env, env.tasks("train", 1, 0)[0])


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (lambda r: replace(r, terminated="no"), "terminated = 'no' is not a bool"),
        (
            lambda r: replace(r, observation=replace(r.observation, admissible=None)),
            "admissible must be a list",
        ),
        (lambda r: replace(r, observation=replace(r.observation, text=b"bytes")), "must be strings"),
    ],
)
def test_bad_step_data_truncates_the_episode_with_the_error_recorded(examples_on_path, bad, message):  # noqa: F811
    env = _env(bad_step=bad)
    episode = Episode(env, env.tasks("train", 1, 0)[0])
    record = episode.act("go east")
    assert episode.done and record.truncated and not record.terminated
    assert message in record.error


def test_a_plugin_whose_constructor_raises_is_one_error(tmp_path, monkeypatch):
    (tmp_path / "raising_env.py").write_text(
        "class Env:\n    def __init__(self, **kw):\n        raise RuntimeError('no data here')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(
        GraftError, match="env.name 'raising_env:Env': its constructor raised RuntimeError: no data here"
    ):
        make_env("raising_env:Env", max_turns=3)


def _sql_run(root: Path) -> Path:
    from schemas import write_table
    from stages.credit.synth import synth_steps

    (root / "iter_0000").mkdir(parents=True)
    write_table(
        synth_steps(groups=2, group_size=2, horizon=3, seed=1), "steps", root / "iter_0000" / "steps.parquet"
    )
    return root


@pytest.mark.parametrize("name", ["a[1]", "b*c", "d?e"])
def test_sql_refuses_a_run_path_duckdb_would_read_as_a_pattern(tmp_path, name):
    _sql_run(tmp_path / "a1")  # what "a[1]" would match instead
    _sql_run(tmp_path / "bXc")  # what "b*c" would read as well
    root = _sql_run(tmp_path / name)
    line = _one_line(CliRunner().invoke(app, ["sql", str(root), "SELECT count(*) FROM steps"]))
    assert "graft sql needs a run path without [ ] * ? { }" in line


def test_sql_refuses_a_symlink_loop_in_one_line(tmp_path):
    root = _sql_run(tmp_path / "run")
    (root / "a").symlink_to(root / "b")
    (root / "b").symlink_to(root / "a")
    assert "a symlink loop in the run" in _one_line(CliRunner().invoke(app, ["sql", str(root), "SELECT 1"]))


def test_sql_json_names_non_finite_numbers_instead_of_writing_null(tmp_path):
    import json

    root = _sql_run(tmp_path / "run")
    query = "SELECT 'nan'::DOUBLE AS a, 'inf'::DOUBLE AS b, -'inf'::DOUBLE AS c, NULL::DOUBLE AS d, 1.5 AS e"
    result = CliRunner().invoke(app, ["sql", str(root), query, "--format", "json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == [{"a": "NaN", "b": "Infinity", "c": "-Infinity", "d": None, "e": 1.5}]


def test_errors_escape_control_characters(tmp_path):
    root = tmp_path / "run\x1b[31mred\nnext"
    result = CliRunner().invoke(app, ["sql", str(root), "SELECT 1"])
    line = _one_line(result)
    assert "\x1b" not in result.output and "\\x1b[31mred\\nnext" in line


@pytest.mark.parametrize("value", ["1e-310", "1e-5"])
def test_a_subnormal_temperature_is_refused(tmp_path, value):
    run = tmp_path / "run"
    result = CliRunner().invoke(
        app, ["loop", "--config", CONFIG, "--run", str(run), "--set", f"rollout.temperature={value}"]
    )
    assert "must be 0 (greedy) or >= 0.001" in _one_line(result) and not run.exists()


def test_tiny_hidden_must_divide_into_heads(tmp_path):
    line, run = _loop_start(tmp_path, "model.tiny_hidden=30", "model.tiny_heads=4")
    assert "must be a multiple of model.tiny_heads = 4" in line and not run.exists()


def test_a_bad_log_dir_is_refused_before_the_run_exists(tmp_path):
    pytest.importorskip("tensorboardX")
    blocker = tmp_path / "file"
    blocker.write_text("x")
    run = tmp_path / "run"
    for value in (str(blocker), str(blocker / "sub")):
        args = [
            "loop",
            "--config",
            CONFIG,
            "--run",
            str(run),
            "--set",
            "log.tensorboard=true",
            "--set",
            f"log.dir={value}",
        ]
        assert "log.dir" in _one_line(CliRunner().invoke(app, args))
        assert not run.exists()


def test_a_relative_log_dir_is_taken_from_the_run_directory(tmp_path, monkeypatch):
    from schemas.config import load_config
    from schemas.rundir import Run
    from stages.observe.live_log import log_dir

    monkeypatch.chdir(tmp_path)
    config = load_config(None, ["log.dir=tb"])
    assert log_dir(Run(tmp_path / "runs" / "r"), config) == tmp_path / "runs" / "r" / "tb"
    assert log_dir(Run(tmp_path / "r"), load_config(None, ["log.dir=/abs/tb"])) == Path("/abs/tb")


def test_solve_without_a_graph_says_what_to_run_first(tmp_path):
    from schemas.config import Config
    from schemas.rundir import create_run

    (tmp_path / "empty").mkdir()
    line = _one_line(CliRunner().invoke(app, ["solve", str(tmp_path / "empty")]))
    assert "run graft graph STEPS.parquet -o" in line
    run = create_run(tmp_path / "run", Config())
    line = _one_line(CliRunner().invoke(app, ["solve", str(run.root), "--iter", "0"]))
    assert f"run graft graph {run.root} --iter 0 first" in line


def test_repeatable_options_show_their_item_type():
    result = CliRunner().invoke(app, ["solve", "--help"])
    assert "--set <str>" in result.output and "list[str]" not in result.output


def test_a_prompt_and_response_budget_over_the_models_context_is_refused(tmp_path):
    # nothing checked prompt + new tokens against the model's context length
    import json

    from schemas.config import load_config
    from stages.loop.preflight import check_context

    line, run = _loop_start(tmp_path, "rollout.max_prompt_tokens=4000", "rollout.max_new_tokens=200")
    assert "= 4200 exceeds the model's context of 4096 positions" in line
    assert not run.exists()
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"max_position_embeddings": 2048}))
    with pytest.raises(GraftError, match=r"max_position_embeddings in .*/config.json"):
        check_context(load_config(None, [f"model.path={model}", "rollout.max_prompt_tokens=2048"]))
    check_context(
        load_config(None, [f"model.path={model}", "rollout.max_prompt_tokens=1536"])
    )  # 1536 + 512 fits


def test_a_plugin_whose_tasks_raise_is_one_line_in_every_command(tmp_path, monkeypatch):
    (tmp_path / "broken_tasks.py").write_text(
        "from corridor_env import Corridor\n"
        "class Env(Corridor):\n"
        "    def tasks(self, split, count, seed):\n"
        "        raise KeyError('goal')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.syspath_prepend(str(EXAMPLES))
    for command in (["play", "broken_tasks:Env"], ["demos", "broken_tasks:Env", "-o", str(tmp_path / "d")]):
        line = _one_line(CliRunner().invoke(app, command, input=""))
        assert "cannot list" in line and "KeyError" in line


def test_sql_tables_and_errors_show_bidirectional_controls_escaped(tmp_path):
    # U+202E (right-to-left override) in a cell reversed what the terminal showed after it
    import polars as pl

    from schemas import write_table
    from stages.credit.synth import synth_steps

    root = tmp_path / "run"
    steps = synth_steps(groups=1, group_size=1, horizon=2, seed=1)
    write_table(
        steps.with_columns(pl.lit("go\u202eeast\u2066").alias("action")),
        "steps",
        root / "iter_0000" / "steps.parquet",
    )
    result = CliRunner().invoke(app, ["sql", str(root), "SELECT DISTINCT action FROM steps"])
    assert result.exit_code == 0, result.output
    assert "\u202e" not in result.output and "\u2066" not in result.output
    assert "go\\u202eeast\\u2066" in result.output
    line = _one_line(CliRunner().invoke(app, ["sql", str(tmp_path / "no\u202erun"), "SELECT 1"]))
    assert "\u202e" not in line and "no\\u202erun" in line


@pytest.mark.parametrize(
    ("sets", "expected"),
    [
        (
            ["update.lora.r=1099511627776"],
            "'update.lora.r' = 1099511627776 is invalid; must be in [0, 65536]",
        ),
        (
            ["update.lora.r=17", "model.tiny_hidden=16", "model.tiny_heads=2"],
            "update.lora.r = 17 exceeds the model's hidden size 16",
        ),
        (
            ["update.lora.r=2", 'update.lora.target_modules=["nope_proj"]'],
            "update.lora.target_modules: 'nope_proj' names no layer",
        ),
    ],
)
def test_lora_settings_the_model_cannot_take_are_refused_at_the_start(tmp_path, sets, expected):
    # r = 2**40 reached the allocator, r = 100000 on hidden 16 ran, an unknown module failed late
    line, run = _loop_start(tmp_path, *sets)
    assert expected in line and not run.exists()


def test_a_negative_merge_is_one_line(tmp_path):
    from schemas.config import Config
    from schemas.rundir import create_run

    run = create_run(tmp_path / "run", Config())
    line = _one_line(CliRunner().invoke(app, ["rollout", str(run.root), "--iter", "1", "--merge", "-1"]))
    assert "--merge -1: the number of shard files must be >= 1 (0: no merge)" in line


def test_rewards_that_overflow_are_one_line_without_numpy_warnings(tmp_path):
    import polars as pl

    from schemas import write_table
    from stages.credit.synth import synth_steps

    steps = synth_steps(groups=2, group_size=3, horizon=4, seed=1)
    for column in ("reward", "outcome"):
        path = write_table(
            steps.with_columns(pl.lit(1e308).alias(column)), "steps", tmp_path / column / "s.parquet"
        )
        result = CliRunner().invoke(app, ["advantage", str(path), "-o", str(tmp_path / column / "out")])
        assert "not finite" in _one_line(result) and "RuntimeWarning" not in result.output


def test_a_missing_local_model_path_is_not_called_a_hub_id(tmp_path, monkeypatch):
    # models/smollm2 before `graft init-model` ran was "a Hugging Face Hub id" to download
    monkeypatch.chdir(tmp_path)
    line, run = _loop_start(tmp_path, "model.path=models/smollm2")
    assert "models/smollm2: local model directory not found" in line and "Hub id" not in line
    assert "graft init-model models/smollm2 --gguf smollm2" in line and not run.exists()
    (tmp_path / "models").mkdir()
    line, _ = _loop_start(tmp_path, "model.path=models/Qwen2.5-1.5B-Instruct")
    assert "models/Qwen2.5-1.5B-Instruct: local model directory not found" in line
    line, _ = _loop_start(tmp_path, "model.path=Qwen/Qwen2.5-1.5B-Instruct")  # still a Hub id
    assert "looks like a Hugging Face Hub id" in line


def test_models_folder_is_ignored_by_git():
    import subprocess

    root = REPO
    done = subprocess.run(
        ["git", "check-ignore", "-q", "models/smollm2/model.safetensors"], cwd=root, capture_output=True
    )
    assert done.returncode == 0, (
        "models/ (where the presets put downloaded or converted models) is not ignored"
    )


def test_a_log_dir_that_cannot_be_created_is_refused_before_the_run_exists(tmp_path):
    pytest.importorskip("tensorboardX")
    line, run = _loop_start(tmp_path, "log.tensorboard=true", "log.dir=/proc/graft-x")
    assert "log.dir = '/proc/graft-x': cannot create" in line and not run.exists()


def _evil_model(folder: Path) -> Path:
    import json

    folder.mkdir()
    (folder / "config.json").write_text(
        json.dumps(
            {
                "model_type": "evil",
                "auto_map": {"AutoConfig": "evil_code.Config", "AutoModelForCausalLM": "evil_code.Model"},
                "max_position_embeddings": 4096,
            }
        )
    )
    (folder / "evil_code.py").write_text("raise RuntimeError('the custom code refuses to load')\n")
    (folder / "model.safetensors").write_bytes(b"x")
    return folder


def test_trusted_remote_code_that_raises_is_one_line_and_the_refused_start_is_removed(tmp_path):
    # 72 lines of traceback, and a run directory with .lock and config.toml left behind
    model = _evil_model(tmp_path / "evil")
    run = tmp_path / "run"
    args = ["loop", "--config", CONFIG, "--run", str(run), "--set", f"model.path={model}"]
    result = CliRunner().invoke(app, [*args, "--set", "model.trust_remote_code=true"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    last = result.output.strip().splitlines()[-1]
    assert last.startswith(f"error: {model}: its own code (model.trust_remote_code) raised RuntimeError")
    assert not run.exists()
    from stages.policy.models import load_causal_lm, load_tokenizer

    for load in (load_causal_lm, load_tokenizer):
        with pytest.raises(GraftError, match="the custom code refuses to load"):
            load(model, trust_remote_code=True)


def test_sys_exit_inside_an_environment_is_one_line(tmp_path, monkeypatch):
    (tmp_path / "exiting_env.py").write_text(
        "import sys\n"
        "from corridor_env import Corridor\n"
        "class Env(Corridor):\n"
        "    def tasks(self, split, count, seed):\n"
        "        sys.exit(3)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.syspath_prepend(str(EXAMPLES))
    line = _one_line(CliRunner().invoke(app, ["play", "exiting_env:Env"], input=""))
    assert f"{tmp_path / 'exiting_env.py'}:5 called sys.exit(3)" in line


def test_a_shard_of_a_played_iteration_says_it_wrote_nothing(tmp_path):
    from schemas.config import Config
    from schemas.rundir import create_run
    from stages.loop import run_loop
    from tests.helpers.loop_runs import fake_runners

    run = create_run(tmp_path / "run", Config())
    run_loop(run, Config(), 1, runners=fake_runners([]), prepare=lambda *_: None)
    before = sorted((p.name, p.stat().st_mtime_ns) for p in run.iter_dir(0).iterdir())
    result = CliRunner().invoke(app, ["rollout", str(run.root), "--iter", "0", "--shard", "1/2"])
    assert result.exit_code == 0, result.output
    assert "wrote" not in result.output and "already played" in result.output
    assert sorted((p.name, p.stat().st_mtime_ns) for p in run.iter_dir(0).iterdir()) == before
