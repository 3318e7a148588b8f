"""Trajectory-graph construction (docs/design.md §4 Graph): node numbering, edges, ends, truncation, similarity."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest

from schemas import conform
from schemas.errors import GraftError
from stages.credit.trajectory_graph import _leader_clusters, build_graph
from tests.helpers.credit_cases import fig2_steps, make_steps


def _node_of(nodes: pl.DataFrame, group: str = "g") -> dict[str, int]:
    part = nodes.filter(pl.col("group_id") == group)
    return dict(zip(part["state"].to_list(), part["node"].to_list(), strict=True))


def test_exact_graph_of_the_hand_example():
    steps = fig2_steps()
    nodes, edges = build_graph(steps)
    conform(nodes, "nodes")
    conform(edges, "edges")
    # First appearance in (trajectory, step) order: S, L, G (T1), D, F (T2).
    assert nodes["state"].to_list() == ["S", "L", "G", "D", "F"]
    assert nodes["node"].to_list() == [0, 1, 2, 3, 4]
    S, L, G, D, F = range(5)
    assert edges["src"].to_list() == [S, L, S, D, S, D, S, L, L, S, D, S]
    assert edges["dst"].to_list() == [L, G, D, F, D, G, L, L, F, D, G, D]
    assert edges.select("traj_id", "step").equals(steps.select("traj_id", "step"))
    assert edges["reward"].to_list() == [0, 0, 0, 0, 0, 0, 0, -0.1, 0, 0, 0, 0]
    # out-edges: S has 6 rows, L 3 (incl. the self-loop), D 3; G and F none.
    assert nodes["out_edges"].to_list() == [6, 3, 0, 3, 0]
    assert nodes["visits"].to_list() == nodes["out_edges"].to_list()
    # Ends ("fail" truncation keeps T6's cut end at D): G from T1, T3, T5; F from T2, T4; D from T6.
    assert nodes["ends"].to_list() == [0, 0, 3, 1, 2]
    assert nodes["end_value"].to_list() == [None, None, 1.0, 0.0, 0.0]


def test_bootstrap_drops_a_cut_end_only_where_the_node_continues():
    steps = pl.concat(
        [
            fig2_steps(),
            # T7 is cut at X, a node nobody leaves: its end stays (a sink with outcome 0.5).
            make_steps([("T7", [("S", "X", 0.0)], 0.5, "truncated")]),
            # T8 is cut at D but also terminated: a real end, kept.
            make_steps([("T8", [("S", "D", 0.0)], 0.25, "both")]),
        ]
    )
    nodes, _ = build_graph(steps, truncation="bootstrap")
    ends = dict(zip(nodes["state"].to_list(), nodes["ends"].to_list(), strict=True))
    values = dict(zip(nodes["state"].to_list(), nodes["end_value"].to_list(), strict=True))
    assert ends == {"S": 0, "L": 0, "G": 3, "D": 1, "F": 2, "X": 1}
    assert values["D"] == 0.25 and values["X"] == 0.5
    fail_nodes, _ = build_graph(steps, truncation="fail")
    fail_ends = dict(zip(fail_nodes["state"].to_list(), fail_nodes["ends"].to_list(), strict=True))
    assert fail_ends["D"] == 2 and fail_ends["X"] == 1


def test_groups_are_numbered_separately_and_rows_keep_their_order():
    a = make_steps([("a1", [("S", "M", 0.0), ("M", "E", 0.0)], 1.0, "terminated")], group="ga", task="ta")
    b = make_steps([("b1", [("Q", "S", 0.0), ("S", "E", 0.0)], 0.0, "terminated")], group="gb", task="tb")
    steps = pl.concat([a, b])
    shuffled = steps[[3, 0, 2, 1]]
    nodes, edges = build_graph(shuffled)
    assert edges.select("traj_id", "step").equals(shuffled.select("traj_id", "step"))
    # Trajectories are taken by their first row in the table: b1 (row 0) first, then a1.
    assert nodes["group_id"].to_list() == ["gb", "gb", "gb", "ga", "ga", "ga"]
    assert _node_of(nodes, "gb") == {"Q": 0, "S": 1, "E": 2}
    assert _node_of(nodes, "ga") == {"S": 0, "M": 1, "E": 2}
    # Same string "S" in two groups: two different nodes, each 0-based in its group.
    by_row = edges.with_columns(state=shuffled["state"], next_state=shuffled["next_state"])
    for row in by_row.iter_rows(named=True):
        mapping = _node_of(nodes, row["group_id"])
        assert (row["src"], row["dst"]) == (mapping[row["state"]], mapping[row["next_state"]])


def test_rejects_unknown_modes():
    with pytest.raises(GraftError, match="canonicalize"):
        build_graph(fig2_steps(), canonicalize="fuzzy")  # type: ignore[arg-type]
    with pytest.raises(GraftError, match="truncation"):
        build_graph(fig2_steps(), truncation="drop")  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# similarity canonicalization with controlled vectors


class FakeEmbedder:
    """Returns fixed vectors per text and records what it was asked to encode."""

    def __init__(self, vectors: dict[str, tuple[float, ...]]):
        self.vectors = vectors
        self.calls: list[list[str]] = []

    def __call__(self, texts):
        texts = list(texts)
        self.calls.append(texts)
        return np.array([self.vectors[t] for t in texts], dtype=np.float64)


def _chain_steps(states: list[str]) -> pl.DataFrame:
    """One trajectory per state s: s -> END, in the given order (so first visits follow it)."""
    return make_steps([(f"t{i}", [(s, "END", 0.0)], 1.0, "terminated") for i, s in enumerate(states)])


def test_similarity_merges_at_tau_and_not_above_it():
    # (3, 4) normalizes exactly to (0.6, 0.8): its cosine with (5, 0) is the float 0.6 itself.
    fake = FakeEmbedder({"a": (5.0, 0.0), "a'": (3.0, 4.0), "END": (0.0, 0.0)})
    steps = _chain_steps(["a", "a'"])
    nodes, edges = build_graph(steps, canonicalize="similarity", tau=0.6, embedder=fake)
    assert nodes["state"].to_list() == ["a", "END"]
    assert edges["src"].to_list() == [0, 0]
    nodes, edges = build_graph(
        steps, canonicalize="similarity", tau=float(np.nextafter(0.6, 1.0)), embedder=fake
    )
    assert nodes["state"].to_list() == ["a", "END", "a'"]
    assert edges["src"].to_list() == [0, 2]


def test_similarity_is_leader_clustering_in_visit_order():
    deg = np.pi / 180
    vec = {
        name: (np.cos(a * deg), np.sin(a * deg)) for name, a in {"A": 0, "B": 30, "C": 60, "D": 29}.items()
    }
    vec["END"] = (0.0, -1.0)
    tau = float(np.cos(35 * deg))
    # B joins A (30° apart). C is 30° from B but 60° from the leader A: it leads a new cluster.
    # D is within 35° of both leaders A (29°) and C (31°): it joins the earliest, A.
    nodes, edges = build_graph(
        _chain_steps(["A", "B", "C", "D"]), "similarity", tau, embedder=FakeEmbedder(vec)
    )
    assert nodes["state"].to_list() == ["A", "END", "C"]
    assert edges["src"].to_list() == [0, 0, 2, 0]
    # Another visit order gives other leaders: C first, then B (30° from C) joins C, A leads, D joins A?
    # D is 31° from C (the earliest leader within tau), so D joins C.
    nodes, edges = build_graph(
        _chain_steps(["C", "B", "A", "D"]), "similarity", tau, embedder=FakeEmbedder(vec)
    )
    assert nodes["state"].to_list() == ["C", "END", "A"]
    assert edges["src"].to_list() == [0, 0, 2, 0]


def test_identical_strings_share_a_node_and_groups_do_not_mix():
    rng = np.random.default_rng(0)
    texts = ["x", "y", "END"]
    fake = FakeEmbedder({t: tuple(rng.normal(size=8)) for t in texts})
    a = make_steps([("a1", [("x", "y", 0.0), ("y", "END", 0.0)], 1.0, "terminated")], group="ga", task="t")
    a2 = make_steps([("a2", [("x", "END", 0.0)], 0.0, "terminated")], group="ga", task="t")
    b = make_steps([("b1", [("x", "END", 0.0)], 0.0, "terminated")], group="gb", task="u")
    nodes, edges = build_graph(pl.concat([a, a2, b]), "similarity", tau=1.0, embedder=fake)
    # Each distinct text is encoded once; identical strings share a node even at tau = 1.
    assert sorted(fake.calls[0]) == sorted(texts) and len(fake.calls) == 1
    assert _node_of(nodes, "ga") == {"x": 0, "y": 1, "END": 2}
    assert _node_of(nodes, "gb") == {"x": 0, "END": 1}
    assert edges["src"].to_list() == [0, 1, 0, 0]


def test_leader_clusters_matches_a_sequential_loop():
    rng = np.random.default_rng(3)
    for _ in range(20):
        x = rng.normal(size=(30, 3))
        unit = x / np.linalg.norm(x, axis=1, keepdims=True)
        tau = float(rng.uniform(0.3, 0.95))
        leaders: list[int] = []
        expected = []
        for i in range(len(unit)):
            hit = next((j for j in leaders if unit[i] @ unit[j] >= tau), None)
            if hit is None:
                leaders.append(i)
                hit = i
            expected.append(hit)
        assert _leader_clusters(unit, tau).tolist() == expected


@pytest.mark.slow
def test_similarity_with_the_packaged_minilm():
    from stages.credit.embed import SentenceEncoder

    encoder = SentenceEncoder(batch_size=8)
    states = [
        "You are in the kitchen. You see a fridge and a stove.",
        "You are in the kitchen. You see a fridge and a stove!",
        "you are in the kitchen; you see a fridge and a stove",
        "You arrive at the garden. There is a shovel on the ground.",
    ]
    steps = _chain_steps(states)
    nodes, edges = build_graph(steps, "similarity", tau=0.9, embedder=encoder)
    # The three kitchen variants share node 0; the garden is its own node.
    assert edges["src"].to_list() == [0, 0, 0, 2]
    nodes_strict, edges_strict = build_graph(steps, "similarity", tau=0.9999, embedder=encoder)
    assert len(set(edges_strict["src"].to_list())) == 4


def test_chunked_leader_clustering_equals_the_dense_rule(monkeypatch):
    import stages.credit.trajectory_graph as graph_module

    rng = np.random.default_rng(5)
    x = rng.normal(size=(300, 4))
    unit = x / np.linalg.norm(x, axis=1, keepdims=True)
    dense = {tau: _leader_clusters(unit, tau).tolist() for tau in (0.5, 0.8, 0.95)}
    assert len(set(dense[0.8])) > 10  # many clusters: chunks see leaders of earlier chunks
    for tau, expected in dense.items():
        assert graph_module._leader_clusters_chunked(unit, tau, chunk=37).tolist() == expected
    monkeypatch.setattr(graph_module, "_DENSE_CLUSTER_MAX", 10)  # now the chunked path is taken
    assert _leader_clusters(unit, 0.8).tolist() == dense[0.8]


def test_embedding_cache_is_keyed_by_text(tmp_path, monkeypatch):
    from stages.credit.embed import SentenceEncoder

    calls: list[list[str]] = []

    def fake_encode(self, texts):
        calls.append(list(texts))
        return np.array([[len(t), 1.0] for t in texts], dtype=np.float32)

    monkeypatch.setattr(SentenceEncoder, "encode", fake_encode)
    monkeypatch.setattr(SentenceEncoder, "check_window", lambda self, texts: 0)  # no tokenizer here
    cache = tmp_path / "cache" / "embeddings.parquet"
    encoder = SentenceEncoder(model=tmp_path, cache=cache)  # any local directory is a model path
    first = encoder(["aa", "b"])
    assert calls == [["aa", "b"]] and cache.is_file()
    again = SentenceEncoder(model=tmp_path, cache=cache)(["b", "ccc", "aa"])
    assert calls[1] == ["ccc"]  # only the new text is encoded; the others come from the cache
    np.testing.assert_array_equal(again[[2, 0]], first)


def test_similarity_needs_a_model_directory(runner, tmp_path):
    from graft_cli.app import app

    path = tmp_path / "steps.parquet"
    fig2_steps().write_parquet(path)
    args = ["graph", str(path), "-o", str(tmp_path / "o"), "--set", "graph.canonicalize=similarity"]
    result = runner.invoke(app, [*args, "--set", f"graph.embed_model={tmp_path / 'nope'}"])
    assert result.exit_code == 2 and "not a local model directory" in result.stderr


def test_embed_model_loads_safetensors_only(runner, tmp_path):
    """A .bin file, or a directory with only .bin weights, is one error saying only safetensors load."""
    from graft_cli.app import app

    path = tmp_path / "steps.parquet"
    fig2_steps().write_parquet(path)
    args = ["graph", str(path), "-o", str(tmp_path / "o"), "--set", "graph.canonicalize=similarity"]
    weights = tmp_path / "model" / "pytorch_model.bin"
    weights.parent.mkdir()
    weights.write_bytes(b"\x80\x02not really a pickle")
    (weights.parent / "config.json").write_text("{}")
    for target in (weights, weights.parent):
        result = runner.invoke(app, [*args, "--set", f"graph.embed_model='{target}'"])
        assert result.exit_code == 2, result.output
        assert "only safetensors load" in result.stderr and "Traceback" not in result.output
    assert not (tmp_path / "o" / "nodes.parquet").exists()
