"""The rollout stage (SPEC §6): the policy plays groups of episodes; one steps row per executed turn.

Pure layer: ``collect_episodes(engine, env, tasks, group_size, ...)`` plays ``group_size`` episodes of
every task **in lockstep**: each turn, the prompts of all unfinished episodes go to the engine in
batches of ``batch_size`` (finished episodes cost nothing), then every episode acts. It returns the
steps table sorted by (group, rollout, step). Evaluation reuses it with its own temperature and seed.

Modes:

* ``choose``: π(a|s) = softmax_j(mean per-token log-prob of admissible action j / T); the model input
  is the rendered prompt (chat-wrapped for chat models) followed by ``<action>``, the tag every
  action follows in the paper's output format. Row columns follow the convention in
  ``stages/policy/choice.py``: ``prompt`` = model input string, ``prompt_ids`` = its ids,
  ``response`` = the chosen action, ``response_ids`` = ``tokenizer.encode(action,
  add_special_tokens=False)``, ``response_logprobs`` = their per-token log-probs, ``choices`` = the
  admissible set in the order scored.
* ``generate``: the paper's prompt; the model writes ``<think>…</think><action>…</action>`` (up to
  ``max_new_tokens``, stopped at ``</action>``/``</answer>``/``</search>`` or EOS); the parsed action
  goes to ``Episode.act`` (None when unparseable), which marks unparseable or inadmissible actions
  invalid with the penalty without advancing the world.

Naming: group ``i0003-g05`` (iteration 3, group 5 of the iteration), trajectory ``i0003-g05-r2``.

Randomness (docs/design.md): the iteration's tasks from SeedSequence(seed, iteration, "rollout-tasks");
each episode's action sampling from its own stream (seed, iteration, "rollout-episode", group,
rollout); each generated response from its own (seed, iteration, "rollout-generate", group, rollout,
step), so neither mode depends on batching or sharding. On CPU the same seed gives an identical table.

Runner: ``run_rollout(run, iteration, config, shard=None)``; see ``run_rollout`` for the outputs and
``merge_rollout_shards`` for multi-worker rollouts.

Modules: ``collect`` (lockstep episode collection), ``from_config`` (environment, initial model and
the iteration's tasks from the config), ``metrics`` (the stage's metrics rows), ``runner``
(the stage runner), ``shards`` (multi-worker shard files and their merge).
"""

from stages.rollout.collect import CHOOSE_PREFIX, ProgressHook, collect_episodes
from stages.rollout.from_config import (
    build_tiny_for_config,
    ensure_initial_model,
    iteration_groups,
    make_environment,
    policy_for_iteration,
)
from stages.rollout.metrics import rollout_metrics
from stages.rollout.runner import collect_groups, rollout_iteration, run_rollout
from stages.rollout.shards import merge_rollout_shards, parse_shard, shard_name

__all__ = [
    "CHOOSE_PREFIX",
    "ProgressHook",
    "build_tiny_for_config",
    "collect_episodes",
    "collect_groups",
    "ensure_initial_model",
    "iteration_groups",
    "make_environment",
    "merge_rollout_shards",
    "parse_shard",
    "policy_for_iteration",
    "rollout_iteration",
    "rollout_metrics",
    "run_rollout",
    "shard_name",
]
