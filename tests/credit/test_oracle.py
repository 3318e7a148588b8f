"""The Monte-Carlo bench oracle (stages/credit/advantage/oracle.py, stages/rollout/oracle.py).

* On synthetic layered MDPs its advantages converge to the exact A^π of ``synth_steps(truth=True)``,
  with an MSE that falls like 1/K (a seeded run at K = 4, 16, 64).
* Its pieces by hand: the starts and their action prefixes, discounted continuation returns, and
  ``A_t = r_t + γ (R if done else V̂(s_{t+1})) − V̂(s_t)``.
* On a household task, continuations of a uniform policy from the state one turn before the expert's
  win, with exactly one turn left: V^π = γ · 10 · (winning actions) / (admissible actions).
"""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest

from schemas import conform
from schemas.config import Config
from schemas.errors import GraftError
from stages import credit
from stages.credit.advantage.oracle import (
    continuation_returns,
    oracle_starts,
    oracle_step_advantages,
    oracle_table,
)
from stages.credit.synth import continuation_returns as synth_returns
from stages.credit.synth import synth_mdps, synth_steps
from stages.envs.base import Episode
from stages.envs.registry import make_env
from stages.play.settings import PlaySettings
from stages.rollout.oracle import play_oracle

GAMMA = 0.9
KNOBS = dict(groups=16, horizon=6, width=3, success_reward=1.0, seed=3)


def _oracle_mse(steps, truth, starts, mdps, k: int, seed: int) -> float:
    parts = starts["state"].str.extract_groups(r"^g(\d+)/L(\d+)/s(\d+)")
    g, layer, pos = (parts.struct.field(f).cast(pl.Int64).to_numpy() for f in ("1", "2", "3"))
    returns = synth_returns(mdps, g, layer, pos, k, GAMMA, np.random.default_rng(seed))
    adv = credit.advantages(
        steps, estimator="oracle", oracle=oracle_table(starts, list(returns)), gamma=GAMMA
    )
    return float(np.mean((adv["gae"].to_numpy() - truth["a_true"].to_numpy()) ** 2))


def test_oracle_mse_against_exact_advantages_falls_like_one_over_k():
    steps, truth = synth_steps(group_size=8, gamma=GAMMA, truth=True, **KNOBS)
    mdps = synth_mdps(truth=True, **KNOBS)
    starts = oracle_starts(steps)
    mse = {
        k: np.mean([_oracle_mse(steps, truth, starts, mdps, k, 100 + r) for r in range(4)])
        for k in (4, 16, 64)
    }
    # E[MSE] = (mean variance of A's Monte-Carlo terms) / K: each 4x more continuations cut it ~4x
    assert 3.0 < mse[4] / mse[16] < 5.3, mse
    assert 3.0 < mse[16] / mse[64] < 5.3, mse
    assert mse[64] < 0.01


def _steps(rows: list[dict]) -> pl.DataFrame:
    base = {"iter": 0, "task_id": "t", "task_type": "", "observation": "", "valid": True, "terminated": False}
    table = pl.DataFrame([{**base, **r} for r in rows])
    table = table.with_columns(terminated=pl.col("done"), truncated=pl.lit(False))
    return pl.from_arrow(conform(table, "steps", source="test"))  # type: ignore[return-value]


def _two_trajectories() -> pl.DataFrame:
    # a: s0 -x-> s1 -y-> end (R = 10);  b: s0 -z-> s1 -w-> end (R = 0), z invalid (r = -0.1)
    row = dict(group_id="g", reward=0.0)
    return _steps(
        [
            {**row, "traj_id": "a", "step": 0, "state": "s0", "next_state": "s1", "action": "x", "outcome": 10.0, "done": False},
            {**row, "traj_id": "a", "step": 1, "state": "s1", "next_state": "end", "action": "y", "outcome": 10.0, "done": True},
            {**row, "traj_id": "b", "step": 0, "state": "s0", "next_state": "s1", "action": "z", "outcome": 0.0, "done": False, "reward": -0.1, "valid": False},
            {**row, "traj_id": "b", "step": 1, "state": "s1", "next_state": "end2", "action": "w", "outcome": 0.0, "done": True},
        ]
    )  # fmt: skip


def test_starts_are_distinct_turn_states_with_the_first_trajectory_prefix():
    starts = oracle_starts(_two_trajectories())
    assert starts.select("step", "state", "traj_id").rows() == [(0, "s0", "a"), (1, "s1", "a")]
    assert starts["prefix_actions"].to_list() == [[], ["x"]]
    assert starts["prefix_valid"].to_list() == [[], [True]]


def test_continuation_returns_by_hand():
    played = pl.DataFrame(
        {
            "traj_id": ["c0", "c0", "c0", "c1"],
            "step": [0, 1, 2, 0],
            "reward": [-0.1, 0.0, 0.0, 0.0],
            "outcome": [10.0, 10.0, 10.0, 0.0],
        }
    )
    out = continuation_returns(played, GAMMA)
    assert out["ret"].to_list() == pytest.approx([-0.1 + GAMMA**3 * 10.0, 0.0])
    assert out["turns"].to_list() == [3, 1]


def test_step_advantages_by_hand():
    steps = _two_trajectories()
    starts = oracle_starts(steps)
    table = oracle_table(starts, [np.array([2.0, 4.0]), np.array([5.0])])  # V̂(s0) = 3, V̂(s1) = 5
    a = oracle_step_advantages(steps, table, GAMMA)
    # a0: 0 + γ·5 − 3; a1 (ends, R = 10): 0 + γ·10 − 5; b0: −0.1 + γ·5 − 3; b1 (R = 0): γ·0 − 5
    assert a == pytest.approx([GAMMA * 5 - 3, GAMMA * 10 - 5, -0.1 + GAMMA * 5 - 3, -5.0])
    assert table["return_std"].to_list() == pytest.approx([np.sqrt(2.0), 0.0])
    adv = credit.advantages(steps, estimator="oracle", oracle=table, gamma=GAMMA)
    assert adv["gae"].to_list() == pytest.approx(list(a))
    assert adv["advantage"].to_numpy() == pytest.approx(a / (np.std(a) + 1e-6))


def test_missing_oracle_values_are_refused():
    steps = _two_trajectories()
    with pytest.raises(GraftError, match="bench oracle"):
        credit.advantages(steps, estimator="oracle", gamma=GAMMA)
    partial = oracle_table(oracle_starts(steps).head(1), [np.array([1.0])])
    with pytest.raises(GraftError, match="no value for group 'g', turn 0"):
        credit.advantages(steps, estimator="oracle", oracle=partial, gamma=GAMMA)


class _CharTokenizer:
    """Characters as token ids: enough for the renderer of choose mode."""

    def __call__(self, texts, add_special_tokens=False):
        return {"input_ids": [[ord(c) % 5000 for c in t] for t in texts]}

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


class _UniformEngine:
    """Every admissible action scores the same: π(a|s) = 1 / |admissible|."""

    name, prompt_format, policy_version = "uniform", "raw", "uniform"
    tokenizer = _CharTokenizer()

    def score_choices(self, prompts_ids, choices_ids):
        return [[np.zeros(len(c), np.float32) for c in cs] for cs in choices_ids]


def _expert_steps(env, task) -> pl.DataFrame:
    """One trajectory of the scripted expert on ``task``, as a steps table."""
    episode = Episode(env, task)
    rows = []
    while not episode.done:
        rec = episode.act(episode.game.expert_action())
        rows.append(
            dict(
                group_id="g0", task_id=task.task_id, traj_id="g0-r0", step=len(rows), state=rec.state,
                next_state=rec.next_state, action=rec.action, valid=rec.valid, reward=rec.reward,
                done=rec.done, terminated=rec.terminated, truncated=rec.truncated,
            )
        )  # fmt: skip
    outcome = episode.outcome
    table = pl.DataFrame(rows).with_columns(
        outcome=pl.lit(outcome), iter=pl.lit(0), task_type=pl.lit(task.task_type), observation=pl.lit("")
    )
    return pl.from_arrow(conform(table, "steps", source="expert"))  # type: ignore[return-value]


def test_household_values_one_turn_before_the_win_match_the_uniform_policy():
    opts = dict(shuffle=True, receptacles=3, distractors=0, objects_per_type=2, info_actions=False)
    probe = make_env("household", max_turns=30, **opts)
    task = probe.tasks("train", 1, seed=0)[0]
    expert = _expert_steps(probe, task)
    T = expert.height
    assert expert["outcome"][0] == 10.0 and T >= 2
    # the same world with exactly T turns: from s_{T-1} one turn is left, so V^π(s_{T-1}) = γ · 10 · w / n
    env = make_env("household", max_turns=T, **opts)
    before = Episode(env, task)
    for action in expert["action"][: T - 1]:
        before.act(action)
    admissible = list(before.current.admissible)
    wins = 0
    for action in admissible:  # w: the admissible actions that win from s_{T-1}
        trial = Episode(env, task)
        for a in expert["action"][: T - 1]:
            trial.act(a)
        trial.act(action)
        wins += trial.won
    assert wins >= 1
    k = 400
    settings = PlaySettings(mode="choose", temperature=1.0, history_length=2)
    table, cost = play_oracle(
        _UniformEngine(), env, expert, {task.task_id: task}, k, GAMMA, settings, seed=0, iteration=0,
        version="uniform",
    )  # fmt: skip
    assert table.height == T and cost["oracle_continuations"] == T * k
    last = table.filter(pl.col("step") == T - 1).row(0, named=True)
    p = wins / len(admissible)
    expected = GAMMA * 10.0 * p
    se = GAMMA * 10.0 * np.sqrt(p * (1 - p) / k)
    assert abs(last["value"] - expected) < 4 * se + 1e-9, (last, expected, se)
    assert last["turns"] == k  # one turn each
    # the expert's winning step: A = γ·10 − V̂(s_{T-1})
    a = oracle_step_advantages(expert, table, GAMMA)
    assert a[-1] == pytest.approx(GAMMA * 10.0 - last["value"])
    # from the start with T turns the uniform policy rarely wins; a value is never above the expert's
    first = table.filter(pl.col("step") == 0).row(0, named=True)
    assert 0.0 <= first["value"] <= GAMMA**T * 10.0 + 1e-9


def test_rollout_stage_refuses_the_oracle_when_sharded(tmp_path):
    from schemas.rundir import create_run
    from stages.rollout import run_rollout

    config = Config()
    config.advantage.estimator = "oracle"
    run = create_run(tmp_path / "run", config)
    with pytest.raises(GraftError, match="unsharded only"):
        run_rollout(run, 0, config, shard=(0, 2))
    assert not (run.iter_dir(0) / "oracle.parquet").exists()


def test_advantage_stage_reads_the_rollout_oracle_table(tmp_path):
    from schemas import write_table
    from stages.credit.runners import advantage_files, graph_files, solve_files

    steps = _two_trajectories()
    write_table(steps, "steps", tmp_path / "steps.parquet")
    config = Config()
    config.advantage.estimator = "oracle"
    config.solve.gamma = GAMMA
    graph_files(tmp_path / "steps.parquet", tmp_path, config)
    solve_files(tmp_path, config)
    with pytest.raises(GraftError, match="oracle.parquet"):
        advantage_files(tmp_path / "steps.parquet", tmp_path, config)
    assert not (tmp_path / "advantages.parquet").exists()
    table = oracle_table(oracle_starts(steps), [np.array([2.0, 4.0]), np.array([5.0])])
    write_table(table, "oracle", tmp_path / "oracle.parquet")
    advantage_files(tmp_path / "steps.parquet", tmp_path, config)
    adv = pl.read_parquet(tmp_path / "advantages.parquet")
    assert adv["gae"].to_list() == pytest.approx([GAMMA * 5 - 3, GAMMA * 10 - 5, -0.1 + GAMMA * 5 - 3, -5.0])
