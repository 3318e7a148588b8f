"""The CPU presets configs/cpu/<env>.toml: each loads, runs on CPU without a download, and plays one
real iteration end to end (sizes shrunk with --set so that it takes seconds)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import polars as pl
import pytest
from typer.testing import CliRunner

from graft_cli.app import app
from schemas import read_table
from schemas.config import load_config
from tests.helpers.paths import REPO

ROOT = REPO
# the tiny-model twins of the GPU configs; a real-model preset (model.path set: household_smollm2)
# is tested with its model in tests/policy/test_real_model.py
PRESETS = sorted(p for p in (ROOT / "configs" / "cpu").glob("*.toml") if not load_config(p).model.path)
# the configs written for a GPU (a real model through vLLM); the CPU ones need no preset
GPU_CONFIGS = {p.stem for p in (ROOT / "configs").glob("*.toml") if load_config(p).rollout.engine == "vllm"}
ALFWORLD_DATA = Path(
    os.environ.get("ALFWORLD_DATA") or ROOT / ".." / "shared" / "data" / "alfworld"
).resolve()
# one task, two rollouts of two turns, a 1-layer model: the real stages in seconds
TINY = [
    "rollout.groups=1",
    "rollout.group_size=2",
    "env.max_turns=2",
    "env.train_tasks=1",
    "env.eval_tasks=1",
    "eval.group_size=1",
    "model.tiny_vocab_tasks=1",
    "model.tiny_hidden=16",
    "model.tiny_layers=1",
    "model.tiny_heads=2",
    "update.minibatch_size=8",
]


def changed_settings(base: dict, other: dict) -> set[tuple[str, str]]:
    """(section, key) of every setting whose value differs between two configs' dicts."""
    return {
        (section, key)
        for section in base
        for key in base[section]
        if base[section][key] != other[section][key]
    }


def test_every_gpu_config_has_a_cpu_preset() -> None:
    assert {p.stem for p in PRESETS} == GPU_CONFIGS


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.stem)
def test_preset_is_a_cpu_run_of_its_environment(preset: Path) -> None:
    config = load_config(preset)
    gpu = load_config(ROOT / "configs" / preset.name)
    assert config.env.name == gpu.env.name == preset.stem
    assert (config.run.device, config.rollout.engine, config.model.path) == ("cpu", "hf", "")
    assert config.run.name == f"{preset.stem}-cpu"  # never the same run directory as the GPU config
    # choose mode wherever the environment lists admissible actions (search is free text)
    assert config.rollout.mode == ("generate" if preset.stem == "search" else "choose")
    assert config.rollout.groups * config.rollout.group_size <= 32
    assert config.env.max_turns == gpu.env.max_turns or config.env.max_turns <= gpu.env.max_turns


def _extra_sets(env: str, tmp_path: Path) -> list[str]:
    if env == "alfworld":
        if importlib.util.find_spec("alfworld") is None:
            pytest.skip("the alfworld package is not installed (pip install -e '.[envs]')")
        if not (ALFWORLD_DATA / "json_2.1.1").is_dir():
            pytest.skip(f"no ALFWorld data at {ALFWORLD_DATA} (set ALFWORLD_DATA)")
        return [f"env.data={ALFWORLD_DATA}"]
    if env == "textworld":
        if importlib.util.find_spec("textworld") is None:
            pytest.skip("the textworld package is not installed (pip install -e '.[envs]')")
        return [f'env.options.cache_dir="{tmp_path / "games"}"']
    if env == "search" and importlib.util.find_spec("bm25s") is None:
        pytest.skip("bm25s is not installed (pip install -e '.[envs]')")
    return []


@pytest.mark.slow
@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.stem)
def test_preset_runs_one_tiny_iteration(preset: Path, tmp_path: Path) -> None:
    import torch

    torch.set_num_threads(1)
    sets = [*TINY, *_extra_sets(preset.stem, tmp_path)]
    run_dir = tmp_path / "run"
    args = ["loop", "--config", str(preset), "--run", str(run_dir), "--iters", "1"]
    result = CliRunner().invoke(app, [*args, *[a for s in sets for a in ("--set", s)]])
    assert result.exit_code == 0, result.output
    steps = read_table(run_dir / "iter_0000" / "steps.parquet", "steps")
    assert steps["group_id"].n_unique() == 1 and steps["traj_id"].n_unique() == 2
    assert steps.group_by("traj_id").len()["len"].max() <= 2  # max_turns
    assert (run_dir / "checkpoints" / "iter_0000").is_dir()
    evals = read_table(run_dir / "iter_0000" / "eval.parquet", "eval")
    success = evals.filter((pl.col("name") == "success_rate") & pl.col("task_type").is_null())["value"]
    assert success.len() == 1 and 0.0 <= success[0] <= 1.0
    assert "iter    0" in result.output
    if load_config(preset).rollout.mode == "generate":  # the valid action rate on the iteration line
        assert " valid " in result.output.split("iter    0", 1)[1].splitlines()[0]


def test_the_headroom_preset_has_the_pool_groups_and_evaluation_it_promises() -> None:
    """configs/cpu/household_smollm2_headroom.toml: >= 64 training tasks and >= 32 held-out tasks, each
    in a room of its own (no held-out room is a training room), groups of 8, >= 128 held-out episodes
    on common draws, several optimizer steps per iteration, the CPU's native precision."""
    from stages.envs.base import environment_tasks
    from stages.envs.registry import make_environment

    config = load_config(ROOT / "configs" / "cpu" / "household_smollm2_headroom.toml")
    env = make_environment(config)
    for seed in (0, 1, 100):
        train = environment_tasks(env, "train", config.env.train_tasks, seed)
        held_out = environment_tasks(env, "eval", config.env.eval_tasks, seed)
        assert len({t.task_id for t in train}) == len(train) >= 64
        assert len({t.task_id for t in held_out}) == len(held_out) >= 32
        assert not {repr(t.spec) for t in train} & {repr(t.spec) for t in held_out}  # no task in both

        def room(t):  # type: ignore[no-untyped-def]
            return repr(t.spec["receptacles"]) + repr(t.spec["objects"])

        rooms = {room(t) for t in train}
        # a small room (3 receptacles) can recur with another goal: at most 1 of 32 on these seeds
        assert sum(room(t) in rooms for t in held_out) <= 1
    assert config.rollout.group_size == 8 and config.rollout.mode == "generate"
    assert config.eval.group_size * config.env.eval_tasks >= 128 and config.eval.draws == "common"
    # no household task is solved in fewer than 3 turns (go to, take, put): >= 3 rows an episode
    assert min(len(t.spec["objects"]) for t in train) >= 1
    rows_per_iteration = 3 * config.rollout.groups * config.rollout.group_size
    assert config.update.minibatch_size * 2 <= rows_per_iteration  # at least 2 optimizer steps
    assert config.rollout.engine_options["dtype"] == "native" and config.update.bf16_on_cpu == "native"


def test_the_rooms_preset_is_the_headroom_preset_with_rl_on_unseen_rooms() -> None:
    """configs/cpu/household_smollm2_rooms.toml: the headroom preset's settings but for the
    rollout's 1,024 training rooms (its warm start on the same first 64, so the same demos) and the
    three speed options; no held-out task is a training task."""
    from stages.envs.base import environment_tasks
    from stages.envs.registry import make_environment

    headroom = load_config(ROOT / "configs" / "cpu" / "household_smollm2_headroom.toml").to_dict()
    rooms_config = load_config(ROOT / "configs" / "cpu" / "household_smollm2_rooms.toml")
    rooms = rooms_config.to_dict()
    assert changed_settings(headroom, rooms) == {
        ("run", "name"),
        ("env", "train_tasks"),
        ("sft", "tasks"),
        ("rollout", "engine_options"),
        ("update", "shared_trunk"),
    }
    assert (
        rooms["env"]["train_tasks"] == 1024 and rooms["sft"]["tasks"] == headroom["env"]["train_tasks"] == 64
    )
    assert rooms["rollout"]["engine_options"] == {
        **headroom["rollout"]["engine_options"],
        "cpu_cores": "all",
        "block_size": 32,
    }
    env = make_environment(rooms_config)
    for seed in (0, 1, 2, 3, 100):
        train = environment_tasks(env, "train", 1024, seed)
        cloned = environment_tasks(env, "train", 64, seed)
        held_out = environment_tasks(env, "eval", 32, seed)
        assert [t.task_id for t in train[:64]] == [t.task_id for t in cloned]  # the warm start's rooms
        assert len({t.task_id for t in train}) == 1024
        assert not {repr(t.spec) for t in train} & {repr(t.spec) for t in held_out}


def test_the_choose_preset_is_the_rooms_preset_in_choose_mode_at_a_smaller_step() -> None:
    """configs/cpu/household_smollm2_choose.toml: the rooms preset's settings but for choose mode,
    lr 1e-4, pi_old from the rollout and 6 iterations."""
    rooms = load_config(ROOT / "configs" / "cpu" / "household_smollm2_rooms.toml").to_dict()
    choose = load_config(ROOT / "configs" / "cpu" / "household_smollm2_choose.toml").to_dict()
    assert changed_settings(rooms, choose) == {
        ("run", "name"),
        ("run", "iters"),
        ("rollout", "mode"),
        ("update", "lr"),
        ("update", "old_logprobs"),
    }
    assert choose["run"]["iters"] == 6
    assert choose["rollout"]["mode"] == "choose" and choose["update"]["lr"] == 1e-4
    assert choose["update"]["old_logprobs"] == "stored"
