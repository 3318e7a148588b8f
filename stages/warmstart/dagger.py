"""DAgger rounds of the warm start (Ross, Gordon & Bagnell, 2011, "A Reduction of Imitation Learning
and Structured Prediction to No-Regret Online Learning"): the clone plays, the expert labels.

Behaviour cloning only ever trains on the states the demos visit; a clone that errs reaches states no
demo shows and errs again there (compounding error). Measured on ``configs/household_long.toml``: the
DART-noised warm start wrote another inadmissible action after 71% of its invalid turns against 29%
after a valid one (docs/results/learning-household.md "Warm-start measurements for v2"); DAgger lowered
the invalid rate by about a third (same file, "Warm-start measurements for v3"). A DAgger round
closes that gap:

    D_0 = demos;  π_0 = BC(D_0)
    round r = 1..R:  τ ~ π_{r-1} (generate mode, rollout temperature);
                     D_r = D_{r-1} ∪ {(x_t, y*(s_t)) : t ∈ τ};  π_r = π_{r-1} trained on D_r

x_t is the prompt of turn t exactly as the demos render it, y*(s_t) the expert's answer at the
state s_t the clone reached (``stages.warmstart.demos.demo_response``), also at a state the clone reached by an
invalid turn (the world did not advance, so the label is the expert's action there). The label is the
expert's, never the clone's: kept noise (``sft.keep_noise``) shapes only the demos.

The clone's rollouts are replayed from their task to recover each turn's game state (environments are
deterministic given the actions; a replayed state that differs from the recorded one is an error, not
a silent mislabel).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import polars as pl

from schemas.config import Config
from schemas.errors import GraftError
from stages.envs.base import Environment, Episode, Task
from stages.envs.prompts import episode_prompt
from stages.play.collect import collect_episodes
from stages.play.settings import PlaySettings
from stages.policy.engine import PolicyEngine
from stages.policy.sampling import derive_rng, derive_seed
from stages.warmstart.demos import DEMO_COLUMNS, demo_response, turn_think

DAGGER_VERSION = "dagger"


def expert_relabel(
    env: Environment,
    tasks: Sequence[Task],
    steps: pl.DataFrame,
    *,
    history_length: int,
    prompt_fn: Callable[..., str] | None = None,
    think: str = "verb",
    keep_valid: float = 0.0,
    rng: np.random.Generator | None = None,
) -> pl.DataFrame:
    """``steps`` (a rollout of ``tasks``) with every turn's ``prompt`` re-rendered as the demos render
    it and its ``response`` replaced by the expert's answer at that turn's state (the demos' columns,
    ``policy_version`` = "dagger"). Turns where the expert has no action are dropped.

    ``keep_valid``: probability that a *valid* turn keeps the clone's own action as its label (one
    draw of ``rng`` per valid turn, none at 0), so the rounds correct invalid turns without making
    every valid one the expert's (``sft.dagger_keep``, docs/warmstart.md)."""
    if not 0.0 <= keep_valid <= 1.0:
        raise GraftError(f"dagger: keep_valid must be in [0, 1], got {keep_valid}")
    if keep_valid and rng is None:
        raise GraftError("dagger: keep_valid needs a random generator")
    by_id = {t.task_id: t for t in tasks}
    style = env.prompt_style
    relabelled: list[dict[str, Any]] = []
    for (traj_id,), turns in steps.sort("traj_id", "step").group_by("traj_id", maintain_order=True):
        first = turns.row(0, named=True)
        task = by_id.get(first["task_id"])
        if task is None:
            raise GraftError(
                f"dagger: trajectory {traj_id} plays task {first['task_id']}, not in the task set"
            )
        episode = Episode(env, task)
        for row in turns.iter_rows(named=True):
            if episode.done:
                raise GraftError(f"dagger: trajectory {traj_id} has turns after its episode ended on replay")
            prompt = episode_prompt(style, episode, history_length, prompt_fn)
            expert = episode.game.expert_action()
            label = expert
            if expert is not None and keep_valid and row["valid"] and rng.random() < keep_valid:
                label = row["action"]
            thought = (
                turn_think(think, episode.game, style, label, episode.current.task_text)
                if label is not None
                else None
            )
            record = episode.act(row["action"])
            if record.state != row["state"]:
                raise GraftError(
                    f"dagger: replaying trajectory {traj_id} reached another state at step {row['step']} "
                    f"(the {env.name} environment is not deterministic given the actions)"
                )
            if expert is None:
                continue
            relabelled.append(
                {
                    **{name: row[name] for name in DEMO_COLUMNS},
                    "prompt": prompt,
                    "response": demo_response(style, label, thought),
                    "policy_version": DAGGER_VERSION,
                }
            )
    schema = {name: steps.schema[name] for name in DEMO_COLUMNS}
    return pl.DataFrame(relabelled, schema=schema)


def dagger_settings(config: Config) -> PlaySettings:
    """How the clone plays a DAgger round: generate mode at the rollout's temperature, history, batch
    size, token limits and prompt layout; as before the settings object, every turn in one batch
    scope, no limit on environment errors and the graft action-parsing rule, whatever
    ``rollout.batch_scope``, ``rollout.max_env_errors`` and ``env.action_parsing`` say."""
    return PlaySettings.from_config(
        config, mode="generate", batch_scope="all", max_env_errors=None, action_parsing="graft"
    )


def dagger_round(
    engine: PolicyEngine,
    env: Environment,
    tasks: Sequence[Task],
    episodes: int,
    settings: PlaySettings,
    *,
    round_index: int,
    seed: int,
    think: str = "verb",
    keep_valid: float = 0.0,
) -> tuple[pl.DataFrame, pl.DataFrame]:
    """The clone in ``engine`` plays ``episodes`` episodes round-robin over ``tasks`` with ``settings``
    (``dagger_settings``; random streams ``(seed, "dagger", round_index)``); return (its steps, their
    expert relabelling, rendered with the settings' history and prompt function)."""
    if episodes < 1:
        raise GraftError(f"dagger: episodes must be >= 1, got {episodes}")
    played = [tasks[k % len(tasks)] for k in range(episodes)]
    steps = collect_episodes(
        engine,
        env,
        played,
        1,
        settings,
        seed=derive_seed(seed, "dagger", round_index),
        iteration=0,
        policy_version=f"{DAGGER_VERSION}-r{round_index}",
    )
    relabelled = expert_relabel(
        env,
        tasks,
        steps,
        history_length=settings.history_length,
        think=think,
        keep_valid=keep_valid,
        rng=derive_rng(seed, "dagger", round_index, "keep"),
        prompt_fn=settings.prompt_fn,
    )
    return steps, relabelled
