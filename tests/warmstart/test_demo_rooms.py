"""The warm start's own rooms (``sft.env_options``, ``sft.tasks``): demos and DAgger rounds play the
run's environment with other options, e.g. shuffled rooms instead of the benchmark's one room."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from graft_cli.app import app
from schemas.config import load_config
from stages.envs.base import Episode
from stages.envs.registry import make_environment
from stages.policy.tiny import environment_texts
from stages.policy.tokenizer import build_word_tokenizer
from stages.warmstart.demos import make_demo_environment, split_demos
from stages.warmstart.initial import build_tiny_for_config
from tests.helpers.paths import CONFIGS

ROOMS = ["sft.enabled=true", "sft.env_options={shuffle = true}"]


def _rooms(env, tasks) -> set[str]:
    """The reset observation (the room's receptacle list) of every task."""
    return {Episode(env, t).current.text.split("\n\nYour task")[0] for t in tasks}


def test_the_demo_environment_is_the_runs_with_the_warm_starts_options() -> None:
    plain = load_config(CONFIGS / "household_long.toml")
    assert make_demo_environment(plain).options == make_environment(plain).options
    config = load_config(CONFIGS / "household_long.toml", [*ROOMS, "sft.tasks=12"])
    run_env, demo_env = make_environment(config), make_demo_environment(config)
    assert len(_rooms(run_env, run_env.tasks("train", 12, 0))) == 1  # the benchmark's one room
    assert len(_rooms(demo_env, demo_env.tasks("train", 12, 0))) > 6  # a room per task
    assert demo_env.options == {**run_env.options, "shuffle": True}
    demos = split_demos(demo_env, config, "train", 24, 0.0, tasks=config.sft.tasks)
    assert demos["task_id"].n_unique() == 12  # sft.tasks, not env.train_tasks (16)


def test_the_tiny_vocabulary_covers_the_warm_starts_rooms(tmp_path: Path) -> None:
    from tests.helpers.vocab import tokenizer_vocab

    config = load_config(
        CONFIGS / "household_long.toml", [*ROOMS, "model.tiny_vocab_tasks=3", "model.tiny_hidden=16"]
    )
    build_tiny_for_config(tmp_path / "m", config)
    texts = [
        t
        for env in (make_environment(config), make_demo_environment(config))
        for t in environment_texts(env, tasks_per_split=3)
    ]
    expected = build_word_tokenizer(list(dict.fromkeys(texts)))
    got = tokenizer_vocab(tmp_path / "m")
    assert got == expected.backend_tokenizer.get_vocab(with_added_tokens=False)
    only_run = build_word_tokenizer(
        list(dict.fromkeys(environment_texts(make_environment(config), tasks_per_split=3)))
    )
    assert len(got) > len(only_run.backend_tokenizer.get_vocab(with_added_tokens=False))


def test_a_bad_warm_start_option_is_refused_before_the_run_directory_is_written(tmp_path: Path) -> None:
    run_dir = tmp_path / "r"
    result = CliRunner().invoke(
        app,
        [
            "loop",
            "--config",
            str(CONFIGS / "household_long.toml"),
            "--run",
            str(run_dir),
            "--set",
            "sft.env_options={bogus = 1}",
        ],
    )
    assert result.exit_code == 2
    assert result.output.startswith("error: ") and "unknown option 'bogus'" in result.output
    assert not (run_dir / "config.toml").exists()


def test_the_long_config_runs_end_to_end_with_its_warm_start_shrunk(tmp_path: Path) -> None:
    """The README's long-horizon command, its sizes shrunk to seconds: the warm start (situation
    template, cosine schedule, a DAgger round) then an iteration of generate-mode GRPO-C and an eval."""
    import polars as pl

    from schemas import read_table

    run_dir = tmp_path / "long"
    shrink = [
        "model.tiny_vocab_tasks=3",
        "model.tiny_hidden=16",
        "env.max_turns=4",
        "env.train_tasks=2",
        "env.eval_tasks=2",
        "sft.episodes=4",
        "sft.epochs=1",
        "sft.warmup_steps=1",
        "sft.dagger_episodes=2",
        "sft.dagger_rounds=1",
        "sft.dagger_epochs=1",
        "rollout.groups=1",
        "rollout.group_size=2",
        "run.eval_every=1",
    ]
    args = ["loop", "--config", str(CONFIGS / "household_long.toml"), "--run", str(run_dir), "--iters", "1"]
    result = CliRunner().invoke(app, args + [a for s in shrink for a in ("--set", s)])
    assert result.exit_code == 0, result.output
    config = load_config(run_dir / "config.toml")
    assert (config.sft.think, config.sft.lr_schedule, config.sft.dagger_keep, config.rollout.mode) == (
        "situation",
        "cosine",
        0.5,
        "generate",
    )
    demos = read_table(run_dir / "sft" / "demos" / "steps.parquet", "steps")
    assert demos["response"].str.starts_with("<think>at ").all()
    relabelled = read_table(run_dir / "sft" / "dagger" / "round_1" / "steps.parquet", "steps")
    assert relabelled["response"].str.contains(" carrying ").all()
    steps = read_table(run_dir / "iter_0000" / "steps.parquet", "steps")
    assert steps.height > 0 and (run_dir / "iter_0000" / "metrics_update.parquet").is_file()
    assert pl.read_parquet(run_dir / "sft" / "metrics_sft.parquet").height > 0
