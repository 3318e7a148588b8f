"""Warm start (docs/design.md §6): expert demos (`graft demos`) and behaviour cloning (`graft sft`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import polars as pl
import pytest
import torch
from typer.testing import CliRunner

from graft_cli.app import app
from schemas import read_table, validate_steps
from schemas.config import load_config
from schemas.errors import GraftError
from schemas.rundir import create_run, open_run
from stages.envs.parser import parse_response
from stages.envs.registry import make_env
from stages.update.batching import minibatch_schedule
from stages.warmstart.demos import demo_summary, expert_demos, inadmissible_action
from stages.warmstart.sft import (
    Example,
    collate,
    lr_factor,
    response_loss,
    sft_examples,
    train_sft,
)
from tests.helpers.warmstart_cases import TINY_SFT, situation_from_state

HOUSEHOLD = {"shuffle": True, "receptacles": 6, "distractors": 2, "objects_per_type": 2, "info_actions": True}

# a small warm start that a tiny model learns in seconds: one fixed room, one task type, no history


def household(**options):
    return make_env("household", max_turns=30, invalid_penalty=-0.1, **{**HOUSEHOLD, **options})


# ---------------------------------------------------------------------------------------------
# demos


def replay(env, tasks, demos):
    """Replay every demo trajectory from its task: yield (row, the expert's action there, the
    observation before the row's action), then execute the row's action; returns nothing."""
    from stages.envs.base import Episode

    by_id = {t.task_id: t for t in tasks}
    for _, traj in demos.group_by("traj_id", maintain_order=True):
        episode = Episode(env, by_id[traj["task_id"][0]])
        for row in traj.iter_rows(named=True):
            before = episode.current
            yield row, episode.game.expert_action(), before
            record = episode.act(row["action"])
            assert record.valid == row["valid"]


def test_noise_free_demos_are_valid_steps_the_expert_wins_and_the_format_parses_back() -> None:
    env = household()
    tasks = env.tasks("train", 6, 0)
    demos = expert_demos(env, tasks, 12, seed=0)
    validate_steps(demos)  # the steps contract (contiguous steps, one done row, next_state chain, ...)
    summary = demo_summary(demos, env.success_outcome)
    assert summary == {
        "episodes": 12.0,
        "success_rate": 1.0,
        "mean_turns": pytest.approx(summary["mean_turns"]),
    }
    # one group per task, two trajectories each (round-robin), all rows valid
    assert demos["group_id"].n_unique() == 6 and demos["traj_id"].n_unique() == 12
    assert demos["valid"].all() and (demos["policy_version"] == "expert").all()
    for response, action in zip(demos["response"], demos["action"], strict=True):
        assert parse_response("alfworld", response) == action
        assert response.startswith("<think>") and response.endswith("</action>")


def test_demo_prompts_are_the_rollouts_prompts() -> None:
    from stages.envs.base import Episode
    from stages.envs.prompts import build_prompt

    env = household()
    task = env.tasks("train", 1, 3)[0]
    demos = expert_demos(env, [task], 1, seed=0, history_length=2)
    episode = Episode(env, task)
    for row in demos.iter_rows(named=True):
        obs = episode.current
        expected = build_prompt(
            "alfworld",
            task_text=obs.task_text,
            observation=obs.text,
            admissible=list(obs.admissible),
            history=list(episode.history),
            step_count=episode.turn,
            history_length=2,
        )
        assert row["prompt"] == expected
        episode.act(row["action"])


def test_noise_replaces_expert_actions_at_its_rate_and_is_deterministic() -> None:
    env = household()
    tasks = env.tasks("train", 8, 0)
    a = expert_demos(env, tasks, 32, noise=0.4, seed=5)
    assert a.equals(expert_demos(env, tasks, 32, noise=0.4, seed=5))
    assert not a.equals(expert_demos(env, tasks, 32, noise=0.4, seed=6))
    validate_steps(a)
    # replay every trajectory and count the turns whose action differs from the expert's choice there
    differs = turns = 0
    for row, expert, _ in replay(env, tasks, a):
        # DART: the label is the expert's answer at the visited state, whatever was executed
        assert parse_response("alfworld", row["response"]) == expert
        differs += row["action"] != expert
        turns += 1
    # P(differ) = 0.4 * (1 - 1/|admissible|) ~ 0.35; a random pick can equal the expert's action
    assert 0.2 < differs / turns < 0.45
    noisy = demo_summary(a, env.success_outcome)
    clean = demo_summary(expert_demos(env, tasks, 32, seed=5), env.success_outcome)
    assert noisy["mean_turns"] > clean["mean_turns"]
    assert (a["policy_version"] == "expert+noise0.4").all()


def test_invalid_noise_executes_earlier_admissible_actions_that_leave_the_world_and_keep_the_expert_label() -> (
    None
):
    env = household()
    tasks = env.tasks("train", 8, 0)
    a = expert_demos(env, tasks, 32, noise=0.3, invalid_noise=0.5, seed=3)
    assert a.equals(expert_demos(env, tasks, 32, noise=0.3, invalid_noise=0.5, seed=3))
    validate_steps(a)
    assert (a["policy_version"] == "expert+noise0.3+invalid0.5").all()
    invalid = turns = 0
    earlier: set[str] = set()
    for row, expert, before in replay(env, tasks, a):
        if row["step"] == 0:
            earlier = set()
        assert parse_response("alfworld", row["response"]) == expert
        if not row["valid"]:
            invalid += 1
            # the learner's kind of mistake: admissible at an earlier turn, not now
            assert row["action"] in earlier and row["action"] not in before.admissible
            assert row["reward"] == pytest.approx(-0.1) and row["next_state"] == row["state"]
        earlier |= set(before.admissible)
        turns += 1
    # P(invalid) = (1 - 0.3) * 0.5 on turns after the first that have an earlier action not admissible now
    assert 0.2 < invalid / turns < 0.4
    # the default draws nothing extra: the same stream as before invalid noise existed
    assert expert_demos(env, tasks, 8, noise=0.3, seed=3).equals(
        expert_demos(env, tasks, 8, noise=0.3, invalid_noise=0.0, seed=3)
    )
    assert (~expert_demos(env, tasks, 8, noise=0.3, seed=3)["valid"]).sum() == 0


def test_keep_noise_labels_a_share_of_random_turns_with_their_own_action() -> None:
    env = household()
    tasks = env.tasks("train", 8, 0)
    dart = expert_demos(env, tasks, 24, noise=0.5, seed=4)
    kept = expert_demos(env, tasks, 24, noise=0.5, keep_noise=0.5, seed=4)
    assert (kept["policy_version"] == "expert+noise0.5+kept0.5").all()
    validate_steps(kept)
    random_turns = own_label = 0
    for row, expert, _ in replay(env, tasks, kept):
        action, label = row["action"], parse_response("alfworld", row["response"])
        assert label in (expert, action)  # DART's expert answer, or the executed action kept
        if action != expert:
            random_turns += 1
            own_label += label == action
    assert 0.35 < own_label / random_turns < 0.65
    # the same random turns as DART's stream until the first kept draw: the first episode starts alike
    assert dart["action"][0] == kept["action"][0]
    assert (~kept["valid"]).sum() == 0


def test_inadmissible_action_draws_only_actions_not_admissible_now() -> None:
    rng = np.random.default_rng(0)
    earlier = ["go to a", "go to b", "take x from a"]
    draws = {inadmissible_action(earlier, ["go to a", "look"], rng) for _ in range(50)}
    assert draws == {"go to b", "take x from a"}
    assert inadmissible_action(earlier, earlier, rng) is None
    assert inadmissible_action([], ["look"], rng) is None


@pytest.mark.parametrize("name", ["shop", "search"])
def test_demos_of_other_environments_validate_and_parse_back(name: str) -> None:
    env = make_env(name)
    demos = expert_demos(env, env.tasks("train", 4, 0), 4, noise=0.2, seed=0)
    validate_steps(demos)
    style = env.prompt_style
    clean = expert_demos(env, env.tasks("train", 4, 0), 4, seed=0)
    validate_steps(clean)
    for response, action in zip(clean["response"], clean["action"], strict=True):
        assert parse_response(style, response) == action


def test_demos_refuse_bad_arguments() -> None:
    env = household()
    tasks = env.tasks("train", 2, 0)
    with pytest.raises(GraftError, match="noise must be in"):
        expert_demos(env, tasks, 2, noise=1.5)
    with pytest.raises(GraftError, match="invalid_noise must be in"):
        expert_demos(env, tasks, 2, invalid_noise=-0.1)
    with pytest.raises(GraftError, match="episodes must be >= 1"):
        expert_demos(env, tasks, 0)
    with pytest.raises(GraftError, match="task list is empty"):
        expert_demos(env, [], 2)


def test_graft_demos_writes_steps_that_graft_advantage_accepts(tmp_path: Path) -> None:
    runner = CliRunner()
    out = tmp_path / "demos"
    args = ["demos", "household", "-o", str(out), "--episodes", "16", "--noise", "0.3", "--seed", "2"]
    args += ["--invalid-noise", "0.2", "--keep-noise", "0.5"]
    result = runner.invoke(app, [*args, "--set", "env.max_turns=20", "--set", "env.train_tasks=4"])
    assert result.exit_code == 0, result.output
    assert "16 episodes" in result.output
    steps = read_table(out / "steps.parquet", "steps")
    validate_steps(steps)
    assert (steps["policy_version"] == "expert+noise0.3+invalid0.2+kept0.5").all()
    assert (~steps["valid"]).any()  # invalid-turn noise reached the table
    assert steps["group_id"].n_unique() == 4 and steps["traj_id"].n_unique() == 16
    credit = tmp_path / "credit"
    result = runner.invoke(app, ["advantage", str(out / "steps.parquet"), "-o", str(credit)])
    assert result.exit_code == 0, result.output
    advantages = read_table(credit / "advantages.parquet", "advantages")
    assert advantages.height == steps.height and advantages["advantage"].is_finite().all()
    bad = runner.invoke(app, ["demos", "household", "-o", str(out), "--split", "test"])
    assert bad.exit_code == 2 and "--split" in bad.output


# ---------------------------------------------------------------------------------------------
# behaviour cloning


def _tiny_model_and_tokenizer(tmp_path: Path):
    from stages.policy.tiny import TinySpec, build_tiny_model
    from stages.update.checkpoint import load_model, load_tokenizer

    env = household(shuffle=False, receptacles=3, distractors=0, info_actions=False)
    path = build_tiny_model(tmp_path / "m", env, spec=TinySpec(hidden=32, heads=2), tasks_per_split=8)
    return env, load_model(path), load_tokenizer(path)


def test_response_loss_is_the_mean_negative_log_likelihood_of_response_tokens_only(tmp_path: Path) -> None:
    _, model, tokenizer = _tiny_model_and_tokenizer(tmp_path)
    examples = [Example([5, 6, 7, 8], [9, 10]), Example([11, 12], [13, 14, 15])]
    batch = collate(examples, tokenizer.pad_token_id)
    with torch.no_grad():
        loss = float(response_loss(model, batch))
        # reference: each example alone, unpadded; sum of -log p over its response tokens
        total, count = 0.0, 0
        for e in examples:
            ids = torch.tensor([e.prompt_ids + e.response_ids])
            logp = torch.log_softmax(model(input_ids=ids).logits[0].double(), dim=-1)
            for j, token in enumerate(e.response_ids):
                total -= float(logp[len(e.prompt_ids) + j - 1, token])
                count += 1
    assert loss == pytest.approx(total / count, rel=1e-5)


def test_a_few_sft_steps_lower_the_response_loss(tmp_path: Path) -> None:
    env, model, tokenizer = _tiny_model_and_tokenizer(tmp_path)
    demos = expert_demos(env, env.tasks("train", 4, 0), 8, seed=0, history_length=0)
    examples, cut = sft_examples(demos, tokenizer, chat=False, max_prompt_tokens=1024)
    assert cut == 0 and len(examples) == demos.height
    batch = collate(examples, tokenizer.pad_token_id)
    with torch.no_grad():
        before = float(response_loss(model, batch))
    losses = train_sft(
        model, examples, tokenizer.pad_token_id, lr=1e-2, epochs=3, batch_size=8, rng=np.random.default_rng(0)
    )
    with torch.no_grad():
        after = float(response_loss(model, batch))
    assert len(losses) == 3 * -(-len(examples) // 8)
    assert after < 0.8 * before


def test_choose_mode_examples_clone_the_action_after_the_action_tag(tmp_path: Path) -> None:
    """In choose mode the rollout scores each admissible action's tokens after the prompt and
    ``<action>``; the warm start's examples are that input and the demo's action alone."""
    env, _, tokenizer = _tiny_model_and_tokenizer(tmp_path)
    demos = expert_demos(env, env.tasks("train", 3, 0), 4, seed=0, history_length=0)
    examples, cut = sft_examples(
        demos, tokenizer, chat=False, max_prompt_tokens=1024, choose_style="alfworld"
    )
    assert cut == 0 and len(examples) == demos.height
    for example, prompt, action in zip(examples, demos["prompt"], demos["action"], strict=True):
        assert example.prompt_ids == tokenizer(prompt + "<action>")["input_ids"]  # the choose-mode input
        assert example.response_ids == tokenizer(action, add_special_tokens=False)["input_ids"]  # no think
    generate, _ = sft_examples(demos, tokenizer, chat=False, max_prompt_tokens=1024)
    assert all(len(g.response_ids) > len(c.response_ids) for g, c in zip(generate, examples, strict=True))
    with pytest.raises(GraftError, match="row 1 has no action to clone"):
        broken = demos.with_row_index().with_columns(
            response=pl.when(pl.col("index") == 1)
            .then(pl.lit("<think>x</think>"))
            .otherwise(pl.col("response"))
        )
        sft_examples(broken.drop("index"), tokenizer, False, 1024, choose_style="alfworld")


def test_choose_mode_sft_raises_the_likelihood_of_the_demo_actions(tmp_path: Path) -> None:
    env, model, tokenizer = _tiny_model_and_tokenizer(tmp_path)
    demos = expert_demos(env, env.tasks("train", 4, 0), 8, seed=0, history_length=0)
    examples, _ = sft_examples(demos, tokenizer, chat=False, max_prompt_tokens=1024, choose_style="alfworld")
    batch = collate(examples, tokenizer.pad_token_id)
    with torch.no_grad():
        before = float(response_loss(model, batch))
    train_sft(
        model, examples, tokenizer.pad_token_id, lr=1e-2, epochs=3, batch_size=8, rng=np.random.default_rng(0)
    )
    with torch.no_grad():
        after = float(response_loss(model, batch))
    assert after < 0.8 * before


def test_lr_factor_warms_up_linearly_then_follows_the_half_cosine() -> None:
    # constant: 1 after the warm-up, whose step s trains at (s + 1) / warmup
    assert [lr_factor(s, 10, "constant", 4) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    # cosine over 10 steps, no warm-up: 0.5 (1 + cos(pi s / 10))
    assert lr_factor(0, 10, "cosine", 0) == 1.0
    assert lr_factor(5, 10, "cosine", 0) == pytest.approx(0.5)
    assert lr_factor(9, 10, "cosine", 0) == pytest.approx(0.5 * (1 + np.cos(0.9 * np.pi)))
    # cosine after a 2-step warm-up spans the 8 steps left
    assert lr_factor(1, 10, "cosine", 2) == 1.0
    assert lr_factor(2, 10, "cosine", 2) == 1.0
    assert lr_factor(6, 10, "cosine", 2) == pytest.approx(0.5)
    factors = [lr_factor(s, 50, "cosine", 5) for s in range(50)]
    assert all(a >= b for a, b in zip(factors[5:-1], factors[6:], strict=True)) and 0 < factors[-1] < 0.01
    with pytest.raises(GraftError, match="schedule"):
        lr_factor(0, 10, "linear", 0)


def test_train_sft_steps_at_the_scheduled_learning_rates(tmp_path: Path) -> None:
    # the learning rate each optimizer step actually used, recorded as AdamW steps
    env, model, tokenizer = _tiny_model_and_tokenizer(tmp_path)
    demos = expert_demos(env, env.tasks("train", 2, 0), 2, seed=0, history_length=0)
    examples, _ = sft_examples(demos, tokenizer, chat=False, max_prompt_tokens=1024)
    seen: list[float] = []
    original = torch.optim.AdamW.step

    def recording_step(self, *args, **kwargs):
        seen.append(self.param_groups[0]["lr"])
        return original(self, *args, **kwargs)

    torch.optim.AdamW.step = recording_step  # type: ignore[method-assign]
    try:
        losses = train_sft(
            model,
            examples,
            tokenizer.pad_token_id,
            lr=1e-2,
            epochs=2,
            batch_size=max(1, len(examples) // 3),
            rng=np.random.default_rng(0),
            lr_schedule="cosine",
            warmup_steps=2,
        )
    finally:
        torch.optim.AdamW.step = original  # type: ignore[method-assign]
    assert len(seen) == len(losses)
    assert seen == pytest.approx([1e-2 * lr_factor(s, len(losses), "cosine", 2) for s in range(len(losses))])


def test_the_warm_starts_minibatches_cover_every_row_once_per_epoch() -> None:
    batches = minibatch_schedule(10, 4, 3, np.random.default_rng(1))  # what train_sft steps through
    assert [len(b) for b in batches] == [4, 4, 2] * 3
    for epoch in range(3):
        assert sorted(np.concatenate(batches[3 * epoch : 3 * epoch + 3]).tolist()) == list(range(10))


def test_sft_config_is_validated() -> None:
    for key, value, message in [
        ("sft.episodes", "0", "sft.episodes"),
        ("sft.noise", "1.5", "sft.noise"),
        ("sft.invalid_noise", "-0.5", "sft.invalid_noise"),
        ("sft.epochs", "0", "sft.epochs"),
        ("sft.lr", "inf", "sft.lr"),
        ("sft.split", '"test"', "sft.split"),
        ("sft.lr_schedule", '"linear"', "sft.lr_schedule"),
        ("sft.warmup_steps", "-1", "sft.warmup_steps"),
    ]:
        with pytest.raises(GraftError, match=message):
            load_config(None, [f"{key}={value}"])


@pytest.fixture(scope="module")
def warm_run(tmp_path_factory) -> Path:
    """A run whose warm start has finished (shared by the tests below)."""
    from stages.warmstart.initial import ensure_initial_model

    torch.set_num_threads(1)
    config = load_config(None, TINY_SFT)
    run = create_run(tmp_path_factory.mktemp("warm") / "run", config)
    ensure_initial_model(run, config)
    return run.root


@pytest.mark.slow
def test_after_a_short_warm_start_generate_mode_writes_valid_actions(warm_run: Path) -> None:
    from stages.rollout.runner import rollout_iteration

    run = open_run(warm_run)
    # T = 0.4 (the paper's evaluation temperature): greedy decoding repeats an invalid action forever
    # (the world does not advance), T = 1 samples too freely from a model this small
    config = run.load_config(["rollout.temperature=0.4"])
    assert run.initial_policy_dir(config) == run.sft_model_dir
    losses = read_table(run.sft_dir / "update.parquet", "update")
    assert losses["value"][-1] < 0.25 * losses["value"][0]
    warm, _ = rollout_iteration(config, 0, run.sft_model_dir, "initial", progress=False)
    cold, _ = rollout_iteration(config, 0, run.base_model_dir(config), "initial", progress=False)
    assert cold["valid"].mean() < 0.05  # the random model writes nothing parseable
    assert warm["valid"].mean() > 0.4
    again, _ = rollout_iteration(config, 0, run.sft_model_dir, "initial", progress=False)
    assert again.equals(warm)


@pytest.mark.slow
def test_a_choose_mode_warm_start_clones_the_choice_the_rollout_makes(tmp_path: Path) -> None:
    """With ``rollout.mode = "choose"`` the warm start trains on choose mode's input (prompt +
    ``<action>``) and the action alone: on its demos, the actions after the action tag are far more
    likely under it than under the generate-mode warm start of the same demos (which learned them
    after a ``<think>`` text choose mode never shows)."""
    from stages.update.checkpoint import load_model, load_tokenizer
    from stages.warmstart.initial import ensure_initial_model

    torch.set_num_threads(1)
    losses = {}
    for mode in ("choose", "generate"):
        config = load_config(None, [*TINY_SFT, f"rollout.mode={mode}"])
        run = create_run(tmp_path / mode, config)
        ensure_initial_model(run, config)
        demos = read_table(run.demos_path, "steps")
        tokenizer = load_tokenizer(run.sft_model_dir)
        examples, _ = sft_examples(demos, tokenizer, False, 1024, choose_style="alfworld")
        with torch.no_grad():
            losses[mode] = float(
                response_loss(load_model(run.sft_model_dir), collate(examples, tokenizer.pad_token_id))
            )
    assert losses["choose"] < 0.5 * losses["generate"], losses


@pytest.mark.slow
def test_the_warm_start_is_the_initial_policy_and_kl_reference(warm_run: Path) -> None:
    from schemas.initial_model import acting_policy, verified_initial_policy
    from stages.evaluate import evaluated_policy

    run = open_run(warm_run)
    config = run.load_config()
    assert acting_policy(run, 0, config, "rollout") == (run.sft_model_dir, "initial")
    assert verified_initial_policy(run, config) == run.sft_model_dir
    assert evaluated_policy(run, -1, config) == run.sft_model_dir
    plain = run.load_config(["sft.enabled=false"])
    assert verified_initial_policy(run, plain) == run.initial_model_dir


def _killed_sft(run_dir: str) -> None:  # runs in a forkserver child
    import os

    from stages.loop import run_loop
    from stages.warmstart.initial import ensure_initial_model
    from tests.helpers.kill_at import killing

    config = load_config(None, TINY_SFT)
    # the loop's warm start is killed when its finished checkpoint is about to be renamed into place
    prepare = killing(ensure_initial_model, match="sft/model")
    run_loop(create_run(run_dir, config), config, 1, prepare=prepare)
    os._exit(0)


@pytest.mark.slow
def test_a_loop_killed_in_its_warm_start_resumes_to_identical_weights(warm_run: Path, tmp_path: Path) -> None:
    import multiprocessing
    import signal

    from safetensors.torch import load_file

    run_dir = tmp_path / "killed"
    ctx = multiprocessing.get_context("forkserver")
    child = ctx.Process(target=_killed_sft, args=(str(run_dir),))
    child.start()
    child.join(300)
    assert child.exitcode == -signal.SIGKILL
    run = open_run(run_dir)
    assert not (run.sft_model_dir / "config.json").exists() and any(run.sft_dir.glob(".*.tmp"))
    result = CliRunner().invoke(app, ["sft", str(run_dir)])
    assert result.exit_code == 0, result.output
    assert "loss" in result.output
    want = load_file(str(open_run(warm_run).sft_model_dir / "model.safetensors"))
    got = load_file(str(run.sft_model_dir / "model.safetensors"))
    assert sorted(want) == sorted(got)
    for key in want:
        assert torch.equal(want[key], got[key]), key
    assert read_table(run.demos_path, "steps").equals(read_table(open_run(warm_run).demos_path, "steps"))


def test_graft_sft_refuses_a_run_without_a_warm_start(tmp_path: Path) -> None:
    run = create_run(tmp_path / "r", load_config(None, ["sft.enabled=false"]))
    result = CliRunner().invoke(app, ["sft", str(run.root)])
    assert result.exit_code == 2 and "sft.enabled is false" in result.output


# ---------------------------------------------------------------------------------------------
# the situation thinking template (sft.think = "situation")


def test_the_household_situation_names_location_and_held_object() -> None:
    from stages.envs.base import Episode

    env = household(shuffle=False, receptacles=6)
    episode = Episode(env, env.tasks("train", 1, 0)[0])
    assert episode.game.situation() == "at middle carrying nothing"
    while not episode.done:
        action = episode.game.expert_action()
        episode.act(action)
        if episode.done:
            break
        assert episode.game.situation() == situation_from_state(episode.current.state_key)
        if action.startswith("go to "):
            assert episode.game.situation().startswith(f"at {action[6:]} carrying ")
        if action.startswith("take "):
            assert episode.game.situation().endswith(f"carrying {action[5:].split(' from ')[0]}")


def test_situation_demos_think_the_state_before_the_turn_and_keep_the_verb_demos_actions() -> None:
    env = household()
    tasks = env.tasks("train", 6, 0)
    options = {"noise": 0.5, "invalid_noise": 0.2, "keep_noise": 0.5, "seed": 5}
    verb = expert_demos(env, tasks, 12, **options)
    situation = expert_demos(env, tasks, 12, think="situation", **options)
    validate_steps(situation)
    # the template changes the thinking text only: same executed actions, same labels
    assert situation.select("traj_id", "step", "action", "valid", "state").equals(
        verb.select("traj_id", "step", "action", "valid", "state")
    )
    for row_s, row_v in zip(situation.iter_rows(named=True), verb.iter_rows(named=True), strict=True):
        assert parse_response("alfworld", row_s["response"]) == parse_response("alfworld", row_v["response"])
        assert row_s["response"].startswith(f"<think>{situation_from_state(row_s['state'])}</think><action>")


def test_the_situation_template_is_refused_where_the_game_has_no_situation(tmp_path: Path) -> None:
    env = make_env("search")
    with pytest.raises(GraftError, match="situation"):
        expert_demos(env, env.tasks("train", 2, 0), 2, think="situation")
    with pytest.raises(GraftError, match="plan"):
        expert_demos(env, env.tasks("train", 2, 0), 2, think="plan")
    with pytest.raises(GraftError, match="unknown think template"):
        expert_demos(household(), household().tasks("train", 2, 0), 2, think="goal")
    result = CliRunner().invoke(
        app, ["demos", "search", "-o", str(tmp_path / "d"), "--episodes", "2", "--think", "situation"]
    )
    assert result.exit_code == 2 and "situation" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "d").exists()
    # a loop start is refused before its run directory is written
    run_dir = tmp_path / "run"
    start = CliRunner().invoke(
        app,
        [
            "loop",
            "--run",
            str(run_dir),
            "--iters",
            "1",
            "--set",
            "env.name=search",
            "--set",
            "sft.enabled=true",
        ]
        + ["--set", 'sft.think="situation"'],
    )
    assert start.exit_code == 2 and "situation" in start.output
    assert not (run_dir / "config.toml").exists()


def test_the_tiny_vocabulary_has_every_situation_word(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from stages.policy.tiny import build_tiny_model
    from stages.policy.tokenizer import vocabulary_misses

    env = household(shuffle=False, receptacles=6)
    demos = expert_demos(env, env.tasks("train", 6, 0), 12, noise=0.5, think="situation", seed=1)
    path = build_tiny_model(tmp_path / "tiny", env, tasks_per_split=8, on_task=lambda *_: None)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert vocabulary_misses(tokenizer, demos["response"].to_list()) == set()


def test_demos_never_overwrite_a_steps_table_silently(tmp_path, runner):
    # `graft demos -o RUN/iter_0000` replaced a finished steps table
    from graft_cli.app import app
    from schemas.config import Config
    from schemas.rundir import create_run

    run = create_run(tmp_path / "run", Config())
    result = runner.invoke(app, ["demos", "household", "-o", str(run.iter_dir(0)), "--episodes", "2"])
    assert result.exit_code == 2 and "an iteration of run" in result.output
    assert not run.iter_dir(0).exists()
    out = tmp_path / "demos"
    assert runner.invoke(app, ["demos", "household", "-o", str(out), "--episodes", "2"]).exit_code == 0
    before = (out / "steps.parquet").read_bytes()
    again = runner.invoke(app, ["demos", "household", "-o", str(out), "--episodes", "3"])
    assert again.exit_code == 2 and "use --force" in again.output
    assert (out / "steps.parquet").read_bytes() == before
    forced = runner.invoke(app, ["demos", "household", "-o", str(out), "--episodes", "3", "--force"])
    assert forced.exit_code == 0 and (out / "steps.parquet").read_bytes() != before


def test_sft_takes_the_run_lock_and_clears_a_killed_warm_starts_temporaries(tmp_path, runner, monkeypatch):
    import graft_cli.commands.warmstart  # noqa: F401
    from graft_cli.app import app
    from schemas.config import Config
    from schemas.rundir import create_run

    config = Config()
    config.sft.enabled = True
    run = create_run(tmp_path / "run", config)
    stale = run.sft_dir / "dagger" / "round_1" / ".model.abc123.tmp"
    stale.mkdir(parents=True)
    seen = {}

    def fake_initial_model(r, c):  # what the warm start sees when it starts
        seen["stale_left"] = stale.exists()
        raise SystemExit(0)

    monkeypatch.setattr("stages.warmstart.initial.ensure_initial_model", fake_initial_model)
    runner.invoke(app, ["sft", str(run.root)])
    assert seen == {"stale_left": False}
    import subprocess
    import sys

    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys,time; from schemas.lock import run_lock\n"
            f"with run_lock({str(run.root)!r}):\n    print('held', flush=True); time.sleep(30)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        result = runner.invoke(app, ["sft", str(run.root)])
        assert result.exit_code == 2 and "lock" in result.output
    finally:
        holder.kill()


def test_micro_batches_give_the_same_step_as_one_pass(tmp_path: Path) -> None:
    # the warm start had no micro-batching; the split must not change the step
    import copy

    from stages.warmstart.sft import micro_batches

    env, model, tokenizer = _tiny_model_and_tokenizer(tmp_path)
    demos = expert_demos(env, env.tasks("train", 2, 0), 4, seed=0, history_length=0)
    examples, _ = sft_examples(demos, tokenizer, chat=False, max_prompt_tokens=1024)
    twin = copy.deepcopy(model)
    kwargs = dict(lr=1e-2, epochs=1, batch_size=len(examples), rng=np.random.default_rng(0))
    whole = train_sft(model, examples, tokenizer.pad_token_id, **kwargs)
    kwargs["rng"] = np.random.default_rng(0)
    longest = max(len(e.prompt_ids) + len(e.response_ids) for e in examples)
    split = train_sft(twin, examples, tokenizer.pad_token_id, max_tokens=2 * longest, **kwargs)
    assert len(micro_batches(examples, np.arange(len(examples)), 2 * longest)) > 1
    assert whole == pytest.approx(split, rel=1e-5)
    for (name, a), (_, b) in zip(model.named_parameters(), twin.named_parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)  # Adam: lr-sized steps


def test_the_warm_start_lr_defaults_by_the_kind_of_model() -> None:
    from schemas.config import load_config
    from stages.warmstart.sft import PRETRAINED_SFT_LR, TINY_SFT_LR, sft_lr

    assert sft_lr(load_config(None)) == TINY_SFT_LR == 3e-3
    assert sft_lr(load_config(None, ["model.path=models/smollm2"])) == PRETRAINED_SFT_LR == 5e-5
    assert sft_lr(load_config(None, ["model.path=models/smollm2", "sft.lr=1e-4"])) == 1e-4
