"""The variants of the learning benchmark: name -> the ``--set`` overrides that make it. The one
table a new variant goes into.

``graft`` (GRAFT as the config sets it: by default step rewards in the step's own credit, Graph GAE
with Eq. 9's literal T − 1 − t horizon, node normalization), ``graft-literal`` / ``graft-markov`` (the
horizon named explicitly), ``graft-bootstrap`` (Markov horizon with ``graph.truncation =
"bootstrap"``), ``graft-legacy`` (alias ``graft-v4``, the name the recorded results use: step rewards
inside the values, the literal T − 1 − t horizon), ``graft-flat`` (zero credit for groups whose
outcomes do not vary), ``graft-floor`` (node std floor 0.1 reward units), ``graft-batch`` (per-node
centring, batch std), ``graft-time`` (turn index in the state key, with the flat-group guard),
``graft-nonorm`` (no node normalization), ``graft-traj`` (trajectory GAE), ``graft-td`` (no GAE),
``graft-token`` (GRAFT credit, token-level GRPO objective instead of GRPO-C: the paper's Table 3
ablation), ``frozen`` (the control: no update), ``grpo``, ``gigpo``, ``rloo``, ``salt``, ``graphgpo``,
``rtmc``, ``graphmc`` (graph TD credit from Monte-Carlo node
values, the mean return of the visits, instead of the Bellman solve), ``oracle`` (the bench oracle:
Monte-Carlo advantages from continuations played in the environment).
"""

from __future__ import annotations

VARIANTS: dict[str, list[str]] = {
    "graft": ["advantage.estimator=graft", "advantage.gae=graph"],
    "graft-traj": ["advantage.estimator=graft", "advantage.gae=trajectory"],
    "graft-td": ["advantage.estimator=graft", "advantage.gae=none"],
    "graft-nonorm": ["advantage.estimator=graft", "advantage.gae=graph", "advantage.normalize=none"],
    "graft-token": ["advantage.estimator=graft", "advantage.gae=graph", "update.objective=grpo"],
    # the legacy credit (step rewards inside the node values, the literal T - 1 - t horizon)
    "graft-legacy": [
        "advantage.estimator=graft",
        "advantage.gae=graph",
        "solve.step_rewards=values",
        "advantage.gae_horizon=literal",
    ],
    # the control: the same rollouts (task draws, sampling seeds) with no policy change at all
    "frozen": ["advantage.estimator=grpo", "update.lr=0"],
    # guards for groups without signal (beyond the paper; docs/credit.md)
    "graft-flat": ["advantage.estimator=graft", "advantage.gae=graph", "advantage.flat_groups=zero"],
    "graft-floor": ["advantage.estimator=graft", "advantage.gae=graph", "advantage.node_std_floor=0.1"],
    "graft-batch": ["advantage.estimator=graft", "advantage.gae=graph", "advantage.normalize=batch"],
    # Markov Graph GAE without the ends of cut episodes (the tail is then the end mass of real ends
    # only: docs/credit.md "Graph GAE horizon")
    "graft-bootstrap": [
        "advantage.estimator=graft",
        "advantage.gae=graph",
        "advantage.gae_horizon=markov",
        "graph.truncation=bootstrap",
    ],
    # the two Graph GAE horizons named explicitly, whatever the default (step rewards in the step's
    # own credit, truncation = fail, node normalization as configured)
    "graft-markov": ["advantage.estimator=graft", "advantage.gae=graph", "advantage.gae_horizon=markov"],
    "graft-literal": ["advantage.estimator=graft", "advantage.gae=graph", "advantage.gae_horizon=literal"],
    "graft-time": [
        "advantage.estimator=graft",
        "advantage.gae=graph",
        "graph.time_key=true",
        "advantage.flat_groups=zero",
    ],
    "grpo": ["advantage.estimator=grpo"],
    "gigpo": ["advantage.estimator=gigpo"],
    "rloo": ["advantage.estimator=rloo"],
    "salt": ["advantage.estimator=salt"],
    "graphgpo": ["advantage.estimator=graphgpo"],
    "rtmc": ["advantage.estimator=rtmc"],
    # Monte-Carlo node values (mean return of the visits) instead of the Bellman solve, credit the value
    # difference across the edge, node normalization as configured
    "graphmc": ["advantage.estimator=graphmc"],
    # the bench oracle: Monte-Carlo step advantages from K continuations of the policy per distinct
    # (group, turn, state), played in the rollout stage (stages.credit.advantage.oracle)
    "oracle": ["advantage.estimator=oracle"],
}


VARIANTS["graft-v4"] = VARIANTS["graft-legacy"]  # the run name docs/results/learning-household.md records
