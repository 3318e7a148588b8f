"""The rollout stage: steps tables, stored log-probs, modes, seeds, errors, runner, shards, kills."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import fields
from pathlib import Path

import numpy as np
import polars as pl
import pytest
import torch

from graft_cli.app import app
from schemas import conform, read_table, validate_steps
from schemas.config import Config, config_from_dict
from schemas.errors import GraftError
from schemas.integrity import CHECKPOINT_MARKER
from schemas.rundir import create_run
from stages.envs import registry
from stages.play.collect import collect_episodes
from stages.play.settings import PlaySettings
from stages.policy.engine import EngineOptions
from stages.policy.live_engine import build_engine
from stages.policy.tiny import TinySpec, build_tiny_model
from stages.rollout import merge_rollout_shards, run_rollout
from stages.warmstart.initial import ensure_initial_model
from tests.helpers.paths import REPO
from tests.helpers.rollout_fakes import CorridorEnv, ScriptedEngine, corridor_prompt

torch.set_num_threads(1)


# the behaviour policy's numbers: their last float bits depend on how the policy calls were batched
SCORES = ["response_logprobs", "choice_scores"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("ro") / "model"
    spec = TinySpec(hidden=32, layers=1, heads=2)
    return build_tiny_model(
        path, CorridorEnv(), seed=0, spec=spec, tasks_per_split=8, prompt_fn=corridor_prompt
    )


@pytest.fixture(scope="module")
def engine(model_dir):
    return build_engine("hf", model_dir, "initial", EngineOptions())


@pytest.fixture
def corridor_registered(monkeypatch):
    monkeypatch.setitem(registry.ENVIRONMENTS, "corridor", "tests.helpers.rollout_fakes:make_corridor")


def _collect(engine, env=None, *, mode="choose", seed=0, tasks=3, group_size=2, **kw) -> pl.DataFrame:
    """``collect_episodes`` on the corridor; ``kw`` holds ``PlaySettings`` fields and call arguments."""
    env = env or CorridorEnv()
    names = {f.name for f in fields(PlaySettings)}
    settings = PlaySettings(
        mode=mode,
        temperature=kw.pop("temperature", 1.0),
        history_length=2,
        prompt_fn=corridor_prompt,
        **{k: kw.pop(k) for k in list(kw) if k in names},
    )
    return collect_episodes(
        engine,
        env,
        env.tasks("train", tasks, 0),
        group_size,
        settings,
        seed=seed,
        iteration=kw.pop("iteration", 3),
        policy_version="initial",
        progress=False,
        **kw,
    )


def _fresh_logprobs(model, prompt_ids: list[int], response_ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt_ids + response_ids]), use_cache=False).logits[0]
    logp = torch.log_softmax(logits.float(), -1)[len(prompt_ids) - 1 : -1]
    return logp.gather(1, torch.tensor(response_ids)[:, None]).squeeze(1).numpy()


def _config(**sections) -> Config:
    data = {
        "run": {"seed": 5},
        "env": {"name": "corridor", "max_turns": 4, "train_tasks": 6},
        "model": {"tiny_hidden": 32, "tiny_layers": 1, "tiny_heads": 2},
        "rollout": {"groups": 4, "group_size": 2, "batch_size": 3},
    }
    for key, value in sections.items():
        data.setdefault(key, {}).update(value)
    return config_from_dict(data)


def test_choose_mode_rows_follow_the_shared_convention(engine) -> None:
    steps = _collect(engine, tasks=3, group_size=3, batch_size=4)
    validate_steps(steps)
    conform(steps, "steps")  # exactly the steps schema
    assert steps["traj_id"].n_unique() == 9 and steps["group_id"].n_unique() == 3
    assert steps["group_id"][0] == "i0003-g00" and steps["traj_id"][0] == "i0003-g00-r0"
    assert steps["policy_version"].unique().to_list() == ["initial"]
    tok = engine.tokenizer
    for row in steps.iter_rows(named=True):
        assert row["valid"] and row["response"] == row["action"] and row["action"] in row["choices"]
        assert row["prompt"].endswith("<action>")
        assert row["prompt_ids"] == tok(row["prompt"])["input_ids"]
        assert row["response_ids"] == tok.encode(row["action"], add_special_tokens=False)
        np.testing.assert_allclose(
            row["response_logprobs"],
            _fresh_logprobs(engine.model, row["prompt_ids"], row["response_ids"]),
            atol=1e-4,
        )
        # choice_scores: m_j of every choice, in the order of `choices` (the update's pi_old)
        assert len(row["choice_scores"]) == len(row["choices"])
        chosen = row["choices"].index(row["action"])
        assert row["choice_scores"][chosen] == pytest.approx(np.mean(row["response_logprobs"]), abs=1e-6)
        for choice, score in zip(row["choices"], row["choice_scores"], strict=True):
            ids = tok.encode(choice, add_special_tokens=False)
            assert score == pytest.approx(
                np.mean(_fresh_logprobs(engine.model, row["prompt_ids"], ids)), abs=1e-4
            )
    # rows are ordered by trajectory, then step
    assert steps.select("traj_id", "step").equals(steps.select("traj_id", "step").sort("traj_id", "step"))


def test_choose_mode_scores_each_distinct_state_once(engine) -> None:
    # a group's episodes start in the same state: one scored prompt per group on the first turn, and
    # every turn sends each (prompt, actions) pair once; the rows are those of per-episode scoring
    sent: list[list[tuple]] = []

    class Recording:
        def __getattr__(self, name):
            return getattr(engine, name)

        def score_choices(self, prompts_ids, choices_ids):
            sent.append(
                [(tuple(p), tuple(map(tuple, c))) for p, c in zip(prompts_ids, choices_ids, strict=True)]
            )
            return engine.score_choices(prompts_ids, choices_ids)

    steps = _collect(Recording(), tasks=2, group_size=3, batch_size=8)
    assert len(sent[0]) == 2  # 6 episodes, 2 tasks
    assert all(len(call) == len(set(call)) for call in sent)
    first = steps.filter(pl.col("step") == 0)
    assert first.height == 6 and first["prompt_ids"].n_unique() == 2
    for row in steps.iter_rows(named=True):
        np.testing.assert_allclose(
            row["response_logprobs"],
            _fresh_logprobs(engine.model, row["prompt_ids"], row["response_ids"]),
            atol=1e-4,
        )


def test_same_seed_same_table_and_other_seed_differs(model_dir, engine) -> None:
    first = _collect(engine, seed=7, tasks=4, group_size=2)
    fresh_engine = build_engine("hf", model_dir, "initial", EngineOptions())
    assert _collect(fresh_engine, seed=7, tasks=4, group_size=2).equals(first)
    # another batching changes float rounding only: same decisions (per-episode random streams)
    rebatched = _collect(fresh_engine, seed=7, tasks=4, group_size=2, batch_size=5)
    assert rebatched.drop(SCORES).equals(first.drop(SCORES))
    np.testing.assert_allclose(
        rebatched["choice_scores"].explode().to_numpy(),
        first["choice_scores"].explode().to_numpy(),
        atol=1e-5,
    )
    np.testing.assert_allclose(
        rebatched["response_logprobs"].explode().to_numpy(),
        first["response_logprobs"].explode().to_numpy(),
        atol=1e-5,
    )
    assert not _collect(engine, seed=8, tasks=4, group_size=2).equals(first)


def test_generate_mode_parsing_invalid_turns_and_penalty(engine) -> None:
    texts = [
        "<think>the key</think><action>go to room 1</action>",  # valid
        "I will just wander around",  # unparseable -> None
        "<action>fly to the moon</action>",  # parsed but not admissible
        "<think>x</think><action> Go  To Room 2 </action>",  # normalized by the parser, valid
    ]
    scripted = ScriptedEngine(engine.tokenizer, texts)
    env = CorridorEnv(max_turns=4, invalid_penalty=-0.25)
    steps = _collect(scripted, env, mode="generate", tasks=1, group_size=1)
    validate_steps(steps)
    rows = steps.to_dicts()
    assert [r["valid"] for r in rows] == [True, False, False, True]
    assert [r["action"] for r in rows] == ["go to room 1", "", "fly to the moon", "go to room 2"]
    assert [r["reward"] for r in rows] == [0.0, -0.25, -0.25, 0.0]
    assert [r["response"] for r in rows] == texts
    # an invalid turn leaves the world where it was
    assert rows[1]["next_state"] == rows[1]["state"] == rows[0]["next_state"]
    assert rows[2]["next_state"] == rows[2]["state"]
    assert rows[3]["done"] and rows[3]["truncated"] and rows[3]["outcome"] == 0.0
    assert all(r["choices"] is None for r in rows)
    assert rows[0]["response_ids"] == engine.tokenizer.encode(texts[0], add_special_tokens=False)
    assert not rows[0]["prompt"].endswith("<action>")


def test_generate_mode_under_the_reference_rule(engine) -> None:
    # the same texts as above under verl-agent's rule: only a response with <think>...</think> and
    # the action tags is valid; an inadmissible one is valid and changes nothing; a malformed
    # admissible one still acts and is penalised
    texts = [
        "<think>near</think><action>go to room 1</action>",  # valid, acts
        "<action>go to room 2</action>",  # no <think>: penalised, but the world moves
        "<think>x</think><action>fly to the moon</action>",  # inadmissible: valid, nothing happens
        "<think>x</think>go to room 3",  # no action tags: penalised, nothing happens
    ]
    scripted = ScriptedEngine(engine.tokenizer, texts)
    env = CorridorEnv(max_turns=4, invalid_penalty=-0.25)
    steps = _collect(scripted, env, mode="generate", tasks=1, group_size=1, action_parsing="reference")
    validate_steps(steps)
    rows = steps.to_dicts()
    assert [r["valid"] for r in rows] == [True, False, True, False]
    assert [r["action"] for r in rows] == ["go to room 1", "go to room 2", "fly to the moon", ""]
    assert [r["reward"] for r in rows] == [0.0, -0.25, 0.0, -0.25]
    states = [r["state"] for r in rows] + [rows[-1]["next_state"]]
    assert states == [
        "loc=0;key=False",
        "loc=1;key=False",
        "loc=2;key=False",
        "loc=2;key=False",
        "loc=2;key=False",
    ]


def test_choose_mode_is_the_same_under_both_parsing_rules(engine) -> None:
    # choose mode picks from the admissible list: nothing is parsed, every turn is valid
    graft = _collect(engine, seed=3, tasks=3, group_size=2)
    assert graft.equals(_collect(engine, seed=3, tasks=3, group_size=2, action_parsing="reference"))
    assert graft["valid"].all()


def test_generate_mode_with_the_hf_engine_stores_true_logprobs(engine) -> None:
    steps = _collect(engine, mode="generate", tasks=2, group_size=2, max_new_tokens=6)
    validate_steps(steps)
    for row in steps.iter_rows(named=True):
        assert 1 <= len(row["response_ids"]) <= 6
        np.testing.assert_allclose(
            row["response_logprobs"],
            _fresh_logprobs(engine.model, row["prompt_ids"], row["response_ids"]),
            atol=1e-4,
        )
        assert row["reward"] == (0.0 if row["valid"] else -0.1)


def test_generate_mode_does_not_depend_on_batching(engine) -> None:
    one = _collect(engine, mode="generate", seed=4, tasks=3, group_size=2, max_new_tokens=8, batch_size=1)
    three = _collect(engine, mode="generate", seed=4, tasks=3, group_size=2, max_new_tokens=8, batch_size=3)
    assert one["response_ids"].list.len().sum() > one.height  # real multi-token samples were drawn
    # another batching (other padding) changes float rounding only: the same sampled tokens
    assert three.drop("response_logprobs").equals(one.drop("response_logprobs"))
    np.testing.assert_allclose(
        three["response_logprobs"].explode().to_numpy(),
        one["response_logprobs"].explode().to_numpy(),
        atol=1e-5,
    )
    # groups played as two shards (their own group ids) give the unsharded groups' rows
    env = CorridorEnv()
    tasks = env.tasks("train", 3, 0)
    shards = [
        collect_episodes(
            engine,
            env,
            [tasks[g] for g in ids],
            2,
            PlaySettings("generate", 1.0, 2, batch_size=3, max_new_tokens=8, prompt_fn=corridor_prompt),
            seed=4,
            iteration=3,
            policy_version="initial",
            progress=False,
            group_ids=ids,
            group_count=3,
        )
        for ids in ([1], [0, 2])
    ]
    merged = pl.concat(shards).sort("group_id", "traj_id", "step")
    assert merged.drop("response_logprobs").equals(one.drop("response_logprobs"))
    assert not _collect(
        engine, mode="generate", seed=5, tasks=3, group_size=2, max_new_tokens=8, batch_size=3
    ).equals(three)


def test_generate_mode_gives_each_episode_step_its_own_seed(engine) -> None:
    scripted = ScriptedEngine(engine.tokenizer, ["<action>look</action>"])
    _collect(scripted, CorridorEnv(max_turns=2), mode="generate", tasks=2, group_size=2, batch_size=3)
    assert len(scripted.seeds) == 8 and len(set(scripted.seeds)) == 8
    again = ScriptedEngine(engine.tokenizer, ["<action>look</action>"])
    _collect(again, CorridorEnv(max_turns=2), mode="generate", tasks=2, group_size=2, batch_size=1)
    assert sorted(again.seeds) == sorted(scripted.seeds)


def test_environment_errors_truncate_and_too_many_abort(engine) -> None:
    env = CorridorEnv(rooms=2, fail_action="look", max_turns=5)
    steps = _collect(engine, env, tasks=2, group_size=4, seed=1)
    validate_steps(steps)
    errors = steps.filter(pl.col("error").is_not_null())
    assert errors.height >= 1
    assert errors["done"].all() and errors["truncated"].all() and (errors["action"] == "look").all()
    assert errors["error"][0] == "RuntimeError: corridor engine crashed"
    with pytest.raises(GraftError, match="max_env_errors"):
        _collect(engine, env, tasks=2, group_size=4, seed=1, max_env_errors=errors.height - 1)


def test_choose_mode_needs_admissible_actions(engine) -> None:
    class NoChoices(CorridorEnv):
        def new_game(self):
            game = super().new_game()
            game.admissible = lambda: []
            return game

    with pytest.raises(GraftError, match="admissible"):
        _collect(engine, NoChoices(), tasks=1, group_size=1)


def test_run_rollout_writes_metrics_and_steps(tmp_path, corridor_registered) -> None:
    config = _config()
    run = create_run(tmp_path / "run", config)
    ensure_initial_model(run, config)  # the command's preparation; the stage builds nothing
    path = run_rollout(run, 0, config, progress=False)
    assert path == run.table_path(0, "steps") and run.stage_complete("rollout", 0)
    steps = run.read(0, "steps")
    assert steps["group_id"].n_unique() == 4 and steps["traj_id"].n_unique() == 8
    assert (run.initial_model_dir / "model.safetensors").is_file()
    metrics = read_table(run.iter_dir(0) / "metrics_rollout.parquet", "metrics")
    overall = {
        r["name"]: r["value"] for r in metrics.filter(pl.col("task_type").is_null()).iter_rows(named=True)
    }
    last = steps.group_by("traj_id").agg(pl.col("outcome").first(), pl.col("reward").sum(), pl.len())
    assert overall["success_rate"] == pytest.approx((last["outcome"] >= 10).mean())
    assert overall["mean_return"] == pytest.approx((last["outcome"] + last["reward"]).mean())
    assert overall["mean_turns"] == pytest.approx(last["len"].mean())
    assert overall["steps"] == steps.height and overall["invalid_rate"] == 0.0 and overall["seconds"] > 0
    per_type = metrics.filter(pl.col("task_type").is_not_null() & (pl.col("name") == "episodes"))
    assert per_type["value"].sum() == 8 and set(per_type["task_type"]) <= {"near", "far"}

    # a checkpoint of iteration 0 acts in iteration 1
    ckpt = run.checkpoint_dir(0)
    shutil.copytree(run.initial_model_dir, ckpt)
    (ckpt / CHECKPOINT_MARKER).write_text("{}")
    run_rollout(run, 1, config, progress=False)
    assert run.read(1, "steps")["policy_version"].unique().to_list() == ["iter_0000"]
    assert run.read(1, "steps")["group_id"][0].startswith("i0001-")
    # iteration 3 needs checkpoint 2; checkpoint 0 (an older policy) must not act instead
    with pytest.raises(GraftError, match="iter_0002 is not a complete checkpoint"):
        run_rollout(run, 3, config, progress=False)
    assert not run.table_path(3, "steps").exists()


def test_shards_merge_into_the_unsharded_table(tmp_path, corridor_registered, monkeypatch) -> None:
    # an engine that counts prefix-cache hits (as vLLM does): here one "hit" per prompt scored, so the
    # shards' counts add up to the unsharded rollout's
    from stages.policy.hf_engine import HFEngine

    score = HFEngine.score_choices

    def counting(self, prompts_ids, choices_ids):
        self.cached_prompt_tokens = getattr(self, "cached_prompt_tokens", 0) + len(prompts_ids)
        return score(self, prompts_ids, choices_ids)

    monkeypatch.setattr(HFEngine, "score_choices", counting)
    monkeypatch.setattr(HFEngine, "cached_prompt_tokens", 0, raising=False)
    config = _config()
    whole = create_run(tmp_path / "whole", config)
    ensure_initial_model(whole, config)  # the command's preparation; the stage builds nothing
    run_rollout(whole, 0, config, progress=False)
    sharded = create_run(tmp_path / "sharded", config)
    ensure_initial_model(sharded, config)  # the command's preparation; the stage builds nothing
    first = run_rollout(sharded, 0, config, shard=(1, 2), progress=False)
    assert first.name == "steps.shard-1-of-2.parquet" and not sharded.stage_complete("rollout", 0)
    assert not merge_rollout_shards(sharded, 0, config, 2)
    assert run_rollout(sharded, 0, config, shard=(0, 2), progress=False) == sharded.table_path(0, "steps")
    a, b = whole.read(0, "steps"), sharded.read(0, "steps")
    assert a.drop(SCORES).equals(b.drop(SCORES))
    assert not list(sharded.iter_dir(0).glob("*.shard-*"))
    cached = [
        read_table(run.iter_dir(0) / "metrics_rollout.parquet", "metrics")
        .filter(pl.col("name") == "prompt_tokens_cached", pl.col("task_type").is_null())["value"]
        .to_list()
        for run in (whole, sharded)
    ]
    # each policy call scores a state once (a group's first turn is one state)
    assert cached[0] == cached[1]
    assert a["prompt_ids"].n_unique() <= cached[0][0] < a.height


@pytest.mark.parametrize("mode", ["choose", "generate"])
def test_group_batch_scope_makes_sharded_steps_byte_identical(tmp_path, corridor_registered, mode) -> None:
    """With ``rollout.batch_scope = "group"`` a group's episodes share policy calls only with each
    other, so the shards' log-probs carry the unsharded run's float bits: the merged steps file is
    the same bytes. Under the default "all", the same shards change the batches, and the log-probs
    (only they) differ in the last bits, which is what the setting is for."""
    tables = {}
    for scope in ("all", "group"):
        config = _config(rollout={"batch_scope": scope, "mode": mode, "max_new_tokens": 12})
        whole = create_run(tmp_path / f"whole-{scope}", config)
        ensure_initial_model(whole, config)  # the command's preparation; the stage builds nothing
        run_rollout(whole, 0, config, progress=False)
        sharded = create_run(tmp_path / f"sharded-{scope}", config)
        ensure_initial_model(sharded, config)  # the command's preparation; the stage builds nothing
        for shard in (1, 0):
            run_rollout(sharded, 0, config, shard=(shard, 2), progress=False)
        tables[scope] = whole.read(0, "steps"), sharded.read(0, "steps")
        paths = whole.table_path(0, "steps"), sharded.table_path(0, "steps")
        if scope == "group":
            assert paths[0].read_bytes() == paths[1].read_bytes()
    (all_whole, all_sharded), (group_whole, _) = tables["all"], tables["group"]
    assert all_whole.drop(SCORES).equals(all_sharded.drop(SCORES))
    assert not all_whole["response_logprobs"].equals(all_sharded["response_logprobs"])
    # the scope changes only how calls are batched, never a decision
    assert group_whole.drop(SCORES).equals(all_whole.drop(SCORES))


def test_turn_batches_keep_scopes_apart_and_reproduce_length_sorted_slices() -> None:
    from hypothesis import given
    from hypothesis import strategies as st

    from stages.play.collect import turn_batches

    @given(
        st.lists(st.tuples(st.integers(0, 3), st.integers(1, 9)), max_size=30),
        st.integers(1, 5),
    )
    def check(episodes: list[tuple[int, int]], batch_size: int) -> None:
        scopes, lengths = [g for g, _ in episodes], [n for _, n in episodes]
        batches = turn_batches(scopes, lengths, batch_size)
        assert sorted(i for b in batches for i in b) == list(range(len(episodes)))
        assert all(1 <= len(b) <= batch_size and len({scopes[i] for i in b}) == 1 for b in batches)
        # one scope: the length-sorted order cut every batch_size (the "all" batching)
        order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
        assert turn_batches([0] * len(lengths), lengths, batch_size) == [
            order[k : k + batch_size] for k in range(0, len(order), batch_size)
        ]
        # a scope's batches depend on that scope's episodes alone
        for scope in set(scopes):
            mine = [i for i, g in enumerate(scopes) if g == scope]
            alone = turn_batches([scope] * len(mine), [lengths[i] for i in mine], batch_size)
            assert [b for b in batches if scopes[b[0]] == scope] == [[mine[i] for i in b] for b in alone]

    check()


@pytest.mark.slow
def test_killed_rollout_leaves_no_finished_output(tmp_path) -> None:
    script = f"""
import time
from dataclasses import fields
from schemas.config import config_from_dict
from schemas.rundir import create_run
from stages.envs import registry
from stages.rollout import run_rollout
registry.ENVIRONMENTS["corridor"] = "tests.helpers.rollout_fakes:make_corridor"
config = config_from_dict({{"env": {{"name": "corridor", "max_turns": 40, "train_tasks": 4}},
    "model": {{"tiny_hidden": 32, "tiny_layers": 1, "tiny_heads": 2}},
    "rollout": {{"groups": 4, "group_size": 4, "batch_size": 2}}}})
run = create_run({str(tmp_path / "run")!r}, config)
from stages.warmstart.initial import ensure_initial_model
ensure_initial_model(run, config)
def hook(turn, done, total):
    print("turn", turn, flush=True)
    time.sleep(0.05)
run_rollout(run, 0, config, progress=hook)
print("finished", flush=True)
"""
    proc = subprocess.Popen(
        [sys.executable, "-c", script],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    seen = ""
    try:
        deadline = time.time() + 120
        for line in proc.stdout:  # type: ignore[union-attr]
            seen = line
            if line.startswith("turn 2") or time.time() > deadline:
                break
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    assert seen.startswith("turn 2")  # killed mid-rollout, not before or after
    iter_dir = tmp_path / "run" / "iter_0000"
    finished = [p.name for p in iter_dir.glob("*.parquet")] if iter_dir.exists() else []
    assert finished == []
    assert not (tmp_path / "run" / "model").exists() or (tmp_path / "run" / "model" / "config.json").is_file()


def test_rollout_cli_without_a_run(tmp_path, runner) -> None:
    out = tmp_path / "out"
    args = [
        "rollout",
        "--out",
        str(out),
        "--no-progress",
        "--set",
        "env.max_turns=2",
        "--set",
        "rollout.groups=2",
        "--set",
        "rollout.group_size=2",
        "--set",
        "model.tiny_hidden=32",
        "--set",
        "model.tiny_layers=1",
        "--set",
        "model.tiny_heads=2",
    ]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    steps = read_table(out / "steps.parquet", "steps")
    validate_steps(steps)
    assert steps["traj_id"].n_unique() == 4 and (out / "metrics_rollout.parquet").is_file()
    bad = runner.invoke(app, ["rollout", "--out", str(out), "--shard", "3/2"])
    assert bad.exit_code == 2 and "shard" in bad.output
    bad = runner.invoke(app, ["rollout", "--out", str(out), "--iter", "-1"])
    assert bad.exit_code == 2 and "--iter must be >= 0" in bad.output


def test_rollout_cli_on_a_run_with_shards(tmp_path, runner, corridor_registered) -> None:
    config = _config()
    run = create_run(tmp_path / "run", config)
    base = ["rollout", "--run", str(run.root), "--iter", "0", "--no-progress"]
    positional = ["rollout", str(run.root), "--iter", "0", "--no-progress"]  # `graft rollout RUN` form
    assert runner.invoke(app, [*positional, "--shard", "0/2"]).exit_code == 0
    waiting = runner.invoke(app, [*base, "--merge", "2"])
    assert waiting.exit_code == 2 and "not all 2" in waiting.output
    done = runner.invoke(app, [*base, "--shard", "1/2"])
    assert done.exit_code == 0 and done.output.strip().endswith("steps.parquet")
    assert run.stage_complete("rollout", 0) and run.read(0, "steps")["group_id"].n_unique() == 4
    assert runner.invoke(app, [*base, "--merge", "2"]).exit_code == 0  # already merged: nothing to wait for


def test_a_task_that_cannot_reset_is_counted_and_skipped(engine) -> None:
    class BrokenReset(CorridorEnv):
        def new_game(self):
            game = super().new_game()
            reset = game.reset

            def broken(task):
                if task.task_id == "train-1":
                    raise ValueError("bad layout")
                return reset(task)

            game.reset = broken
            return game

    stats: dict[str, float] = {}
    steps = _collect(engine, BrokenReset(), tasks=3, group_size=2, stats=stats)
    validate_steps(steps)
    assert set(steps["task_id"]) == {"train-0", "train-2"} and stats["env_errors"] == 2
    with pytest.raises(GraftError, match="reset failed: ValueError: bad layout"):
        _collect(engine, BrokenReset(), tasks=3, group_size=2, max_env_errors=1)


def test_prefix_cache_hits_are_counted_only_for_engines_that_report_them(engine) -> None:
    # an engine with a prefix cache (vLLM) keeps running totals over its life; a rollout reports the
    # hits of its own calls: the difference, not the total
    class CountingEngine:
        def __init__(self, inner) -> None:
            self.inner, self.cached_prompt_tokens, self.calls = inner, 1000, []

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def score_choices(self, prompts_ids, choices_ids):
            self.calls.append(sum(len(p) for p in prompts_ids))
            self.cached_prompt_tokens += self.calls[-1] // 2
            return self.inner.score_choices(prompts_ids, choices_ids)

    counting = CountingEngine(engine)
    stats: dict[str, float] = {}
    _collect(counting, tasks=2, group_size=2, stats=stats)
    assert counting.calls and stats["prompt_tokens_cached"] == sum(n // 2 for n in counting.calls)
    plain: dict[str, float] = {}
    _collect(engine, tasks=2, group_size=2, stats=plain)
    assert "prompt_tokens_cached" not in plain and plain["policy_calls"] > 0


def test_chat_models_get_the_chat_template(model_dir) -> None:
    chat_engine = build_engine("hf", model_dir, "initial", EngineOptions(prompt_format="chat"))
    steps = _collect(chat_engine, tasks=1, group_size=1, max_env_errors=0)
    tok = chat_engine.tokenizer
    for row in steps.iter_rows(named=True):
        assert row["prompt"].startswith("<|im_start|>user\nYour task is to:")
        assert row["prompt"].endswith("<|im_end|>\n<|im_start|>assistant\n<action>")
        assert row["prompt_ids"] == tok(row["prompt"], add_special_tokens=False)["input_ids"]
        np.testing.assert_allclose(
            row["response_logprobs"],
            _fresh_logprobs(chat_engine.model, row["prompt_ids"], row["response_ids"]),
            atol=1e-4,
        )


def test_environment_exceptions_outside_step_are_errors_not_tracebacks(engine) -> None:
    """Bad data from the environment outside ``step()`` (its task list, its failure outcome, a
    transition's numbers) truncates the episode with the error recorded, or is one GraftError."""
    from stages.envs.base import environment_tasks

    class BadTasks(CorridorEnv):
        def tasks(self, split, count, seed):
            raise KeyError("goal")

    with pytest.raises(
        GraftError, match=r"environment 'corridor': cannot list 3 train tasks \(KeyError: 'goal'\)"
    ):
        environment_tasks(BadTasks(), "train", 3, 0)

    class BadOutcome(CorridorEnv):
        def failure_outcome(self, score):
            raise ZeroDivisionError("score table is empty")

    steps = _collect(engine, BadOutcome(max_turns=2), tasks=1, group_size=2, seed=3)
    validate_steps(steps)
    last = steps.filter(pl.col("done") & (pl.col("outcome") != 10.0))
    assert last.height >= 1
    assert (last["error"] == "failure_outcome: ZeroDivisionError: score table is empty").all()
    assert last["truncated"].all() and (last["outcome"] == 0.0).all()

    class BadReward(CorridorEnv):
        def new_game(self):
            game = super().new_game()
            step = game.step

            def nan_reward(action):
                result = step(action)
                result.reward = float("nan")
                return result

            game.step = nan_reward
            return game

    steps = _collect(engine, BadReward(max_turns=3), tasks=1, group_size=2, seed=3)
    validate_steps(steps)
    errors = steps.filter(pl.col("error").is_not_null())
    assert errors.height >= 1 and errors["truncated"].all() and errors["reward"].is_finite().all()
    assert errors["error"][0] == "ValueError: transition reward = nan is not a finite number"


def test_an_over_budget_prompt_drops_its_oldest_history_first(engine) -> None:
    # prompts over max_prompt_tokens were cut from the left, dropping the header
    # and the task; now the oldest history goes first and the prompt keeps its beginning
    import unittest.mock as mock

    from stages.play import collect

    renders = []
    real = collect._Renderer._render

    def spy(self, slot, history_length):  # type: ignore[no-untyped-def]
        renders.append(history_length)
        return real(self, slot, history_length)

    full = _collect(engine, CorridorEnv(), tasks=1, group_size=1)
    lengths = [len(p) for p in full["prompt_ids"].to_list()]
    budget = (max(lengths) + min(lengths)) // 2
    with mock.patch.object(collect._Renderer, "_render", spy):
        cut = _collect(engine, CorridorEnv(), tasks=1, group_size=1, max_prompt_tokens=budget)
    assert max(len(p) for p in cut["prompt_ids"].to_list()) <= budget
    assert cut["prompt"].str.starts_with("Your task is to:").all()  # the beginning is kept
    assert min(renders) < 2  # some turn was rendered again with less history than the 2 configured
