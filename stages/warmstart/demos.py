"""Expert demonstrations (docs/design.md §6 warm start): the scripted expert plays an environment into a steps table.

``expert_demos(env, tasks, episodes, noise=P, seed=S)`` plays ``episodes`` episodes round-robin over
``tasks``; at every turn the expert's action is replaced, with probability ``P``, by a uniformly drawn
admissible action (so demos are diverse and some fail). Each task is one group and each of its
episodes one trajectory, so the table is a valid input for the credit stages too (an off-policy
group of N rollouts). Rows carry the paper's prompt (``prompt``, the raw template text the rollout
renders for the same state) and the response in the paper's format (``response``); token columns
stay null because the demos belong to no model — ``graft sft`` tokenizes them with the policy's
tokenizer.

The response is ``<think>{think}</think><action>{action}</action>`` (search: ``<search> q
</search>`` / ``<answer> a </answer>`` instead of the action tag).

Noise as DART (Laskey et al., 2017, "DART: Noise Injection for Robust Imitation Learning"): a noisy
turn *executes* the random action, so demos visit the off-path states and late turns a learner will
reach, but its ``response`` is still the expert's answer at that state, so behaviour cloning learns
to recover rather than to act at random. So on a noisy turn ``action`` (what was executed, what the
credit stages read) differs from the action in ``response`` (the warm start's label). Measured on
``configs/household_long.toml``: cloning the executed noisy actions left generate-mode invalid rates of
0.39–0.58 and no success; noise-free demos 0.89–0.95 (the policy never saw a state off the expert's
path); see docs/results/learning-household.md "Warm-start measurements that fixed the v1 config".

``think`` is a fixed template naming the kind of step the action is (its first word, e.g. ``go``, ``take``, ``heat``; ``search`` /
``answer`` for search). Why a template and not a free-text plan: the tiny policy only has to learn
the format and a policy; every thinking token is generated and trained at every turn of every
episode, so one word keeps the paper's two-part response at the lowest cost, and an environment
needs nothing beyond ``expert_action()`` to get demos.

Invalid turns (``invalid_noise``): a learner that writes one inadmissible action sees a prompt no
DART demo shows (the world did not advance, the history repeats the observation next to the invalid
action) and, measured on ``configs/household_long.toml``, wrote another invalid action after 71% of its
invalid turns against 29% after a valid one: it loops. So with probability ``invalid_noise`` a turn
that is not a random admissible one executes an *inadmissible* action of the kind the learner writes
— an action that was admissible at an earlier turn of the episode and is not now ("go to" the place
it already stands at, "put" an object it no longer holds) — which costs the invalid penalty and
leaves the world as it was; its response, as on every noisy turn, is the expert's answer there, and
the following turns show the recovery. A turn with no such action (the first) stays the expert's.

Kept noise (``keep_noise``): DART labels make the warm start an expert copy; with invalid-turn noise
it succeeded in 91% of the long benchmark's training episodes on seed 0
(docs/results/learning-household.md "Warm-start measurements for v2"), leaving RL nothing to show.
With probability ``keep_noise`` a random turn keeps its own action as its label (plain noise), so the clone is a partly random but valid policy — the CPU analogue of an instruct
model that follows the format and lists admissible actions but is no expert. Invalid turns are never
kept (the clone must not learn to write them).

Randomness: episode ``k``'s noise stream is ``(seed, "demos", k)``: the same arguments give the same
table, whatever else ran before.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import polars as pl

from schemas.config import Config
from schemas.errors import GraftError
from stages.envs.base import Environment, Episode, Task, environment_tasks
from stages.envs.prompts import episode_prompt, layout_prompt_fn
from stages.envs.registry import make_environment
from stages.play.collect import STEPS_FRAME_SCHEMA
from stages.policy.sampling import derive_rng

EXPERT_VERSION = "expert"
# the rollout's columns except the token ones (demos belong to no model)
DEMO_COLUMNS = tuple(
    c
    for c in STEPS_FRAME_SCHEMA
    if c not in ("prompt_ids", "response_ids", "response_logprobs", "choices", "choice_scores")
)


THINK_TEMPLATES = ("verb", "situation", "plan")  # sft.think: what the demos' <think> says (module docstring)


def think_text(style: str, action: str) -> str:
    """The ``verb`` thinking text for ``action``: the kind of step it is (see the module docstring)."""
    if style == "search":
        return action.split(":", 1)[0].strip()
    return action.split(" ", 1)[0]


def check_think(env: Environment, think: str) -> None:
    """Refuse a thinking template ``env`` cannot fill (``situation`` needs ``Game.situation()``)."""
    if think not in THINK_TEMPLATES:
        raise GraftError(f"demos: unknown think template '{think}'; templates: {', '.join(THINK_TEMPLATES)}")
    if think in ("situation", "plan") and not callable(getattr(env.new_game(), "situation", None)):
        raise GraftError(
            f"demos: think = '{think}' needs an environment whose games describe their situation "
            f"(household does); '{env.name}' has none: use think = 'verb'"
        )


def turn_think(think: str, game: Any, style: str, action: str, task_text: str = "") -> str:
    """The thinking text of a demo turn whose label is ``action``, from ``game`` before it acts.

    ``plan``: what the expert can honestly state from the prompt alone -- the goal (``task_text``, as
    the prompt shows it), where it is and what it holds (``game.situation()``), and what it does next,
    e.g. ``goal: put some potato on dresser. at middle carrying nothing. next: go to bed 1``. It claims
    no hidden knowledge (not "the potato is on bed 1", only that it goes there next)."""
    if think == "situation":
        return game.situation()
    if think == "plan":
        goal = task_text.strip().removeprefix("Your task is to:").strip().rstrip(".")
        return f"goal: {goal}. {game.situation()}. next: {action}"
    return think_text(style, action)


def demo_response(style: str, action: str, think: str | None = None) -> str:
    """``action`` written in the paper's response format for prompt ``style``; ``think`` is the
    thinking text (default: the ``verb`` template)."""
    think = f"<think>{think_text(style, action) if think is None else think}</think>"
    if style == "search":
        from stages.envs.prompts import search_action_markup

        return think + search_action_markup(action)
    return f"{think}<action>{action}</action>"


def make_demo_environment(config: Config) -> Environment:
    """The environment the warm start's demos and DAgger rounds play: the run's, with
    ``sft.env_options`` over ``env.options`` (e.g. other rooms than the benchmark's)."""
    return make_environment(config, {**config.env.options, **config.sft.env_options})


def inadmissible_action(
    earlier: Sequence[str], admissible: Sequence[str], rng: np.random.Generator
) -> str | None:
    """An action of ``earlier`` (admissible at earlier turns, first-seen order) that is not in
    ``admissible`` now, drawn uniformly; None when there is none."""
    now = set(admissible)
    candidates = [a for a in earlier if a not in now]
    return candidates[int(rng.integers(len(candidates)))] if candidates else None


def expert_demos(
    env: Environment,
    tasks: Sequence[Task],
    episodes: int,
    *,
    noise: float = 0.0,
    invalid_noise: float = 0.0,
    keep_noise: float = 0.0,
    seed: int = 0,
    history_length: int = 2,
    prompt_fn: Callable[..., str] | None = None,
    think: str = "verb",
) -> pl.DataFrame:
    """Play ``episodes`` expert episodes (round-robin over ``tasks``) into steps rows (docs/design.md §3).

    ``noise``: probability that a turn's expert action is replaced by a uniformly random admissible
    action (also used when the expert has no action); ``invalid_noise``: probability that a turn that
    is not such a random one executes an inadmissible action; ``keep_noise``: probability that a random
    turn is labelled with its own action instead of the expert's (module docstring); ``think``: the
    thinking template (``THINK_TEMPLATES``). Group ``d-gNNN`` = task ``NNN`` of ``tasks``;
    trajectory ``d-gNNN-rK`` = its K-th episode.
    """
    if not tasks:
        raise GraftError("demos: the task list is empty")
    check_think(env, think)
    if episodes < 1:
        raise GraftError(f"demos: episodes must be >= 1, got {episodes}")
    for name, p in (("noise", noise), ("invalid_noise", invalid_noise), ("keep_noise", keep_noise)):
        if not 0.0 <= p <= 1.0:
            raise GraftError(f"demos: {name} must be in [0, 1], got {p}")
    style = env.prompt_style
    group_digits = max(2, len(str(len(tasks) - 1)))
    per_task = -(-episodes // len(tasks))
    rollout_digits = len(str(per_task - 1))
    version = (
        EXPERT_VERSION
        + (f"+noise{noise:g}" if noise else "")
        + (f"+invalid{invalid_noise:g}" if invalid_noise else "")
        + (f"+kept{keep_noise:g}" if keep_noise else "")
    )
    columns: dict[str, list[Any]] = {name: [] for name in DEMO_COLUMNS}
    for k in range(episodes):
        task_index, rollout = k % len(tasks), k // len(tasks)
        task = tasks[task_index]
        rng = derive_rng(seed, "demos", k)
        episode = Episode(env, task)
        group_id = f"d-g{task_index:0{group_digits}d}"
        traj_id = f"{group_id}-r{rollout:0{rollout_digits}d}"
        rows: list[dict[str, Any]] = []
        earlier: dict[str, None] = {}  # actions admissible at earlier turns, first-seen order
        while not episode.done:
            prompt = episode_prompt(style, episode, history_length, prompt_fn)
            admissible = episode.current.admissible
            expert = episode.game.expert_action()
            action = expert
            # draw every turn so the stream does not depend on whether the expert had an action
            explore = rng.random() < noise
            label = expert
            if (explore or action is None) and admissible:
                action = admissible[int(rng.integers(len(admissible)))]
                if keep_noise and rng.random() < keep_noise:  # no draw at 0: older streams unchanged
                    label = action
            elif invalid_noise and rng.random() < invalid_noise:  # no draw at 0: older streams unchanged
                action = inadmissible_action(list(earlier), admissible, rng) or action
            earlier.update(dict.fromkeys(admissible))
            if action is None:
                raise GraftError(
                    f"demos: the {env.name} expert has no action in task {task.task_id} and the "
                    "environment lists no admissible actions"
                )
            label = label if label is not None else action
            # the state the prompt shows
            thought = turn_think(think, episode.game, style, label, episode.current.task_text)
            record = episode.act(action)
            rows.append(
                {
                    "step": len(rows),
                    "state": record.state,
                    "next_state": record.next_state,
                    "observation": record.observation,
                    "action": record.action,
                    "valid": record.valid,
                    "reward": float(record.reward),
                    "done": record.done,
                    "terminated": record.terminated,
                    "truncated": record.truncated,
                    "prompt": prompt,
                    # the expert's answer at this state, also on a noisy turn (see the docstring)
                    "response": demo_response(style, label, thought),
                    "error": record.error,
                }
            )
        for row in rows:
            for name, value in row.items():
                columns[name].append(value)
            columns["iter"].append(0)
            columns["group_id"].append(group_id)
            columns["task_id"].append(task.task_id)
            columns["task_type"].append(task.task_type)
            columns["traj_id"].append(traj_id)
            columns["outcome"].append(float(episode.outcome))
            columns["score"].append(float(episode.score))  # the episode's final task score
            columns["policy_version"].append(version)
    frame = pl.DataFrame(columns, schema={name: STEPS_FRAME_SCHEMA[name] for name in DEMO_COLUMNS})
    return frame.sort(["group_id", "traj_id", "step"], maintain_order=True)


def split_tasks(env: Environment, config: Config, split: str, tasks: int = 0) -> list[Task]:
    """The run's ``split`` task set (``env.train_tasks`` or ``env.eval_tasks`` tasks from ``run.seed``),
    or ``tasks`` > 0 tasks of that split."""
    count = tasks or (config.env.train_tasks if split == "train" else config.env.eval_tasks)
    return environment_tasks(env, split, count, config.run.seed)


def split_demos(
    env: Environment,
    config: Config,
    split: str,
    episodes: int,
    noise: float,
    invalid_noise: float = 0.0,
    keep_noise: float = 0.0,
    tasks: int = 0,
    think: str = "verb",
) -> pl.DataFrame:
    """``episodes`` expert episodes over the run's ``split`` task set (``env.train_tasks`` or
    ``env.eval_tasks`` tasks from ``run.seed``: the sets the loop and the evaluation draw from; ``tasks``
    > 0: that many tasks instead), with the run's prompt history; noise stream from ``run.seed``."""
    return expert_demos(
        env,
        split_tasks(env, config, split, tasks),
        episodes,
        noise=noise,
        invalid_noise=invalid_noise,
        keep_noise=keep_noise,
        seed=config.run.seed,
        history_length=config.rollout.history,
        prompt_fn=layout_prompt_fn(config.rollout.prompt_layout),
        think=think,
    )


def demo_summary(steps: pl.DataFrame, success_outcome: float) -> dict[str, float]:
    """Episodes, success rate and mean turns of a demos table."""
    ends = steps.filter(pl.col("done"))
    if ends.height == 0:
        return {"episodes": 0.0, "success_rate": 0.0, "mean_turns": 0.0}
    return {
        "episodes": float(ends.height),
        "success_rate": float((ends["outcome"] >= success_outcome).mean()),
        "mean_turns": float((ends["step"] + 1).mean()),
    }
