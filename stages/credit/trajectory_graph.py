"""Trajectory graphs: state canonicalization φ and the nodes/edges tables (docs/design.md §4 Graph, paper Sec. 3.1).

For every rollout group the N trajectories are merged into one directed multigraph:

* **nodes** -- φ maps a state key to a node. ``exact``: one node per distinct ``state`` string.
  ``similarity``: the distinct strings are embedded (sentence-transformers, stages.credit.embed: never cut,
  long texts in windows), L2-normalized and clustered greedily in (trajectory, step) order -- a string
  joins the earliest cluster whose *leader* has cosine >= τ, else it leads a new cluster; identical
  strings always share a node. Two structural rules hold whatever the cosine: an end state (where a
  trajectory ends) joins only clusters of end states with the same outcome R, never a state where no
  trajectory ends; and the two states of a step (state != next_state) never share a node, so a step
  never becomes a self-loop just because its states read alike (docs/credit.md "Similarity states").
* **edges** -- each steps row is one raw edge instance ``src = φ(state) -> dst = φ(next_state)``
  carrying the step reward r_t; the edges table is row-aligned with the steps table.
* **ends** -- each trajectory's last row adds an end at its dst with terminal value ``outcome``
  (the paper's sink, V(f) = R(f)). ``truncation="bootstrap"``: an end of a trajectory that was cut
  (truncated and not terminated) is dropped when its node has out-edges, so the node's value comes
  from the continuations other trajectories took from there.

Orders (deterministic): trajectories are taken in order of their first row in the steps table, steps
ascending; the visited states of a trajectory are s_0 .. s_T (``state`` of each row, then
``next_state`` of its last row). Node ids are 0-based per group in order of first appearance in that
sequence; the representative ``state`` of a node is the first string mapped to it (the cluster
leader under similarity).

Implementation: (group, state) keys are integer codes (a polars categorical cast of the state
strings, combined with the group index); first visits come from one stable sort of the 2n visit keys,
so no string joins are needed. Groups appear in the nodes table in order of their first visit.

Shapes: n = steps rows; per group, m_g nodes. Units: rewards and outcomes as given in steps.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

import numpy as np
import polars as pl

from schemas.errors import GraftError

Embedder = Callable[[Sequence[str]], np.ndarray]
"""texts (k,) -> embeddings (k, d) float; need not be normalized (build_graph L2-normalizes)."""

_STEP_COLUMNS = (
    "group_id",
    "traj_id",
    "step",
    "state",
    "next_state",
    "reward",
    "outcome",
    "terminated",
    "truncated",
)


_DENSE_CLUSTER_MAX = 2048  # distinct states per group clustered with one k x k similarity matrix


def _leader_clusters(unit: np.ndarray, tau: float) -> np.ndarray:
    """Greedy leader clustering of L2-normalized rows (k, d) taken in row order.

    Row i joins the earliest-created cluster whose leader has cosine >= tau with it, else leads a new
    cluster. Returns the leader row index of each row (k,). Processing leaders in creation order and
    letting each claim every still-unassigned later row within tau gives exactly the "earliest
    cluster" rule, with one vectorized pass per leader over a (k, k) cosine matrix; groups with more
    than _DENSE_CLUSTER_MAX distinct states go through ``_leader_clusters_chunked`` (bounded memory).
    """
    k = unit.shape[0]
    if k > _DENSE_CLUSTER_MAX:
        return _leader_clusters_chunked(unit, tau)
    leader = np.full(k, -1, dtype=np.int64)
    sims = unit @ unit.T  # (k, k) cosine; k = distinct strings of one group
    for i in range(k):
        if leader[i] >= 0:
            continue
        leader[i] = i
        claim = (sims[i, i + 1 :] >= tau) & (leader[i + 1 :] < 0)
        leader[i + 1 :][claim] = i
    return leader


def _leader_clusters_chunked(unit: np.ndarray, tau: float, chunk: int = 1024) -> np.ndarray:
    """Same result as the dense rule, in row chunks: O(chunk x (leaders + chunk)) memory.

    A row first looks at the leaders of earlier chunks (all created before any leader of its own
    chunk, so the earliest hit there wins), then at the leaders created earlier in its own chunk.
    """
    k = unit.shape[0]
    leader = np.full(k, -1, dtype=np.int64)
    leaders: list[int] = []
    for start in range(0, k, chunk):
        stop = min(start + chunk, k)
        block = unit[start:stop]
        before = np.asarray(leaders, dtype=np.int64)
        hits = (block @ unit[before].T >= tau) if before.size else np.zeros((stop - start, 0), dtype=bool)
        inside = block @ block.T >= tau
        own: list[int] = []  # leaders created in this chunk (offsets into the block)
        for r in range(stop - start):
            if hits.shape[1] and hits[r].any():
                leader[start + r] = before[int(np.argmax(hits[r]))]
                continue
            match = next((j for j in own if inside[r, j]), None)
            if match is None:
                own.append(r)
                leader[start + r] = start + r
            else:
                leader[start + r] = start + match
        leaders.extend(start + j for j in own)
    return leader


def _codes(column: pl.Series) -> np.ndarray:
    """Integer code per value (equal strings, equal codes), int64."""
    return column.cast(pl.Categorical).to_physical().to_numpy().astype(np.int64)


def _first_occurrence(seq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For a key sequence: (position of each distinct key's first occurrence, distinct index of each element).

    Distinct keys are numbered in sorted-key order; positions index ``seq``.
    """
    order = np.argsort(seq, kind="stable")
    ordered = seq[order]
    new = np.ones(seq.size, dtype=bool)
    new[1:] = ordered[1:] != ordered[:-1]
    inverse = np.empty(seq.size, dtype=np.int64)
    inverse[order] = np.cumsum(new) - 1
    return order[new], inverse  # stable sort: the first element of each run is the earliest


def _rank_within(groups: np.ndarray) -> np.ndarray:
    """0-based rank of each element among the elements of its group, in array order."""
    order = np.argsort(groups, kind="stable")
    sorted_groups = groups[order]
    start = np.ones(groups.size, dtype=bool)
    start[1:] = sorted_groups[1:] != sorted_groups[:-1]
    run_start = np.maximum.accumulate(np.where(start, np.arange(groups.size), 0))
    rank = np.empty(groups.size, dtype=np.int64)
    rank[order] = np.arange(groups.size) - run_start
    return rank


def _constrained_leader_clusters(
    unit: np.ndarray, tau: float, end_class: np.ndarray, link_a: np.ndarray, link_b: np.ndarray
) -> np.ndarray:
    """Greedy leader clustering (rows in order) that keeps the two structural rules of docs/design.md §4.

    Row i joins the earliest-created cluster whose leader has cosine >= tau, has the same
    ``end_class`` (-1 = not an end; else the code of the end's outcome) and holds no row that i is
    linked with (``link_a[j] <-> link_b[j]``: the two states of one step); else it leads a new
    cluster. Every cluster therefore has one end class, and no linked pair shares a cluster. When the
    unconstrained clustering already satisfies both rules the result is the same (each row makes the
    same choice). Returns the leader row index of each row (k,).
    """
    k = unit.shape[0]
    partners: list[list[int]] = [[] for _ in range(k)]
    for a, b in zip(link_a.tolist(), link_b.tolist(), strict=True):
        partners[a].append(b)
        partners[b].append(a)
    dense = unit @ unit.T if k <= _DENSE_CLUSTER_MAX else None
    leader = np.full(k, -1, dtype=np.int64)
    leaders: list[int] = []
    for i in range(k):
        if leaders:
            heads = np.asarray(leaders, dtype=np.int64)
            sims = dense[i, heads] if dense is not None else unit[heads] @ unit[i]
            candidates = heads[(sims >= tau) & (end_class[heads] == end_class[i])]
            if candidates.size:
                banned = {int(leader[j]) for j in partners[i] if leader[j] >= 0}
                leader[i] = next((int(c) for c in candidates if int(c) not in banned), -1)
        if leader[i] < 0:
            leader[i] = i
            leaders.append(i)
    return leader


def _breaks_rules(leader: np.ndarray, end_class: np.ndarray, link_a: np.ndarray, link_b: np.ndarray) -> bool:
    """A cluster mixes end classes, or a step's two (different) states share a cluster."""
    return bool((end_class[leader] != end_class).any() or (leader[link_a] == leader[link_b]).any())


def _similarity_leaders(
    texts: pl.Series,
    key_group: np.ndarray,
    tau: float,
    embedder: Embedder | None,
    end_class: np.ndarray,
    links: tuple[np.ndarray, np.ndarray],
) -> np.ndarray:
    """Leader key index of each distinct key (keys in first-visit order; texts = their strings).

    ``end_class`` (per key) and ``links`` (key pairs of steps whose two states differ) are the
    structural rules; see ``_constrained_leader_clusters``.
    """
    if embedder is None:
        from stages.credit.embed import default_embedder

        embedder = default_embedder()
    distinct = texts.unique(maintain_order=True)
    vectors = np.asarray(embedder(distinct.to_list()), dtype=np.float64)
    if vectors.ndim != 2 or vectors.shape[0] != distinct.len():
        raise GraftError(f"embedder returned shape {vectors.shape} for {distinct.len()} texts")
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    unit = vectors / np.where(norms > 0, norms, 1.0)
    text_of_key = texts.cast(pl.Enum(distinct)).to_physical().to_numpy().astype(np.int64)
    leader = np.empty(texts.len(), dtype=np.int64)
    local = np.empty(texts.len(), dtype=np.int64)  # position of each key inside its group
    order = np.argsort(key_group, kind="stable")  # keeps first-visit order inside each group
    bounds = np.flatnonzero(np.diff(key_group[order])) + 1
    groups = [idx for idx in np.split(order, bounds) if idx.size]
    for idx in groups:
        local[idx] = np.arange(idx.size)
    link_a, link_b = links
    link_group = key_group[link_a]
    link_order = np.argsort(link_group, kind="stable")
    link_bounds = np.searchsorted(link_group[link_order], key_group[[idx[0] for idx in groups]])
    link_ends = np.searchsorted(link_group[link_order], key_group[[idx[0] for idx in groups]], side="right")
    for idx, lo, hi in zip(groups, link_bounds, link_ends, strict=True):
        group_unit = unit[text_of_key[idx]]
        group_class = end_class[idx]
        mine = link_order[lo:hi]
        a, b = local[link_a[mine]], local[link_b[mine]]
        found = _leader_clusters(group_unit, tau)
        if _breaks_rules(found, group_class, a, b):
            found = _constrained_leader_clusters(group_unit, tau, group_class, a, b)
        leader[idx] = idx[found]
    return leader


def _structural_rules(
    steps: pl.DataFrame,
    visit: np.ndarray,
    key_of_visit: np.ndarray,
    rank: np.ndarray,
    n_keys: int,
    truncation: str,
) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray]]:
    """Per key its end class, and the key pairs that must not share a node (docs/design.md §4 Graph).

    End class: -1 for a state no trajectory ends at; else the (dense) code of the outcome R of the
    first trajectory that ends there -- an end state is the next_state of a trajectory's last row
    (under ``truncation="bootstrap"`` the end of a cut, not terminated, trajectory does not count: its
    value is meant to come from the continuations it merges with). Links: (key of s_t, key of s_{t+1})
    of every row whose two state strings differ.
    """
    n = steps.height
    src_key = key_of_visit[2 * rank]
    dst_key = key_of_visit[2 * rank + 1]
    ends = steps["done"].to_numpy().astype(bool)
    if truncation == "bootstrap":
        ends &= ~(steps["truncated"].to_numpy().astype(bool) & ~steps["terminated"].to_numpy().astype(bool))
    end_class = np.full(n_keys, -1, dtype=np.int64)
    end_rows = np.flatnonzero(ends)
    if end_rows.size:
        outcome_code = np.unique(steps["outcome"].to_numpy()[end_rows], return_inverse=True)[1].ravel()
        by_visit = np.argsort(rank[end_rows], kind="stable")
        keys, first = np.unique(dst_key[end_rows[by_visit]], return_index=True)  # each key's first end
        end_class[keys] = outcome_code[by_visit][first]
    differ = np.flatnonzero(src_key != dst_key) if n else np.zeros(0, dtype=np.int64)
    return end_class, (src_key[differ], dst_key[differ])


TIME_SEPARATOR = "\x1f@t="


def with_time_keys(steps: pl.DataFrame) -> pl.DataFrame:
    """``state`` and ``next_state`` keyed by the turn: s_t -> "s_t<sep>t", s_{t+1} -> "s_{t+1}<sep>t+1"."""
    step = pl.col("step").cast(pl.Int64)
    return steps.with_columns(
        state=pl.col("state") + pl.lit(TIME_SEPARATOR) + step.cast(pl.String),
        next_state=pl.col("next_state") + pl.lit(TIME_SEPARATOR) + (step + 1).cast(pl.String),
    )


def build_graph(
    steps: pl.DataFrame,
    canonicalize: Literal["exact", "similarity"] = "exact",
    tau: float = 0.9,
    truncation: Literal["fail", "bootstrap"] = "fail",
    embedder: Embedder | None = None,
    time_key: bool = False,
) -> tuple[pl.DataFrame, pl.DataFrame]:
    """Build every group's trajectory graph from a (validated) steps table.

    ``time_key``: the node is (state, turn index): s_t's key gets ``TIME_SEPARATOR + t`` and s_{t+1}'s
    ``t + 1``, so every graph is acyclic and nodes merge only within a turn (exact matching only).

    Returns ``(nodes, edges)`` in the layouts of schemas NODES and EDGES: ``edges`` has one row per
    steps row in the same order (src, dst node ids, reward r_t); ``nodes`` one row per node, groups in
    order of first appearance, nodes 0..m_g-1 within a group, with ``visits`` = ``out_edges`` = rows
    leaving the node, ``ends`` = trajectories ending there after the truncation rule and
    ``end_value`` = mean outcome of those ends (null without ends).

    ``embedder`` (similarity only): texts -> (k, d) vectors; default all-MiniLM-L6-v2 (stages.credit.embed).
    """
    if canonicalize not in ("exact", "similarity"):
        raise GraftError(f"graph.canonicalize must be 'exact' or 'similarity', got {canonicalize!r}")
    if truncation not in ("fail", "bootstrap"):
        raise GraftError(f"graph.truncation must be 'fail' or 'bootstrap', got {truncation!r}")
    if not 0.0 < tau <= 1.0:
        raise GraftError(f"graph.tau must be in (0, 1], got {tau}")
    missing = [c for c in _STEP_COLUMNS if c not in steps.columns]
    if missing:
        raise GraftError(f"steps table is missing column(s) {', '.join(missing)}")
    if time_key:
        if canonicalize != "exact":
            raise GraftError(
                "graph.time_key needs graph.canonicalize = 'exact' (an embedding ignores the turn)"
            )
        steps = with_time_keys(steps)
    n = steps.height
    step = steps["step"].to_numpy().astype(np.int64)
    traj = _first_occurrence(_codes(steps["traj_id"]))[1]  # dense 0..trajectories-1
    group_names = steps["group_id"].unique(maintain_order=True)
    group = steps["group_id"].cast(pl.Enum(group_names)).to_physical().to_numpy().astype(np.int64)

    # Visit order: trajectories by their first row in the table, then steps. Row r's states s_t and
    # s_{t+1} are visited at positions 2 * rank(r) and 2 * rank(r) + 1 (by the chain rule this is the
    # sequence s_0..s_T of each trajectory, and it stays well defined on unvalidated tables).
    traj_first = np.full(traj.max(initial=0) + 1, n, dtype=np.int64)
    np.minimum.at(traj_first, traj, np.arange(n))
    visit = np.lexsort((step, traj_first[traj]))  # rows in visit order
    rank = np.empty(n, dtype=np.int64)
    rank[visit] = np.arange(n)

    strings = _codes(pl.concat([steps["state"], steps["next_state"]]))
    width = int(strings.max(initial=0)) + 1
    seq = np.empty(2 * n, dtype=np.int64)  # (group, string) key of every visit, in visit order
    seq[2 * rank] = group * width + strings[:n]
    seq[2 * rank + 1] = group * width + strings[n:]
    first_pos, key_of_visit = _first_occurrence(seq)
    # Distinct keys in first-visit order.
    by_visit = np.argsort(first_pos, kind="stable")
    first_pos = first_pos[by_visit]
    renumber = np.empty(by_visit.size, dtype=np.int64)
    renumber[by_visit] = np.arange(by_visit.size)
    key_of_visit = renumber[key_of_visit]
    key_group = seq[first_pos] // width
    # The string of each key: the state (even position) or next_state (odd) of the visiting row.
    key_row = visit[first_pos // 2]
    key_text = pl.concat([steps["state"], steps["next_state"]]).gather(key_row + n * (first_pos % 2))

    if canonicalize == "exact":
        leader = np.arange(first_pos.size)
    else:
        end_class, links = _structural_rules(steps, visit, key_of_visit, rank, first_pos.size, truncation)
        leader = _similarity_leaders(key_text, key_group, tau, embedder, end_class, links)
    is_leader = leader == np.arange(first_pos.size)
    leaders = np.flatnonzero(is_leader)  # in first-visit order
    # Groups ordered by their first visit; node ids numbered within the group in first-visit order.
    group_rank = np.empty(group_names.len(), dtype=np.int64)
    group_seen = key_group[leaders][np.sort(_first_occurrence(key_group[leaders])[0])]
    group_rank[group_seen] = np.arange(group_seen.size)
    local = np.empty(first_pos.size, dtype=np.int64)
    local[leaders] = _rank_within(key_group[leaders])
    node_of_key = local[leader]
    src = node_of_key[key_of_visit[2 * rank]]
    dst = node_of_key[key_of_visit[2 * rank + 1]]

    # Global node index: groups in first-visit order, nodes by id.
    counts = np.bincount(key_group[leaders], minlength=group_names.len())
    offsets = np.concatenate([[0], np.cumsum(counts[group_seen])])
    base = np.zeros(group_names.len(), dtype=np.int64)
    base[group_seen] = offsets[:-1]
    m = int(offsets[-1])
    out_edges = np.bincount(base[group] + src, minlength=m)
    # The end of each trajectory sits at the dst of its last row (in visit order).
    last = np.ones(n, dtype=bool)
    last[:-1] = traj[visit[1:]] != traj[visit[:-1]]
    end_rows = visit[last]
    end_node = base[group[end_rows]] + dst[end_rows]
    if truncation == "bootstrap":
        cut = steps["truncated"].to_numpy()[end_rows] & ~steps["terminated"].to_numpy()[end_rows]
        keep = ~(cut & (out_edges[end_node] > 0))
        end_rows, end_node = end_rows[keep], end_node[keep]
    ends = np.bincount(end_node, minlength=m)
    outcome = steps["outcome"].to_numpy().astype(np.float64)
    end_sum = np.bincount(end_node, weights=outcome[end_rows], minlength=m)

    node_key = np.empty(m, dtype=np.int64)
    node_key[base[key_group[leaders]] + local[leaders]] = leaders
    node_group = key_group[node_key]
    nodes = pl.DataFrame(
        {
            "group_id": group_names.gather(node_group),
            "node": pl.Series(local[node_key], dtype=pl.Int32),
            "state": key_text.gather(node_key),
            "visits": pl.Series(out_edges, dtype=pl.Int32),
            "out_edges": pl.Series(out_edges, dtype=pl.Int32),
            "ends": pl.Series(ends, dtype=pl.Int32),
            "end_value": pl.Series(np.where(ends > 0, end_sum / np.maximum(ends, 1), np.nan)).fill_nan(None),
        }
    )
    edges = pl.DataFrame(
        {
            "group_id": steps["group_id"],
            "traj_id": steps["traj_id"],
            "step": steps["step"].cast(pl.Int32),
            "src": pl.Series(src, dtype=pl.Int32),
            "dst": pl.Series(dst, dtype=pl.Int32),
            "reward": steps["reward"].cast(pl.Float64),
        }
    )
    return nodes, edges
