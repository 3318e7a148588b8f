"""DAgger rounds of the warm start (stages.warmstart.dagger): the clone plays, the expert relabels its turns."""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest
import torch

from schemas import read_table, validate_steps
from schemas.config import load_config
from schemas.errors import GraftError
from schemas.rundir import create_run
from stages.envs.base import Episode
from stages.envs.prompts import episode_prompt
from stages.envs.registry import make_env
from stages.warmstart.dagger import expert_relabel
from stages.warmstart.demos import demo_response, expert_demos
from tests.helpers.warmstart_cases import TINY_SFT

HOUSEHOLD = {"shuffle": True, "receptacles": 6, "distractors": 2, "objects_per_type": 2, "info_actions": True}


def household():
    return make_env("household", max_turns=30, invalid_penalty=-0.1, **HOUSEHOLD)


def test_relabelling_the_experts_own_play_gives_back_the_demos() -> None:
    env = household()
    tasks = env.tasks("train", 4, 0)
    demos = expert_demos(env, tasks, 8, seed=0, history_length=2)
    relabelled = expert_relabel(env, tasks, demos, history_length=2)
    assert relabelled.select("traj_id", "step", "prompt", "response").equals(
        demos.select("traj_id", "step", "prompt", "response")
    )
    assert (relabelled["policy_version"] == "dagger").all()


def test_every_turn_gets_the_experts_answer_at_the_state_the_play_reached() -> None:
    env = household()
    tasks = env.tasks("train", 4, 1)
    # off-expert play with invalid turns, labelled with its own random actions (kept noise 1)
    played = expert_demos(
        env, tasks, 8, noise=0.6, invalid_noise=0.3, keep_noise=1.0, seed=3, history_length=2
    )
    assert not played["valid"].all()
    relabelled = expert_relabel(env, tasks, played, history_length=2)
    validate_steps(relabelled)
    by_id = {t.task_id: t for t in tasks}
    invalid_turns = 0
    for (_,), traj in relabelled.group_by("traj_id", maintain_order=True):
        actions = traj["action"].to_list()
        for k, row in enumerate(traj.iter_rows(named=True)):
            # reference: a fresh episode replays the first k actions, then the expert answers
            episode = Episode(env, by_id[row["task_id"]])
            for action in actions[:k]:
                episode.act(action)
            assert row["prompt"] == episode_prompt("alfworld", episode, 2)
            assert row["response"] == demo_response("alfworld", episode.game.expert_action())
            if k > 0 and not traj["valid"][k - 1]:  # an invalid turn left the world, so the answer
                invalid_turns += 1
                assert row["response"] == traj["response"][k - 1]
    assert invalid_turns > 0
    # the play's own labels differed from the expert's on its random turns
    assert not relabelled["response"].equals(played["response"])


def test_situation_labels_think_the_state_the_play_reached() -> None:
    from stages.envs.parser import parse_response
    from tests.helpers.warmstart_cases import situation_from_state

    env = household()
    tasks = env.tasks("train", 4, 2)
    played = expert_demos(
        env, tasks, 8, noise=0.6, invalid_noise=0.3, keep_noise=1.0, seed=1, history_length=2
    )
    verb = expert_relabel(env, tasks, played, history_length=2)
    situation = expert_relabel(env, tasks, played, history_length=2, think="situation")
    assert situation.height == verb.height > 0
    for row_s, row_v in zip(situation.iter_rows(named=True), verb.iter_rows(named=True), strict=True):
        assert parse_response("alfworld", row_s["response"]) == parse_response("alfworld", row_v["response"])
        assert row_s["response"].startswith(f"<think>{situation_from_state(row_s['state'])}</think>")


def test_keep_valid_keeps_a_share_of_the_clones_valid_actions_and_corrects_every_invalid_one() -> None:
    import numpy as np

    from stages.envs.parser import parse_response

    env = household()
    tasks = env.tasks("train", 4, 1)
    played = expert_demos(
        env, tasks, 12, noise=0.6, invalid_noise=0.3, keep_noise=1.0, seed=3, history_length=2
    )
    expert = expert_relabel(env, tasks, played, history_length=2)
    every = expert_relabel(env, tasks, played, history_length=2, keep_valid=1.0, rng=np.random.default_rng(0))
    assert every.height == expert.height
    for row_e, row_k in zip(expert.iter_rows(named=True), every.iter_rows(named=True), strict=True):
        want = row_k["action"] if row_k["valid"] else parse_response("alfworld", row_e["response"])
        assert parse_response("alfworld", row_k["response"]) == want
    half = [
        expert_relabel(env, tasks, played, history_length=2, keep_valid=0.5, rng=np.random.default_rng(7))
        for _ in range(2)
    ]
    assert half[0].equals(half[1])  # the same generator seed, the same labels
    labels = [parse_response("alfworld", r) for r in half[0]["response"]]
    experts = [parse_response("alfworld", r) for r in expert["response"]]
    actions, valid = half[0]["action"].to_list(), half[0]["valid"].to_list()
    # valid turns where the clone's action is not the expert's: about half keep the clone's
    differs = [k for k in range(len(actions)) if valid[k] and actions[k] != experts[k]]
    kept = sum(labels[k] == actions[k] for k in differs)
    assert len(differs) > 20 and 0.3 < kept / len(differs) < 0.7
    invalid = [k for k, v in enumerate(half[0]["valid"]) if not v]
    assert invalid and all(labels[k] == experts[k] for k in invalid)
    with pytest.raises(GraftError, match="keep_valid"):
        expert_relabel(env, tasks, played, history_length=2, keep_valid=0.5)


def test_a_replay_that_reaches_another_state_is_an_error() -> None:
    env = household()
    tasks = env.tasks("train", 2, 0)
    demos = expert_demos(env, tasks, 2, seed=0)
    tampered = demos.with_columns(
        pl.when(pl.col("step") == 2).then(pl.lit("elsewhere")).otherwise(pl.col("state")).alias("state")
    )
    with pytest.raises(GraftError, match="not deterministic"):
        expert_relabel(env, tasks, tampered, history_length=2)
    with pytest.raises(GraftError, match="not in the task set"):
        expert_relabel(env, tasks[:1], demos, history_length=2)


def test_dagger_settings_are_validated() -> None:
    for key, value in [
        ("sft.dagger_rounds", "-1"),
        ("sft.dagger_episodes", "0"),
        ("sft.dagger_epochs", "0"),
        ("sft.dagger_keep", "1.5"),
    ]:
        with pytest.raises(GraftError, match=key):
            load_config(None, [f"{key}={value}"])


DAGGER = [*TINY_SFT, "sft.epochs=8", "sft.dagger_rounds=2", "sft.dagger_episodes=4", "sft.dagger_epochs=2"]


def _warm_start(root: Path) -> Path:
    from stages.warmstart.initial import ensure_initial_model

    config = load_config(None, DAGGER)
    run = create_run(root, config)
    ensure_initial_model(run, config)
    return run.sft_dir


@pytest.mark.slow
def test_dagger_rounds_add_the_clones_relabelled_turns_and_are_deterministic(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    torch.set_num_threads(1)
    sft_dir = _warm_start(tmp_path / "a")
    demos = read_table(sft_dir / "demos" / "steps.parquet", "steps")
    rounds = [read_table(sft_dir / "dagger" / f"round_{r}" / "steps.parquet", "steps") for r in (1, 2)]
    for played in rounds:
        validate_steps(played)
        assert played.height > 0 and (played["policy_version"] == "dagger").all()
    metrics = read_table(sft_dir / "metrics_sft.parquet", "metrics")
    values = dict(zip(metrics["name"], metrics["value"], strict=True))
    assert values["rows"] == demos.height + sum(r.height for r in rounds)
    assert values["dagger1_rows"] == rounds[0].height and values["dagger2_rows"] == rounds[1].height
    # the clone's play: 4 episodes of at most env.max_turns = 8 turns
    assert rounds[0]["traj_id"].n_unique() == 4 and rounds[0].group_by("traj_id").len()["len"].max() <= 8
    assert 0.0 <= values["dagger1_invalid_rate"] <= 1.0
    # 8 epochs over the demos, then 2 over demos + round 1, then 2 over everything
    losses = read_table(sft_dir / "update.parquet", "update")
    per_epoch = losses.group_by("epoch", maintain_order=True).len()
    assert per_epoch["epoch"].to_list() == list(range(12))
    width = [-(-n // 16) for n in (demos.height, demos.height + rounds[0].height, int(values["rows"]))]
    assert per_epoch["len"].to_list() == [width[0]] * 8 + [width[1]] * 2 + [width[2]] * 2
    from typer.testing import CliRunner

    from graft_cli.app import app

    shown = CliRunner().invoke(app, ["sft", str(tmp_path / "a")])
    assert shown.exit_code == 0, shown.output
    assert "dagger round 2: the clone played with invalid rate" in shown.output
    again = _warm_start(tmp_path / "b")
    want, got = (load_file(str(d / "model" / "model.safetensors")) for d in (sft_dir, again))
    assert sorted(want) == sorted(got)
    assert all(torch.equal(want[k], got[k]) for k in want)
