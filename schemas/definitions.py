"""Every graft table, defined once: columns, Arrow types, nullability, meaning, version (docs/design.md §3).

A table is a Parquet file (zstd) whose key-value metadata holds ``graft.table`` and
``graft.schema_version``. Bump a table's ``version`` whenever its columns change.
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa

INITIAL_VERSION = "initial"  # the policy_version of rows the initial (reference) policy acted


@dataclass(frozen=True)
class ColumnSpec:
    """One column: name, Arrow type, whether nulls are allowed, one line of meaning."""

    name: str
    type: pa.DataType
    nullable: bool
    meaning: str


@dataclass(frozen=True)
class TableSpec:
    """One table: its name, schema version, columns and a one-line description."""

    name: str
    version: int
    description: str
    columns: tuple[ColumnSpec, ...]
    reads: tuple[int, ...] = ()  # older versions readers still accept (their missing columns are nullable)

    @property
    def schema(self) -> pa.Schema:
        metadata = {b"graft.table": self.name.encode(), b"graft.schema_version": str(self.version).encode()}
        return pa.schema(
            [pa.field(c.name, c.type, nullable=c.nullable) for c in self.columns], metadata=metadata
        )

    @property
    def column_names(self) -> list[str]:
        return [c.name for c in self.columns]

    def column(self, name: str) -> ColumnSpec:
        for c in self.columns:
            if c.name == name:
                return c
        raise KeyError(name)


def _c(name: str, type_: pa.DataType, meaning: str, nullable: bool = False) -> ColumnSpec:
    return ColumnSpec(name, type_, nullable, meaning)


_i32, _f64, _str, _bool = pa.int32(), pa.float64(), pa.string(), pa.bool_()

STEPS = TableSpec(
    "steps",
    3,  # v2 added `score`, v3 `choice_scores`; older tables read with them null
    "one row per executed transition; the input contract for external rollouts too",
    (
        _c("iter", _i32, "training iteration (0 for external data)"),
        _c("group_id", _str, "rollout group: the N rollouts of one task instance in one iteration"),
        _c("task_id", _str, "environment task identifier"),
        _c("task_type", _str, "subtask label for per-type metrics, may be empty"),
        _c("traj_id", _str, "unique per trajectory"),
        _c("step", _i32, "turn index t, 0..T-1, contiguous within a trajectory"),
        _c("state", _str, "canonical key of s_t given by the environment (what exact matching hashes)"),
        _c("next_state", _str, "canonical key of s_{t+1}; equals `state` of step t+1"),
        _c("observation", _str, "text the agent saw at s_t"),
        _c("action", _str, "executed action text (parsed from the response)"),
        _c("valid", _bool, "the action was parseable and admissible"),
        _c("reward", _f64, "step reward r_t, terminal outcome excluded (e.g. -0.1 for an invalid action)"),
        _c("outcome", _f64, "the trajectory's terminal reward R, same on all its rows"),
        _c("done", _bool, "last row of its trajectory"),
        _c("terminated", _bool, "the environment ended the episode at this step"),
        _c("truncated", _bool, "the episode was cut (max turns or an environment error) at this step"),
        _c("prompt", _str, "model input of this turn", True),
        _c("response", _str, "raw model output of this turn", True),
        _c("prompt_ids", pa.list_(_i32), "tokens of `prompt`", True),
        _c("response_ids", pa.list_(_i32), "tokens of `response`", True),
        _c("response_logprobs", pa.list_(pa.float32()), "behaviour-policy log-probs of `response_ids`", True),
        _c("choices", pa.list_(_str), "the admissible set in `choose` mode", True),
        _c(
            "choice_scores",
            pa.list_(_f64),
            "`choose` mode: the behaviour policy's mean token log-prob of each choice (raw model, no "
            "temperature), aligned with `choices`",
            True,
        ),
        _c("policy_version", _str, f"checkpoint that acted ('{INITIAL_VERSION}': the initial policy)", True),
        _c("error", _str, "environment exception that truncated this trajectory, if any", True),
        _c(
            "score",
            _f64,
            "the episode's task score in [0, 1] (WebShop's partial credit; 1/0 = won/lost elsewhere), "
            "same on all its rows; null when not recorded",
            True,
        ),
    ),
    reads=(1, 2),
)

# What the credit stages (graph, solve, advantage) need from an external steps table; nothing else
# is read by the rules (schemas.validate) or the estimators.
STEPS_CREDIT = (
    "group_id",
    "traj_id",
    "step",
    "state",
    "next_state",
    "action",
    "reward",
    "outcome",
    "done",
    "terminated",
    "truncated",
)

# Columns an external table may omit, and what fills them (a constant or another column).
STEPS_DEFAULTS: dict[str, str] = {
    "iter": "0",
    "task_id": "group_id",
    "task_type": '""',
    "observation": "state",
    "valid": "true",
}

# Columns only the policy update reads (nullable; absent means the rows cannot be trained on).
STEPS_TRAINING = ("prompt", "response", "prompt_ids", "response_ids", "response_logprobs", "choices")

# Columns an external steps table may omit; readers fill them with nulls.
STEPS_OPTIONAL = (
    "prompt",
    "response",
    "prompt_ids",
    "response_ids",
    "response_logprobs",
    "choices",
    "choice_scores",
    "policy_version",
    "error",
    "score",
)


def steps_column_role(name: str) -> str:
    """What `graft schema steps` says about a steps column: required for credit, default, training, optional."""
    if name in STEPS_CREDIT:
        return "required (credit)"
    if name in STEPS_DEFAULTS:
        return f"default {STEPS_DEFAULTS[name]}"
    if name in STEPS_TRAINING:
        return "training only"
    return "optional"


NODES = TableSpec(
    "nodes",
    1,
    "one row per trajectory-graph node, per group",
    (
        _c("group_id", _str, "rollout group the graph belongs to"),
        _c("node", _i32, "node index, 0-based within the group"),
        _c("state", _str, "representative state key (the first state mapped to the node)"),
        _c("visits", _i32, "steps rows whose state is this node"),
        _c("out_edges", _i32, "raw out-edge instances (steps rows leaving this node)"),
        _c("ends", _i32, "trajectories that end at this node (after the truncation rule)"),
        _c("end_value", _f64, "mean outcome of those ends, null if none", True),
    ),
)

EDGES = TableSpec(
    "edges",
    1,
    "one row per steps row, in the same order: the transition as a graph edge",
    (
        _c("group_id", _str, "rollout group"),
        _c("traj_id", _str, "trajectory of the step"),
        _c("step", _i32, "turn index of the step"),
        _c("src", _i32, "node of s_t"),
        _c("dst", _i32, "node of s_{t+1}"),
        _c("reward", _f64, "step reward r_t carried by the edge"),
    ),
)

VALUES = TableSpec(
    "values",
    1,
    "node values from Bellman iteration on each group's graph",
    (
        _c("group_id", _str, "rollout group"),
        _c("node", _i32, "node index within the group"),
        _c("value", _f64, "V(u) at the fixed point"),
        _c("reaches_end", _bool, "some end is reachable from the node (else V = 0)"),
        _c("propagation", _i32, "distinct trajectories whose end is reachable from the node (App. D.3)"),
        _c("sweeps", _i32, "Gauss-Seidel sweeps the group's solve took (same on every row of the group)"),
        _c("residual", _f64, "max |dV| of the group's last sweep (same on every row of the group)"),
    ),
)

ADVANTAGES = TableSpec(
    "advantages",
    1,
    "one row per steps row, in the same order: the credit the loss uses",
    (
        _c("group_id", _str, "rollout group"),
        _c("traj_id", _str, "trajectory of the step"),
        _c("step", _i32, "turn index of the step"),
        _c("estimator", _str, "estimator name from the registry"),
        _c("td", _f64, "TD residual r + gamma V(dst) - V(src); null for non-graph estimators", True),
        _c("gae", _f64, "GAE-refined credit before normalization, if the estimator has one", True),
        _c("advantage", _f64, "the advantage the policy loss uses"),
        _c("norm_group_size", _i32, "size of the group the advantage was normalized in (1 if none)"),
    ),
)

METRICS = TableSpec(
    "metrics",
    1,
    "long-format metrics of every stage (success_rate, mean_return, seconds, graph diagnostics, ...)",
    (
        _c("iter", _i32, "training iteration"),
        _c("stage", _str, "stage that produced the metric (rollout, graph, solve, advantage, update, loop)"),
        _c("name", _str, "metric name (stable, documented in the README)"),
        _c("value", _f64, "metric value"),
        _c("task_type", _str, "task type the metric is restricted to, null for all tasks", True),
    ),
)

EVAL = TableSpec(
    "eval",
    2,  # v2 added `split`; v1 tables read with split null
    "long-format evaluation results on held-out tasks",
    (
        _c("iter", _i32, "training iteration of the evaluated checkpoint"),
        _c("checkpoint", _str, "checkpoint that was evaluated"),
        _c("name", _str, "metric name (success_rate, mean_turns, mean_score, mean_return, episodes)"),
        _c("value", _f64, "metric value"),
        _c("task_type", _str, "task type, null for all tasks", True),
        _c(
            "split",
            _str,
            "evaluation split (e.g. ALFWorld valid_seen / valid_unseen) when several were evaluated; "
            "null for all evaluated episodes",
            True,
        ),
    ),
    reads=(1,),
)

EVAL_EPISODES = TableSpec(
    "eval_episodes",
    1,
    "one row per episode of an evaluation of the run's policy: the draws behind the eval table's rates",
    (
        _c("iter", _i32, "training iteration of the evaluated checkpoint (-1: the initial policy)"),
        _c("checkpoint", _str, "checkpoint that was evaluated"),
        _c(
            "traj_id",
            _str,
            "the episode's draw: under eval.draws = common every evaluation of a run plays the same "
            "traj_id with the same task and sampling streams",
        ),
        _c("task_id", _str, "environment task identifier"),
        _c("task_type", _str, "task type", True),
        _c("success", _f64, "1 when the outcome reached the environment's success outcome, else 0"),
        _c("return", _f64, "G = sum of step rewards + outcome"),
        _c("turns", _f64, "turns played"),
        _c("score", _f64, "task score in [0, 1]"),
        _c("invalid", _f64, "turns whose output was unparseable or inadmissible"),
    ),
)

UPDATE = TableSpec(
    "update",
    1,
    "long-format metrics of the policy update, per optimizer step and summarized per iteration",
    (
        _c("iter", _i32, "training iteration"),
        _c("epoch", _i32, "epoch over the iteration's batch (-1 for the iteration summary)"),
        _c("minibatch", _i32, "minibatch index within the epoch (-1 for the iteration summary)"),
        _c("name", _str, "metric name (loss, policy_loss, kl, clip_fraction, ratio_mean, ...)"),
        _c("value", _f64, "metric value"),
    ),
)

REFLOGPROBS = TableSpec(
    "reflogprobs",
    1,
    "reference-model log-probs of each steps row's response tokens, cached by the update stage",
    (
        _c("group_id", _str, "rollout group"),
        _c("traj_id", _str, "trajectory of the step"),
        _c("step", _i32, "turn index of the step"),
        _c(
            "ref_logprobs",
            pa.list_(pa.float32()),
            "log pi_ref of each response token (logits / T for generated responses, T = 1 for choices)",
        ),
    ),
)

TRUTH = TableSpec(
    "truth",
    1,
    "exact values of a synthetic layered MDP under its known policy, one row per steps row",
    (
        _c("group_id", _str, "rollout group"),
        _c("traj_id", _str, "trajectory"),
        _c("step", _i32, "turn index"),
        _c("v_true", _f64, "exact V^pi(s_t)"),
        _c("q_true", _f64, "exact Q^pi(s_t, a_t)"),
        _c("a_true", _f64, "exact A^pi(s_t, a_t) = Q^pi - V^pi"),
    ),
)

ORACLE = TableSpec(
    "oracle",
    1,
    "Monte-Carlo state values of the bench oracle: K continuations of the acting policy from every "
    "distinct (group, turn, state) of the rollout",
    (
        _c("group_id", _str, "rollout group"),
        _c("step", _i32, "turn index t of the state"),
        _c("state", _str, "state key s_t"),
        _c("value", _f64, "mean discounted return of the continuations from s_t: V^pi(s_t) estimated"),
        _c("return_std", _f64, "std (ddof 1; 0 for one continuation) of those returns"),
        _c("continuations", _i32, "continuations played from s_t (K)"),
        _c("turns", _i32, "policy turns the continuations took, all together"),
    ),
)

TABLES: dict[str, TableSpec] = {
    t.name: t
    for t in (
        STEPS,
        NODES,
        EDGES,
        VALUES,
        ADVANTAGES,
        METRICS,
        EVAL,
        EVAL_EPISODES,
        UPDATE,
        REFLOGPROBS,
        TRUTH,
        ORACLE,
    )
}
