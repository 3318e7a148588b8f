"""Evaluation on held-out tasks (docs/design.md §8, ``graft eval``).

The policy of a checkpoint plays ``config.env.eval_tasks`` tasks of the environment's ``eval`` split
(``config.eval.group_size`` episodes each) at ``config.eval.temperature``; the episodes are reduced to
long-format ``eval`` rows, overall (task_type null) and per task type, for all episodes (split null)
and, when the environment labels splits and the episodes span several (ALFWorld ``eval_split =
"both"``), per split too:

* ``success_rate``: share of episodes whose outcome reached the environment's success outcome R⁺
  (10 household/ALFWorld/shop, 1 search);
* ``mean_return``: mean of G = Σ_t r_t + R (step rewards incl. invalid-action penalties, plus outcome);
* ``mean_turns``: mean number of turns;
* ``mean_score``: mean task score in [0, 1] — the ``score`` column the rollout records (WebShop's
  partial credit for ``shop``: a purchase that matches the goal partly scores between 0 and 1 while
  its success is 0), else (null score, e.g. external tables) clip(R / R⁺, 0, 1);
* ``valid_action_rate``: share of turns (not episodes) whose response parsed to an admissible action
  (the steps' ``valid`` column; 1 without that column, and 1 in ``choose`` mode, where the policy picks
  from the admissible set); ``invalid_rate`` = 1 − valid_action_rate, kept for existing readers;
* ``episodes``: number of episodes.

The standard error of a success rate is not a row: ``success_standard_error(success_rate, episodes)``
(``stages.observe.report``) derives it from the two (reports and benchmark tables print it beside the
rate).

Where it goes: the checkpoint written by the update of iteration i → ``iter_i/eval.parquet``
(iter = i); the initial policy → ``eval.parquet`` at the run root (iter = -1). Beside each, its
``eval_episodes.parquet``: one row per episode (traj_id, task, success, return, turns, score, invalid
turns), the draws the rates summarize; with ``eval.draws = "common"`` two evaluations pair draw by
draw (``draw_changes``: draws gained and lost, the churn inside a difference of rates). ``graft eval
--checkpoint DIR`` of another model writes its rates only (``eval_<name>.parquet``).
"""

from stages.evaluate.rows import (
    EVAL_METRICS,
    draw_changes,
    episode_table,
    eval_episode_rows,
    eval_rows,
    eval_seed,
    summary_rows,
)
from stages.evaluate.runner import (
    EPISODES_FILE,
    Evaluated,
    episodes_path,
    evaluate_model,
    evaluated_policy,
    output_path,
    run_eval,
    write_evaluation,
)

__all__ = [
    "EPISODES_FILE",
    "EVAL_METRICS",
    "Evaluated",
    "draw_changes",
    "episode_table",
    "episodes_path",
    "eval_episode_rows",
    "eval_rows",
    "eval_seed",
    "evaluate_model",
    "output_path",
    "evaluated_policy",
    "run_eval",
    "summary_rows",
    "write_evaluation",
]
