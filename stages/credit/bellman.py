"""Node values by Bellman iteration on every group's trajectory graph (docs/design.md §4 Solve, paper Sec. 3.2).

Equation (Eq. 5-7, ends as terminal outcomes V(S_T) = R), per node u of a group, with
n_u = out_edges(u) + ends(u) raw instances:

    step_rewards = "step" (default, the paper's):
        V(u) = (1 / n_u) [ Σ_{e ∈ out(u)} γ V(dst_e) + Σ_{ends at u} R ]
    step_rewards = "values" (legacy):
        V(u) = (1 / n_u) [ Σ_{e ∈ out(u)} (r_e + γ V(dst_e)) + Σ_{ends at u} R ]

(π̂(a|u) P̂(v|u,a) = count(u,a,v) / count(u)). A node that is only an end gets the mean outcome there;
nodes from which no end is reachable keep V = 0. Why "step" is the default: with step rewards in the
backup, V(u) < 0 wherever success is rare (the invalid penalties of the future), so a valid action
that leaves the state unchanged (a self-loop: look, inventory) has TD γV(u) − V(u) = −(1 − γ)V(u) > 0
-- postponing future penalties is credited. The paper's Eq. 8 TD has no reward term; a step's own
reward reaches that step's credit only (stages.credit.advantage.graft).

Solver -- block Gauss-Seidel over reverse-BFS levels, all groups at once
-----------------------------------------------------------------------
``dist(u)`` = hops from u to the nearest end along edges (multi-source BFS on the reversed graph;
level 0 = nodes with ends). One sweep updates level 0, then level 1, ... ; every node of a level is
updated at once (``V_L <- b'_L + γ W'_L V``, one sparse mat-vec over all groups), using the values of
lower levels already updated in this sweep. This is the paper's Gauss-Seidel order (nodes closer to a
sink first) with Jacobi updates inside a level instead of an arbitrary tie-break among equidistant
nodes. As in textbook Gauss-Seidel for the linear system (I − γW) V = b, each node's update solves its
own equation exactly: a self-loop (an invalid action that leaves the state unchanged) is moved to the
left side, b'_u = b_u / (1 − γ w_uu) and W'_u = W_u (off-diagonal) / (1 − γ w_uu), instead of lagging
one sweep behind (without it, a node with many invalid actions needs hundreds of sweeps). Groups share
no edges, so a sweep is the same as running each group on its own; a group stops (its values freeze)
after the first sweep whose max |ΔV| over its nodes is < ε, or after

    k_max = ⌈log ε / log γ⌉ + 50 sweeps (γ < 1);   k_max = m_max + 50 (γ = 1)

where m_max is the node count of the largest group: with γ = 1 the graph must be acyclic (checked,
else GraftError naming the group) and on a DAG Gauss-Seidel/Jacobi is exact after at most
longest-path + 1 < m_g + 1 sweeps, whatever the order.

Why the fixed point is the same as the paper's: every ordering (Jacobi, Gauss-Seidel, block GS)
iterates the same affine map V = b + γ W V restricted to end-reaching nodes; its fixed point is the
unique solution of (I − γ W) V = b, which exists because from every such node an end (absorbing,
value R) or a V = 0 node is reached with positive probability, so W restricted to them is strictly
substochastic along every path (for γ = 1 too). The ordering changes only the number of sweeps.

Also computed: ``reaches_end``, ``propagation`` (distinct trajectories whose end is reachable from the
node, App. D.3; each trajectory has at most one end, so this is Σ ends over reachable end nodes,
found with bitsets of end nodes), ``sweeps`` and ``residual`` per group.

Shapes: m = nodes over all groups, n = edges (steps rows), G = groups.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import polars as pl
import scipy.sparse as sp

from schemas.errors import GraftError


@dataclass(frozen=True)
class GraphIndex:
    """All groups' graphs in one global node numbering (group-contiguous, node order kept).

    groups:      (G,) group ids in nodes-table order
    offsets:     (G + 1,) first global node of each group
    node_group:  (m,) group index of each global node
    src, dst:    (n,) global node of each edge row (edges-table order)
    edge_group:  (n,) group index of each edge row
    reward:      (n,) step reward r_e
    out_edges:   (m,) raw out-edge instances
    ends:        (m,) trajectories ending at the node
    end_sum:     (m,) Σ outcomes of those ends (0 without ends)
    nodes:       nodes table sorted by (group order, node)
    """

    groups: pl.Series
    offsets: np.ndarray
    node_group: np.ndarray
    src: np.ndarray
    dst: np.ndarray
    edge_group: np.ndarray
    reward: np.ndarray
    out_edges: np.ndarray
    ends: np.ndarray
    end_sum: np.ndarray
    nodes: pl.DataFrame

    @property
    def n_nodes(self) -> int:
        return int(self.offsets[-1])


def index_graph(nodes: pl.DataFrame, edges: pl.DataFrame) -> GraphIndex:
    """Number all nodes globally and map the edges onto them; inconsistent tables are GraftErrors."""
    if nodes.height == 0:
        raise GraftError("nodes table has no rows")
    groups = nodes["group_id"].unique(maintain_order=True)
    enum = pl.Enum(groups)
    nodes_sorted = nodes.with_columns(_g=pl.col("group_id").cast(enum).to_physical()).sort(
        "_g", "node", maintain_order=True
    )
    node_group = nodes_sorted["_g"].to_numpy().astype(np.int64)
    counts = np.bincount(node_group, minlength=groups.len())
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    local = nodes_sorted["node"].to_numpy().astype(np.int64)
    if not np.array_equal(local, np.arange(offsets[-1]) - offsets[node_group]):
        bad = int(np.flatnonzero(local != np.arange(offsets[-1]) - offsets[node_group])[0])
        raise GraftError(
            f"nodes table: group '{nodes_sorted['group_id'][bad]}' does not number its nodes 0..m-1"
        )
    # One cast finds the group of every edge and the unknown groups (null codes; cheaper than is_in).
    edge_code = edges["group_id"].cast(enum, strict=False)
    unknown = edge_code.is_null() & edges["group_id"].is_not_null()
    if unknown.any():
        raise GraftError(f"edges table: group '{edges['group_id'].filter(unknown)[0]}' has no nodes")
    edge_group = edge_code.to_physical().to_numpy().astype(np.int64)
    src_local = edges["src"].to_numpy().astype(np.int64)
    dst_local = edges["dst"].to_numpy().astype(np.int64)
    size = counts[edge_group]
    if np.any((src_local < 0) | (src_local >= size) | (dst_local < 0) | (dst_local >= size)):
        bad = int(
            np.flatnonzero((src_local >= size) | (dst_local >= size) | (src_local < 0) | (dst_local < 0))[0]
        )
        raise GraftError(f"edges table: row {bad} points to a node its group does not have")
    ends = nodes_sorted["ends"].to_numpy().astype(np.int64)
    end_value = nodes_sorted["end_value"].fill_null(0.0).to_numpy().astype(np.float64)
    return GraphIndex(
        groups=groups,
        offsets=offsets,
        node_group=node_group,
        src=offsets[edge_group] + src_local,
        dst=offsets[edge_group] + dst_local,
        edge_group=edge_group,
        reward=edges["reward"].to_numpy().astype(np.float64),
        out_edges=np.bincount(offsets[edge_group] + src_local, minlength=int(offsets[-1])),
        ends=ends,
        end_sum=ends * end_value,
        nodes=nodes_sorted.drop("_g"),
    )


def gather_ranges(indptr: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Positions ``indptr[r] .. indptr[r+1]-1`` of every row r in ``rows``, concatenated (CSR gather)."""
    starts = indptr[rows]
    lengths = indptr[rows + 1] - starts
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    shift = np.repeat(starts - np.concatenate([[0], np.cumsum(lengths)[:-1]]), lengths)
    return shift + np.arange(total, dtype=np.int64)


def sorted_unique(values: np.ndarray, return_counts: bool = False):
    """np.unique for large integer arrays via one sort (numpy's hash-based unique is ~50x slower here)."""
    ordered = np.sort(values, kind="stable")
    first = np.ones(ordered.size, dtype=bool)
    first[1:] = ordered[1:] != ordered[:-1]
    uniq = ordered[first]
    if not return_counts:
        return uniq
    return uniq, np.diff(np.append(np.flatnonzero(first), ordered.size))


def _distinct_pairs(index: GraphIndex) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Distinct (u, v) node pairs with their raw edge counts, sorted by u then v."""
    m = index.n_nodes
    pairs, counts = sorted_unique(index.src * m + index.dst, return_counts=True)
    return pairs // m, pairs % m, counts


def end_distance(m: int, u: np.ndarray, v: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Hops from each node to its nearest end (multi-source reverse BFS), -1 where none is reachable."""
    order = np.argsort(v, kind="stable")
    preds = u[order]
    indptr = np.concatenate([[0], np.cumsum(np.bincount(v, minlength=m))])
    dist = np.full(m, -1, dtype=np.int64)
    frontier = np.flatnonzero(ends > 0)
    dist[frontier] = 0
    d = 0
    while frontier.size:
        cand = preds[gather_ranges(indptr, frontier)]
        cand = sorted_unique(cand[dist[cand] < 0])
        d += 1
        dist[cand] = d
        frontier = cand
    return dist


def _check_acyclic(index: GraphIndex, u: np.ndarray, v: np.ndarray) -> None:
    from scipy.sparse.csgraph import connected_components  # only γ = 1 needs it (~0.1 s to import)

    m = index.n_nodes
    adj = sp.csr_matrix((np.ones(u.size, dtype=np.int8), (u, v)), shape=(m, m))
    _, labels = connected_components(adj, directed=True, connection="strong")
    cyclic = np.bincount(labels)[labels] > 1
    cyclic[u[u == v]] = True
    if cyclic.any():
        node = int(np.flatnonzero(cyclic)[0])
        group = index.groups[int(index.node_group[node])]
        raise GraftError(
            f"solve.gamma = 1 needs acyclic graphs, but group '{group}' has a cycle through node "
            f"{node - int(index.offsets[index.node_group[node]])}; use solve.gamma < 1"
        )


def k_max(gamma: float, eps: float, largest_group: int) -> int:
    """Sweep limit: ⌈log ε / log γ⌉ + 50 for γ < 1, largest group's node count + 50 for γ = 1."""
    if gamma >= 1.0:
        return int(largest_group) + 50
    return math.ceil(math.log(eps) / math.log(gamma)) + 50


def _propagation(index: GraphIndex, u: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Distinct trajectories whose end is reachable from each node (bitsets over end nodes)."""
    m = index.n_nodes
    end_nodes = np.flatnonzero(index.ends > 0)
    if end_nodes.size == 0:
        return np.zeros(m, dtype=np.int64)
    g = index.node_group[end_nodes]
    slot = np.arange(end_nodes.size) - np.searchsorted(g, g)  # rank of the end node in its group
    words = int(slot.max()) // 64 + 1
    bits = np.zeros((m, words), dtype=np.uint64)
    bits[end_nodes, slot // 64] = np.left_shift(np.uint64(1), (slot % 64).astype(np.uint64))
    keep = u != v
    pu, pv = u[keep], v[keep]
    order = np.argsort(pv, kind="stable")
    preds, succ = pu[order], pv[order]
    indptr = np.concatenate([[0], np.cumsum(np.bincount(pv, minlength=m))])
    changed = end_nodes
    while changed.size:  # push new bits to predecessors until nothing changes
        pos = gather_ranges(indptr, changed)
        p, s = preds[pos], succ[pos]
        targets = sorted_unique(p)
        before = bits[targets].copy()
        np.bitwise_or.at(bits, p, bits[s])
        changed = targets[np.any(bits[targets] != before, axis=1)]
    out = np.bitwise_count(bits).sum(axis=1).astype(np.int64)
    # An end node with c > 1 ends counts c trajectories: add (c - 1) per reachable such node, one
    # bitset mask per distinct c (a handful) instead of one pass per bit.
    for c in np.unique(index.ends[end_nodes]).tolist():
        if c == 1:
            continue
        at = index.ends[end_nodes] == c
        mask = np.zeros((index.groups.len(), words), dtype=np.uint64)
        np.bitwise_or.at(
            mask, (g[at], slot[at] // 64), np.left_shift(np.uint64(1), (slot[at] % 64).astype(np.uint64))
        )
        out += (c - 1) * np.bitwise_count(bits & mask[index.node_group]).sum(axis=1).astype(np.int64)
    return out


@dataclass
class _Sweep:
    """The rows a sweep updates, permuted so every level is a contiguous slice.

    ``perm`` puts the active rows first, sorted by level (stable: node order inside a level), then all
    other nodes; the iterate ``x = value[perm]`` and ``W[order][:, perm]`` use that order, so a level
    update is ``x[a:z] = b[a:z] + γ W[a:z] @ x`` with no gathers or scatters.
    """

    order: np.ndarray  # (k,) global node of each active row, by level
    perm: np.ndarray  # (m,) order followed by every other node
    b: np.ndarray  # (k,)
    levels: list[tuple[int, int, sp.csr_matrix]]  # (a, z, W rows a:z in permuted columns)
    group: np.ndarray  # (k,) group of each row
    by_group: np.ndarray  # (k,) rows sorted by group
    group_starts: np.ndarray  # starts of each group's run in by_group
    group_ids: np.ndarray  # the group of each run

    @classmethod
    def build(
        cls, rows: np.ndarray, dist: np.ndarray, weights: sp.csr_matrix, b: np.ndarray, node_group: np.ndarray
    ):
        m = weights.shape[0]
        order = rows[np.argsort(dist[rows], kind="stable")]
        rest = np.ones(m, dtype=bool)
        rest[order] = False
        perm = np.concatenate([order, np.flatnonzero(rest)])
        position = np.empty(m, dtype=np.int64)
        position[perm] = np.arange(m)
        sub = weights[order]
        w = sp.csr_matrix((sub.data, position[sub.indices], sub.indptr), shape=(order.size, m))
        cuts = np.flatnonzero(np.diff(dist[order])) + 1
        bounds = np.concatenate([[0], cuts, [order.size]]).tolist()
        group = node_group[order]
        by_group = np.argsort(group, kind="stable")
        sorted_group = group[by_group]
        first = np.ones(order.size, dtype=bool)
        first[1:] = sorted_group[1:] != sorted_group[:-1]
        return cls(
            order=order,
            perm=perm,
            b=b[order],
            levels=[(a, z, w[a:z]) for a, z in zip(bounds[:-1], bounds[1:], strict=True)],
            group=group,
            by_group=by_group,
            group_starts=np.flatnonzero(first),
            group_ids=sorted_group[first],
        )


STEP_REWARDS = ("step", "values")


def check_step_rewards(step_rewards: str) -> None:
    if step_rewards not in STEP_REWARDS:
        raise GraftError(f"solve.step_rewards must be 'step' or 'values', got {step_rewards!r}")


def solve_index(
    index: GraphIndex, gamma: float = 0.99, eps: float = 1e-8, step_rewards: str = "step"
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Solve all groups; returns (V (m,), reaches_end (m,), propagation (m,), sweeps (G,), residual (G,))."""
    check_step_rewards(step_rewards)
    if not 0.0 < gamma <= 1.0:
        raise GraftError(f"solve.gamma must be in (0, 1], got {gamma}")
    if not eps > 0:
        raise GraftError(f"solve.eps must be > 0, got {eps}")
    m, n_groups = index.n_nodes, index.groups.len()
    u, v, count = _distinct_pairs(index)
    if gamma >= 1.0:
        _check_acyclic(index, u, v)
    dist = end_distance(m, u, v, index.ends)
    reaches = dist >= 0
    n_u = index.out_edges + index.ends
    inv_n = np.divide(1.0, n_u, out=np.zeros(m), where=n_u > 0)
    b = index.end_sum.astype(np.float64)
    if step_rewards == "values":
        b = b + np.bincount(index.src, weights=index.reward, minlength=m)
    b = b * inv_n
    # Gauss-Seidel on (I - γW) V = b divides each node's equation by its diagonal 1 - γ w_uu, so a
    # self-loop (an invalid action that leaves the state unchanged) is solved exactly in the node's own
    # update instead of lagging a sweep behind. For an end-reaching node w_uu < 1, so the divisor is > 0.
    loop = u == v
    self_weight = np.zeros(m)
    self_weight[u[loop]] = count[loop] * inv_n[u[loop]]
    scale = np.where(reaches, 1.0 / (1.0 - gamma * self_weight), 0.0)
    b = b * scale
    weights = sp.csr_matrix(
        (count[~loop] * inv_n[u[~loop]] * scale[u[~loop]], (u[~loop], v[~loop])), shape=(m, m)
    )

    limit = k_max(gamma, eps, int(np.diff(index.offsets).max()))
    value = np.zeros(m)
    sweeps = np.zeros(n_groups, dtype=np.int64)
    residual = np.zeros(n_groups)
    active_group = np.bincount(index.node_group[reaches], minlength=n_groups) > 0
    plan = _Sweep.build(np.flatnonzero(reaches), dist, weights, b, index.node_group)
    x = value[plan.perm]
    active_row = np.ones(plan.order.size, dtype=bool)
    frozen = False  # some rows of ``plan`` belong to converged groups and must not move any more
    for _ in range(limit):
        if not active_group.any():
            break
        k = plan.order.size
        before = x[:k].copy()
        for a, z, w in plan.levels:
            update = plan.b[a:z] + gamma * (w @ x)
            x[a:z] = np.where(active_row[a:z], update, x[a:z]) if frozen else update
        change = np.abs(x[:k] - before)[plan.by_group]
        delta = np.zeros(n_groups)
        if k:
            delta[plan.group_ids] = np.maximum.reduceat(change, plan.group_starts)
        residual[active_group] = delta[active_group]
        sweeps[active_group] += 1
        active_group &= ~(delta < eps)
        active_row = active_group[plan.group]
        n_active = int(active_row.sum())
        frozen = n_active < k
        if n_active < k // 2:
            # Groups share no edges: drop converged groups' rows once they are the majority.
            value[plan.perm] = x
            plan = _Sweep.build(plan.order[active_row], dist, weights, b, index.node_group)
            x = value[plan.perm]
            active_row = np.ones(plan.order.size, dtype=bool)
            frozen = False
    value[plan.perm] = x
    return value, reaches, _propagation(index, u, v), sweeps, residual


def solve_values(
    nodes: pl.DataFrame,
    edges: pl.DataFrame,
    gamma: float = 0.99,
    eps: float = 1e-8,
    *,
    index: GraphIndex | None = None,
    step_rewards: str = "step",
) -> pl.DataFrame:
    """Values table (schemas VALUES) for every node of every group's graph; see the module docstring.

    ``index``: index_graph(nodes, edges) when the caller already has it. Rows in ``index.nodes`` order.
    ``step_rewards``: "step" (values from the outcomes alone) or "values" (r_e inside the backup).
    """
    index = index if index is not None else index_graph(nodes, edges)
    with np.errstate(over="ignore", invalid="ignore"):  # overflow is checked (and named) just below
        value, reaches, propagation, sweeps, residual = solve_index(index, gamma, eps, step_rewards)
    bad = np.flatnonzero(~np.isfinite(value))
    if bad.size:
        first = index.nodes.row(int(bad[0]), named=True)
        raise GraftError(
            f"solve: {bad.size} node value(s) are not finite (first: group {first['group_id']!r}, node "
            f"{first['node']}: {value[bad[0]]}); the edges' rewards or outcomes overflow float64"
        )
    return index.nodes.select("group_id", "node").with_columns(
        value=pl.Series(value, dtype=pl.Float64),
        reaches_end=pl.Series(reaches, dtype=pl.Boolean),
        propagation=pl.Series(propagation, dtype=pl.Int32),
        sweeps=pl.Series(sweeps[index.node_group], dtype=pl.Int32),
        residual=pl.Series(residual[index.node_group], dtype=pl.Float64),
    )
