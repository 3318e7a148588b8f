"""The ``graft`` estimator: TD on the graph, Graph GAE, node normalization (docs/design.md §4, paper Eq. 8-11).

Per steps row t (edge src -> dst in its group's graph, values V from stages.credit.bellman):

    TD (Eq. 8):          A_t = r_t + γ V(dst_t) − V(src_t)
    gae = "graph" (Eq. 9-10, literal):
                         A^GAE_t = A_t + Σ_{k=1..H_t} (γλ)^k Ā_{t,k},   H_t = T − 1 − t
                         N_0 = {dst_t},  E_k = all raw out-edge instances of the nodes in N_{k−1},
                         N_k = {dst(e) : e ∈ E_k} (a set),  Ā_{t,k} = mean of A over E_k;
                         the sum stops when E_k is empty.
    gae = "trajectory":  A^GAE_t = Σ_{k=0..H_t} (γλ)^k A_{t+k} along the row's own trajectory
                         (standard GAE with the graph as critic: λ = 0 gives TD, λ = γ = 1 gives
                         return − V(s_t)).
    gae = "none":        A^GAE_t = A_t
    normalize = "node" (Eq. 11): over the raw out-edge instances of each src node (n rows),
                         n ≥ 2: (x − mean) / (std_ddof1 + 1e-6);  n = 1: x / (|x| + 1e-6);
                         |x| < ZERO_TOL = 1000 ε (ε = 1e-8, the solve tolerance) counts as 0 first,
                         and a node whose std is below ZERO_TOL has zero spread (all its edges 0).
    normalize = "none":  advantage = A^GAE.

Known property (documented, tested): at the solve's fixed point, for every node u,
Σ_{e ∈ out(u)} A_e = Σ_e (r_e + γ V(dst_e)) − out(u) V(u) = n_u V(u) − Σ_{ends at u} R − out(u) V(u)
= −Σ_{ends at u} (R − V(u)). So over nodes without ends every k-hop sum is 0: the literal Graph GAE
equals TD except where some N_{k−1} holds a node that mixes ends and continuations (or a node that
reaches no end, whose V = 0 is not a Bellman fixed point when it carries step rewards).

Vectorization of Graph GAE: Ā_{t,k} depends on t only through the node set N_{k−1}, and
N_k = succ(N_{k−1}). So the distinct node sets the rows walk through are built once, depth by depth,
for all groups at once: a set is a bitset over its group's nodes, succ(S) and the sums
Σ_{u∈S} ΣA_out(u), Σ_{u∈S} out(u) come from per-group lookup tables indexed by 4-bit slices of the
bitset, and sets of one depth are deduplicated exactly by (group, bits). Each set gets
ratio(S) = Σ_{u∈S} ΣA_out(u) / Σ_{u∈S} out(u) (= the mean of A over the raw instances of E) and
next(S); then every row walks its chain of set ids for H_t hops with numpy gathers, all rows at once.
Groups over 2048 nodes use sparse boolean rows (scipy) instead of bitsets.

Shapes: n rows, m nodes over all groups.
"""

from __future__ import annotations

import math

import numpy as np
import polars as pl
import scipy.sparse as sp

from schemas.config import AdvantageConfig
from schemas.errors import GraftError
from stages.credit.advantage.registry import CreditInputs, CreditOutput, register
from stages.credit.bellman import GraphIndex, end_distance, gather_ranges, index_graph, sorted_unique

_NORM_EPS = 1e-6
# Credit below this magnitude is solver noise, not signal. The solve stops when max|ΔV| < ε (docs/design.md §4,
# ε = 1e-8); a Gauss–Seidel stop leaves each V within about εγ/(1 − γ) ≈ 99ε of the fixed point at
# γ = 0.99, and a TD (or a GAE sum of TDs) combines a few such values, so exact zeros come back as
# |x| ~ 1e-9 … 1e-6. Normalization would blow those up to ±0.001 … ±0.5 with an arbitrary sign.
SOLVE_TOL = 1e-8
NOISE_MULTIPLE = 1000
ZERO_TOL = NOISE_MULTIPLE * SOLVE_TOL  # 1e-5 in reward units


def td_residuals(
    index: GraphIndex, value: np.ndarray, gamma: float, step_rewards: str = "step"
) -> np.ndarray:
    """A_t = γ V(dst_t) − V(src_t) (Eq. 8; "values": r_t + γ V(dst_t) − V(src_t)) per edge row, shape (n,)."""
    td = gamma * value[index.dst] - value[index.src]
    return td + index.reward if step_rewards == "values" else td


def _single_bit_position(words: np.ndarray) -> np.ndarray:
    """Position (word * 64 + bit) of the only set bit of each row of a (k, W) uint64 bitset array."""
    word = np.argmax(words != 0, axis=1)
    value = words[np.arange(words.shape[0]), word]
    return word * 64 + np.bitwise_count(value - np.uint64(1)).astype(np.int64)


# Nibble tables per chunk of groups: bounded memory, and small enough to stay in cache (measured on
# 1M steps: 2 MiB chunks make the Graph GAE 2x faster than 128 MiB ones).
_TABLE_BYTES = 1 << 21


class _NibbleTables:
    """Per group and 4-bit slice ("nibble") of a node bitset: OR of successors, Σ ΣA_out, Σ out, min reach_next.

    Entry (group, nibble j, value x) holds the OR of the successor bitsets, the sum of ΣA_out and the
    sum of out-degrees of the nodes 4j + b for the bits b set in x, and the least ``reach_next`` among
    them (hops to the nearest node with non-zero ΣA_out by a walk of ≥ 1 hop). With them next(S),
    Σ_{u∈S} ΣA_out(u), Σ_{u∈S} out(u) and min_{u∈S} reach_next(u) of sets S given as (k, W) bitsets take
    16·W table gathers over all k sets at once, without listing the members (measured: faster than
    listing them, and than 8-bit slices).
    """

    bits = 4
    values = 1 << bits

    def __init__(
        self,
        succ: np.ndarray,
        num: np.ndarray,
        den: np.ndarray,
        reach: np.ndarray | None,
        group_row: np.ndarray,
        local: np.ndarray,
        n_groups: int,
        words: int,
    ):
        b, nv = self.bits, self.values
        nib = 64 // b * words
        self.nib, self.words = nib, words
        s4 = np.zeros((n_groups, nib, b, words), dtype=np.uint64)
        n4 = np.zeros((n_groups, nib, b))
        d4 = np.zeros((n_groups, nib, b))
        s4[group_row, local // b, local % b] = succ
        n4[group_row, local // b, local % b] = num
        d4[group_row, local // b, local % b] = den
        self.succ = np.zeros((n_groups, nib, nv, words), dtype=np.uint64)
        self.num = np.zeros((n_groups, nib, nv))
        self.den = np.zeros((n_groups, nib, nv))
        for val in range(1, nv):
            low = (val & -val).bit_length() - 1
            rest = val & (val - 1)
            self.succ[:, :, val] = self.succ[:, :, rest] | s4[:, :, low]
            self.num[:, :, val] = self.num[:, :, rest] + n4[:, :, low]
            self.den[:, :, val] = self.den[:, :, rest] + d4[:, :, low]
        self.reach = None if reach is None else self._min_table(reach, group_row, local, n_groups)
        # One contiguous 1-D table per word: 1-D gathers are several times faster than row gathers.
        self.succ_words = [np.ascontiguousarray(self.succ[..., w].reshape(-1)) for w in range(words)]
        del self.succ
        # Σ ΣA_out and Σ out side by side as one complex table: one 16-byte gather instead of two.
        self.num_den = (self.num + 1j * self.den).reshape(-1)
        del self.num, self.den

    def _min_table(
        self, reach: np.ndarray, group_row: np.ndarray, local: np.ndarray, n_groups: int
    ) -> np.ndarray:
        """Flat table of min reach over the nodes of each (group, nibble, value)."""
        b, nv = self.bits, self.values
        r4 = np.full((n_groups, self.nib, b), _FAR, dtype=np.int32)
        r4[group_row, local // b, local % b] = reach
        table = np.full((n_groups, self.nib, nv), _FAR, dtype=np.int32)
        for val in range(1, nv):
            low = (val & -val).bit_length() - 1
            table[:, :, val] = np.minimum(table[:, :, val & (val - 1)], r4[:, :, low])
        return table.reshape(-1)

    @classmethod
    def bytes_per_group(cls, words: int) -> int:
        return 64 // cls.bits * words * cls.values * (8 * words + 16)

    def apply(
        self, bits: np.ndarray, group_row: np.ndarray, need: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(expand, next bitsets of the rows ``expand``, Σ ΣA_out, Σ out) of sets ``bits`` (k, W) of
        ``group_row`` that serve ``need`` hops: a set is expanded only when it has a next hop to serve
        (need ≥ 2) and a member's successors reach a non-zero ΣA_out within it (min reach_next < need);
        otherwise every later set of its chain sums zeros, so its next is the empty set."""
        # Nibble j of the bitset is the low (j even) or high half of byte j // 2 of its little-endian
        # bytes: slicing uint8 bytes is several times cheaper than shifting uint64 words.
        octets = np.ascontiguousarray(bits, dtype="<u8").view(np.uint8)
        at = np.empty((bits.shape[0], self.nib), dtype=np.int64)
        np.bitwise_and(octets, 0xF, out=at[:, 0::2], casting="unsafe")
        np.right_shift(octets, 4, out=at[:, 1::2], casting="unsafe")
        at += (group_row * (self.nib * self.values))[:, None]
        at += np.arange(0, self.nib * self.values, self.values, dtype=np.int64)[None, :]
        both = self.num_den[at].sum(axis=1)
        num, den = both.real.copy(), both.imag.copy()
        expand = need >= 2
        if self.reach is not None:
            expand &= self.reach[at].min(axis=1) < need
        at = at[expand]
        nxt = np.empty((at.shape[0], self.words), dtype=np.uint64)
        for w, table in enumerate(self.succ_words):  # row-major gathers stay inside a group's table
            nxt[:, w] = np.bitwise_or.reduce(table[at], axis=1)
        return expand, nxt, num, den


# Interning across depths costs a dictionary look-up per distinct set; the early depths, where most
# chains still end on their own, are cheaper without it. Measured on 1M synthetic steps (Markov tail,
# best of 2 under load): from depth 1 3.9 s, 8 3.0 s, 16 2.3–2.5 s, 24 2.2 s, 48 2.4 s, never 4.3 s.
_INTERN_FROM_DEPTH = 20
_BITSET_MAX_WORDS = 32  # groups of up to 2048 nodes use bitsets; larger ones sparse rows
_FAR = np.iinfo(np.int32).max  # reach of a node from which no non-zero ΣA_out is reachable
_PRUNE_SETS_BELOW = 0.5  # prune sets by reach when under this share of the rows (H ≥ 1) walk


class _Chains:
    """The interned node sets: ratio per set id, and (set id -> next set id) assignments."""

    def __init__(
        self, sum_a: np.ndarray, out_deg: np.ndarray, reach: np.ndarray, reach_next: np.ndarray | None
    ):
        m = sum_a.size
        self.sum_a, self.out_deg = sum_a, out_deg
        self.reach, self.reach_next = reach, reach_next
        self.ratio_chunks = [np.divide(sum_a, out_deg, out=np.zeros(m), where=out_deg > 0)]
        self.assigned_ids: list[np.ndarray] = []
        self.assigned_next: list[np.ndarray] = []
        self.n_sets = m

    def record(self, frontier_ids: np.ndarray, next_ids: np.ndarray) -> None:
        self.assigned_ids.append(frontier_ids)
        self.assigned_next.append(next_ids)

    def add(self, num: np.ndarray, den: np.ndarray) -> np.ndarray:
        """New sets with these member sums; returns their ids."""
        self.ratio_chunks.append(np.divide(num, den, out=np.zeros(num.size), where=den > 0))
        ids = self.n_sets + np.arange(num.size, dtype=np.int64)
        self.n_sets += num.size
        return ids

    def finish(self) -> tuple[np.ndarray, np.ndarray, int]:
        """(ratio, next, EMPTY): EMPTY has ratio 0 and maps to itself; a set whose next was never
        computed maps to a poison set (ratio NaN), so a walk past the expansion depth shows as NaN."""
        empty, poison = self.n_sets, self.n_sets + 1
        ratio = np.concatenate([*self.ratio_chunks, [0.0, np.nan]])
        nxt = np.full(self.n_sets + 2, poison, dtype=np.int64)
        for ids, following in zip(self.assigned_ids, self.assigned_next, strict=True):
            nxt[ids] = np.where(following < 0, empty, following)
        nxt[empty] = empty
        return ratio, nxt, empty


def _dedupe(key: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(first row, inverse) of the distinct rows of a (k, w) uint64 array (exact byte comparison)."""
    key = np.ascontiguousarray(key)
    _, first, inverse = np.unique(
        key.view(np.dtype((np.void, key.shape[1] * 8))).ravel(), return_index=True, return_inverse=True
    )
    return first, inverse.ravel()


def _bitset_chains(
    chains: _Chains,
    index: GraphIndex,
    chunk: np.ndarray,
    words: int,
    u_all: np.ndarray,
    v_all: np.ndarray,
    pair_start: np.ndarray,
    need: np.ndarray,
    interned: dict[bytes, int] | None = None,
) -> None:
    """Expand the sets of the groups ``chunk`` (all of width ``words``) as bitsets over group nodes.

    ``interned`` (the Markov tail, where every start serves the same hops): sets are identified across
    depths too, so a set met again maps to its first id and is not expanded again -- the chains
    become a finite functional graph and a cycle costs its length, not the K hops of the walk. (Its
    first sighting served at least as many hops: every chain starts with the same need.)

    ``need`` (m,): hops the chain of each singleton {w} must serve (see ``_singleton_needs``); a set
    is expanded only while some row still walks through it and a member reaches a non-zero ΣA_out
    within the hops it serves (``chains.reach``); else its next is the empty set (exactly: every later
    set of the chain holds only nodes with ΣA_out = 0).

    ``pair_start`` (m + 1,): the distinct (u, v) pairs, sorted by u, of node u are
    ``u_all[pair_start[u]:pair_start[u + 1]]`` (nodes are group-contiguous, so a chunk's pairs are
    gathered by ranges, without scanning all pairs).
    """
    group_row = np.full(index.groups.len(), -1, dtype=np.int64)
    group_row[chunk] = np.arange(chunk.size)
    nodes = gather_ranges(index.offsets, chunk)  # global ids of the chunk's nodes, by group
    pos = gather_ranges(pair_start, nodes)
    lu = np.searchsorted(nodes, u_all[pos])  # row of u within the chunk (nodes is sorted)
    gv = v_all[pos]
    lv = gv - index.offsets[index.node_group[gv]]
    succ = np.zeros((nodes.size, words), dtype=np.uint64)
    np.bitwise_or.at(succ, (lu, lv // 64), np.left_shift(np.uint64(1), (lv % 64).astype(np.uint64)))
    node_local = nodes - index.offsets[index.node_group[nodes]]
    tables = _NibbleTables(
        succ,
        chains.sum_a[nodes],
        chains.out_deg[nodes],
        None if chains.reach_next is None else chains.reach_next[nodes],
        group_row[index.node_group[nodes]],
        node_local,
        chunk.size,
        words,
    )
    # Depth 0: the singletons that need a next set; next({w}) = succ(w).
    start = need[nodes] >= 2
    if chains.reach_next is not None:
        start &= chains.reach_next[nodes] < need[nodes]
    dead = nodes[(need[nodes] >= 2) & ~start]
    chains.record(dead, np.full(dead.size, -1, dtype=np.int64))
    frontier_ids, bits = nodes[start], succ[start]
    group, frontier_need = index.node_group[frontier_ids], need[frontier_ids]
    depth = 0
    while frontier_ids.size:
        depth += 1
        want = frontier_need - 1  # hops the next set must still serve
        count = np.bitwise_count(bits).sum(axis=1)
        ids = np.full(frontier_ids.size, -1, dtype=np.int64)  # -1: the empty set
        single = count == 1  # {w}: w's own chain serves it (see _singleton_needs)
        ids[single] = index.offsets[group[single]] + _single_bit_position(bits[single])
        ids[single & (chains.reach[np.maximum(ids, 0)] >= want)] = -1  # nothing non-zero left ahead
        fresh = np.flatnonzero(count >= 2)
        if fresh.size:
            keys = np.ascontiguousarray(
                np.concatenate([group[fresh, None].astype(np.uint64), bits[fresh]], axis=1)
            )
            first, inverse = _dedupe(keys)
            new_need = np.zeros(first.size, dtype=np.int64)
            np.maximum.at(new_need, inverse, want[fresh])
            if interned is None or depth < _INTERN_FROM_DEPTH:
                ids[fresh] = chains.n_sets + inverse
            else:  # a set met at an earlier depth keeps its id (and its chain): cycles close
                slot = np.fromiter(
                    (interned.get(keys[i].tobytes(), -1) for i in first), dtype=np.int64, count=first.size
                )
                new = slot < 0
                slot[new] = chains.n_sets + np.arange(int(new.sum()))
                ids[fresh] = slot[inverse]
                for i, set_id in zip(first[new].tolist(), slot[new].tolist(), strict=True):
                    interned[keys[i].tobytes()] = set_id
                first, new_need = first[new], new_need[new]
        chains.record(frontier_ids, ids)
        if not fresh.size or not first.size:
            return
        new_bits = np.ascontiguousarray(bits[fresh[first]])
        new_group = group[fresh[first]]
        expand, following, num, den = tables.apply(new_bits, group_row[new_group], new_need)
        new_ids = chains.add(num, den)
        dead = new_ids[(new_need >= 2) & ~expand]
        chains.record(dead, np.full(dead.size, -1, dtype=np.int64))
        frontier_ids, bits = new_ids[expand], following
        group, frontier_need = new_group[expand], new_need[expand]


def _row_hashes(mat: sp.csr_matrix, keys: np.ndarray) -> np.ndarray:
    """Σ keys[j] over the columns j of each row (uint64, wrapping): an order-free set hash."""
    cs = np.concatenate([np.zeros(1, dtype=np.uint64), np.cumsum(keys[mat.indices], dtype=np.uint64)])
    return cs[mat.indptr[1:]] - cs[mat.indptr[:-1]]


def _sparse_chains(chains: _Chains, nodes: np.ndarray, adj: sp.csr_matrix, depth: int) -> None:
    """Expand the sets of very large groups as sparse rows (sets told apart by a 128-bit hash)."""
    rng = np.random.default_rng(0x6A0F7)
    key1 = rng.integers(0, 2**64 - 1, size=adj.shape[0], dtype=np.uint64, endpoint=True)
    key2 = rng.integers(0, 2**64 - 1, size=adj.shape[0], dtype=np.uint64, endpoint=True)
    frontier_ids, product = nodes, adj[nodes]  # next({w}) = successors of w
    for d in range(depth):
        product.sum_duplicates()
        product.data[:] = 1.0
        size = np.diff(product.indptr)
        ids = np.full(frontier_ids.size, -1, dtype=np.int64)
        single = size == 1
        ids[single] = product.indices[product.indptr[:-1][single]]
        multi = np.flatnonzero(size >= 2)
        if multi.size:
            sub = product[multi]
            first, inverse = _dedupe(np.stack([_row_hashes(sub, key1), _row_hashes(sub, key2)], axis=1))
            ids[multi] = chains.n_sets + inverse
        chains.record(frontier_ids, ids)
        if not multi.size:
            return
        members = product[multi[first]]
        frontier_ids = chains.add(members @ chains.sum_a, members @ chains.out_deg)
        if d + 1 >= depth:
            return
        product = members @ adj


def _singleton_needs(index: GraphIndex, horizon: np.ndarray) -> np.ndarray:
    """Hops R(w) the chain starting at singleton {w} must serve: max H over rows with dst w, shape (m,).

    This also covers every set a walk passes through: a row r (step t, horizon H) reaching N_d at hop d
    has its own trajectory's node s_{t+1+d} in N_d (a trajectory is a walk on the graph), and the row
    at step t + d, whose dst that node is, has horizon H - d -- exactly the hops r still needs from
    N_d. So a one-member next set {w} can always use w's own chain, and a set is needed for at most
    max R over the rows that reach it.
    """
    need = np.zeros(index.n_nodes, dtype=np.int64)
    starts = horizon >= 1
    np.maximum.at(need, index.dst[starts], horizon[starts])
    return need


def _set_chains(
    index: GraphIndex,
    sum_a: np.ndarray,
    out_deg: np.ndarray,
    need: np.ndarray,
    reach: np.ndarray,
    prune_sets: bool,
    intern_sets: bool = False,
) -> tuple[np.ndarray, np.ndarray, int]:
    """Intern the node sets N_k the rows walk; return (ratio, next, EMPTY id).

    Set ids 0..m-1 are the singletons {w}; EMPTY (after the last set) is the empty set with ratio 0
    and next EMPTY; ratio(S) = Σ_{u∈S} ΣA_out(u) / Σ_{u∈S} out(u). Sets are bitsets over their group's
    nodes (groups bucketed by word count, so a large group does not widen the others, and chunked to
    keep the tables in cache; groups over 2048 nodes use sparse rows instead) and identified exactly by
    (group, bits) within a depth; they are not interned across depths (measured: under 5% of a
    depth's sets recur at another depth). A set is expanded only while a row still walks through it
    and can still meet a non-zero ΣA_out (``reach``: hops from each node to the nearest such node; a
    one-member set always, larger sets only with ``prune_sets``); a next that was never computed maps
    to a poison set (ratio NaN).
    """
    m = index.n_nodes
    sizes = np.diff(index.offsets)
    width = np.maximum((sizes + 63) // 64, 1)  # 64-bit words per group bitset
    u_all, v_all = _node_pairs(index)
    pair_start = np.searchsorted(u_all, np.arange(m + 1))
    depth = int(need.max(initial=0)) - 1
    # reach_next(u): hops from u to a non-zero ΣA_out by a walk of at least one hop (what next({u}) and
    # later sets can still meet)
    reach_next = None
    if prune_sets:
        reach_next = np.full(m, _FAR, dtype=np.int64)
        np.minimum.at(reach_next, u_all, reach[v_all].astype(np.int64) + 1)
        reach_next = np.minimum(reach_next, _FAR).astype(np.int32)
    chains = _Chains(sum_a, out_deg, reach, reach_next)
    for words in np.unique(width).tolist():
        bucket = np.flatnonzero(width == words)
        if words > _BITSET_MAX_WORDS:
            adj = sp.csr_matrix((np.ones(u_all.size), (u_all, v_all)), shape=(m, m))
            nodes = np.flatnonzero(width[index.node_group] == words)
            _sparse_chains(chains, nodes, adj, depth)
            continue
        step = max(1, _TABLE_BYTES // _NibbleTables.bytes_per_group(words))
        for chunk in np.split(bucket, np.arange(step, bucket.size, step)):
            interned: dict[bytes, int] | None = {} if intern_sets else None
            _bitset_chains(chains, index, chunk, words, u_all, v_all, pair_start, need, interned)
    return chains.finish()


def _node_pairs(index: GraphIndex) -> tuple[np.ndarray, np.ndarray]:
    """Distinct (u, v) edges between global nodes, sorted by u then v."""
    m = index.n_nodes
    pairs = sorted_unique(index.src * m + index.dst)
    return pairs // m, pairs % m


def nonzero_reach(index: GraphIndex, sum_a: np.ndarray) -> np.ndarray:
    """Hops from each node to the nearest node u with ΣA_out(u) ≠ 0 (0 at such a node), shape (m,).

    Multi-source BFS on the reversed graph; ``_FAR`` where no such node is reachable.
    """
    u, v = _node_pairs(index)
    dist = end_distance(index.n_nodes, u, v, (sum_a != 0).astype(np.int64))
    return np.where(dist >= 0, dist, _FAR).astype(np.int32)


def graph_gae(index: GraphIndex, td: np.ndarray, horizon: np.ndarray, gamma: float, lam: float) -> np.ndarray:
    """Literal Graph GAE (Eq. 9-10) for every row; see the module docstring. Shapes (n,).

    Only rows that can meet a non-zero ΣA_out walk: N_{k-1} holds exactly the nodes k − 1 hops from
    dst_t, so when every node within H_t − 1 hops of dst_t has ΣA_out = 0 every Ā_{t,k} is a sum of
    zeros and A^GAE_t = A_t exactly (reach(dst_t) ≥ H_t, with ``nonzero_reach``). The sets of the rows
    that walk are expanded only while some member can still meet such a node.
    """
    out = td.astype(np.float64).copy()
    decay = gamma * lam
    max_h = int(horizon.max(initial=0))
    if decay == 0.0 or max_h == 0:
        return out
    m = index.n_nodes
    out_deg = index.out_edges.astype(np.float64)
    sum_a = np.bincount(index.src, weights=td, minlength=m)
    reach = nonzero_reach(index, sum_a)
    walks = reach[index.dst] < horizon
    if not walks.any():
        return out
    # Pruning sets costs a table gather per depth; it pays only when many rows stay at A_t (measured on
    # 1M synthetic steps with the solver's 1e-8 tolerance: ~30% of nodes carry a non-zero ΣA_out of
    # solver noise, 90% of rows meet one, and pruning sets made the Graph GAE 25% slower).
    prune_sets = walks.sum() < _PRUNE_SETS_BELOW * np.count_nonzero(horizon)
    horizon = np.where(walks, horizon, 0)  # rows that stay at A_t walk no hop
    need = _singleton_needs(index, horizon)
    acc, rows = _walk(index, sum_a, out_deg, need, horizon, decay, reach, prune_sets)
    if np.isnan(acc).any():
        # A walk left the expanded sets: only possible when trajectories are not walks on the graph
        # (an unvalidated table whose next_state differs from the next state). Expand everything.
        full = np.full(index.n_nodes, int(horizon.max()))
        acc, rows = _walk(index, sum_a, out_deg, full, horizon, decay, reach, prune_sets)
    out[rows] += acc
    return out


def _walk(
    index: GraphIndex,
    sum_a: np.ndarray,
    out_deg: np.ndarray,
    need: np.ndarray,
    horizon: np.ndarray,
    decay: float,
    reach: np.ndarray,
    prune_sets: bool,
) -> tuple[np.ndarray, np.ndarray]:
    """Σ_{k=1..H} decay^k ratio(N_{k-1}) per row (rows in the returned order; NaN: a set not expanded)."""
    ratio, nxt, empty = _set_chains(index, sum_a, out_deg, need, reach, prune_sets)
    rows = np.flatnonzero(horizon >= 1)
    return walk_chains(index.dst[rows], horizon[rows], ratio, nxt, empty, decay), rows


def walk_chains(
    start: np.ndarray, horizon: np.ndarray, ratio: np.ndarray, nxt: np.ndarray, empty: int, decay: float
) -> np.ndarray:
    """Σ_{k=1..H_i} decay^k ratio(S_{i,k-1}) for chains S_{i,0} = start_i, S_{i,k} = nxt[S_{i,k-1}], shape (k,).

    Walks all chains together, one gather per hop; a chain leaves the walk when its horizon is spent
    or it reaches the empty set (ratio 0, its own next), so long horizons cost only while sets remain.
    """
    acc = np.zeros(start.size)
    alive = np.flatnonzero((horizon >= 1) & (start != empty))
    cur = start[alive].astype(np.int64)
    left = horizon[alive].astype(np.int64)
    coef = 1.0
    while alive.size:
        coef *= decay
        acc[alive] += coef * ratio[cur]
        left -= 1
        cur = nxt[cur]
        keep = (left >= 1) & (cur != empty)
        if not keep.all():
            alive, cur, left = alive[keep], cur[keep], left[keep]
    return acc


# Markov Graph GAE stops its tail where (γλ)^k falls below this: the terms left are bounded by
# (γλ)^K / (1 − γλ) · max |Ā|, under 2e-5 of the largest mean TD at γλ = 0.99 · 0.95.
MARKOV_TAIL_TOL = 1e-6


def markov_hops(decay: float, largest_group: int) -> int:
    """Hops K of the Markov tail: ⌈log tol / log γλ⌉, or the largest group's node count when γλ = 1
    (γ = 1 needs acyclic graphs, where every walk ends within m_g − 1 hops)."""
    if decay >= 1.0:
        return max(int(largest_group), 1)
    return max(1, math.ceil(math.log(MARKOV_TAIL_TOL) / math.log(decay)))


def markov_graph_gae(index: GraphIndex, td: np.ndarray, gamma: float, lam: float) -> np.ndarray:
    """Markov Graph GAE (Eq. 9-10 with an edge-only horizon) for every row, shape (n,).

    A^GAE_t = A_t + T(dst_t),  T(w) = Σ_{k≥1} (γλ)^k Ā_k(w),  N_0 = {w}: the tail is a function of
    the edge's destination node, not of the turn index, so identical (state, action, next_state)
    rows get identical credit. The sum runs until E_k is empty (an acyclic part ends by itself) and
    is cut at K = ``markov_hops`` hops where a cycle keeps it going. Per-node sums ΣA_out below
    ZERO_TOL count as 0 (solver noise: at the fixed point they are exactly 0 at every node without
    ends), so only nodes that can reach a mixed node (ends and continuations) walk; the walk runs
    over distinct destination nodes, not rows.
    """
    out = td.astype(np.float64).copy()
    decay = gamma * lam
    if decay == 0.0 or td.size == 0:
        return out
    m = index.n_nodes
    out_deg = index.out_edges.astype(np.float64)
    sum_a = np.bincount(index.src, weights=td, minlength=m)
    sum_a = np.where(np.abs(sum_a) < ZERO_TOL, 0.0, sum_a)
    reach = nonzero_reach(index, sum_a)
    hops = markov_hops(decay, int(np.diff(index.offsets).max()))
    starts = sorted_unique(index.dst[reach[index.dst] < hops])
    if starts.size == 0:
        return out
    need = np.zeros(m, dtype=np.int64)
    need[starts] = hops
    ratio, nxt, empty = _set_chains(index, sum_a, out_deg, need, reach, prune_sets=True, intern_sets=True)
    tail = walk_chains(starts, np.full(starts.size, hops), ratio, nxt, empty, decay)
    if np.isnan(tail).any():  # trajectories that are not walks on the graph: expand every node
        need = np.full(m, hops, dtype=np.int64)
        ratio, nxt, empty = _set_chains(index, sum_a, out_deg, need, reach, prune_sets=True, intern_sets=True)
        tail = walk_chains(starts, np.full(starts.size, hops), ratio, nxt, empty, decay)
    per_node = np.zeros(m)
    per_node[starts] = tail
    return out + per_node[index.dst]


def trajectory_gae(
    td: np.ndarray, traj: np.ndarray, step: np.ndarray, gamma: float, lam: float
) -> np.ndarray:
    """A^GAE_t = Σ_{k=0..H_t} (γλ)^k A_{t+k} along each trajectory (g_t = A_t + γλ g_{t+1})."""
    n = td.size
    out = td.astype(np.float64).copy()
    if n == 0:
        return out
    order = np.lexsort((step, traj))
    has_next = np.zeros(n, dtype=bool)
    has_next[order[:-1]] = traj[order[:-1]] == traj[order[1:]]
    nxt = np.full(n, -1, dtype=np.int64)
    nxt[order[:-1]] = order[1:]
    by_step = np.argsort(step, kind="stable")
    bounds = np.flatnonzero(np.diff(step[by_step])) + 1
    decay = gamma * lam
    for rows in reversed(np.split(by_step, bounds)):
        rows = rows[has_next[rows]]
        out[rows] = td[rows] + decay * out[nxt[rows]]
    return out


def node_normalize(
    x: np.ndarray, src: np.ndarray, m: int, zero_tol: float = ZERO_TOL, std_floor: float = 0.0
) -> tuple[np.ndarray, np.ndarray]:
    """Eq. 11 over the raw out-edge instances of each src node; returns (advantage, group size).

    n ≥ 2: (x − mean) / (max(std_ddof1, floor) + 1e-6);  n = 1: x / (max(|x|, floor) + 1e-6).
    Solver noise stays 0: values with |x| < ``zero_tol`` (= 1000 × the solve tolerance 1e-8) count as
    exactly 0 first, and a node whose edges' spread (std_ddof1) is below ``zero_tol`` has zero spread,
    so all its edges get 0. ``std_floor`` (reward units, 0 = the paper's rule) keeps near-ties small:
    a node whose edges differ by 0.01 is not stretched to ±1 when the floor is 1.
    """
    x = np.where(np.abs(x) < zero_tol, 0.0, x)
    count = np.bincount(src, minlength=m)
    mean = np.bincount(src, weights=x, minlength=m) / np.maximum(count, 1)
    dev = x - mean[src]
    var = np.bincount(src, weights=dev * dev, minlength=m) / np.maximum(count - 1, 1)
    n = count[src]
    spread = np.sqrt(var)[src]
    multi = np.where(spread < zero_tol, 0.0, dev / (np.maximum(spread, std_floor) + _NORM_EPS))
    single = x / (np.maximum(np.abs(x), std_floor) + _NORM_EPS)
    return np.where(n >= 2, multi, single), n.astype(np.int32)


def batch_normalize(x: np.ndarray, src: np.ndarray, m: int, zero_tol: float = ZERO_TOL) -> np.ndarray:
    """Centred per src node, scaled by the batch: dev / (std_ddof1(dev over all rows) + 1e-6).

    dev = x − mean over the node's out-edge instances (n ≥ 2), or x itself at a single-edge node
    (centring would erase its sign, which Eq. 11's single-edge rule keeps). One scale for the whole
    batch, so a node's near-ties stay as small as they are next to other nodes' real differences.
    """
    x = np.where(np.abs(x) < zero_tol, 0.0, x)
    count = np.bincount(src, minlength=m)
    mean = np.bincount(src, weights=x, minlength=m) / np.maximum(count, 1)
    dev = np.where(count[src] >= 2, x - mean[src], x)
    if dev.size < 2:
        return dev
    scale = float(np.std(dev, ddof=1))
    return np.zeros_like(dev) if scale < zero_tol else dev / (scale + _NORM_EPS)


def horizons(edges: pl.DataFrame) -> np.ndarray:
    """H_t = T − 1 − t per row (T = steps of the row's trajectory)."""
    return edges.select(h=(pl.col("step").max().over("traj_id") - pl.col("step")).cast(pl.Int64))[
        "h"
    ].to_numpy()


def graft_credit(
    index: GraphIndex,
    value: np.ndarray,
    edges: pl.DataFrame,
    gamma: float,
    lam: float,
    gae: str = "graph",
    normalize: str = "node",
    *,
    step_rewards: str = "step",
    gae_horizon: str = "literal",
    node_std_floor: float = 0.0,
) -> CreditOutput:
    """GRAFT credit for every edge row (arrays aligned with ``edges``).

    ``step_rewards = "step"``: TD A_t = γV(dst) − V(src) (Eq. 8), and the credit before normalization
    is A^GAE_t + r_t -- the step's own reward (invalid penalty) enters its own credit only, after the
    GAE tail (so no other step's credit carries it) and before normalization (so at a node an invalid
    edge ranks below the valid ones whatever the scale of the values). ``"values"``: the earlier
    reading, TD r_t + γV(dst) − V(src) with r inside V, nothing added after.
    """
    td = td_residuals(index, value, gamma, step_rewards)
    if gae == "graph":
        if gae_horizon == "markov":
            refined = markov_graph_gae(index, td, gamma, lam)
        elif gae_horizon == "literal":
            refined = graph_gae(index, td, horizons(edges), gamma, lam)
        else:
            raise GraftError(f"advantage.gae_horizon must be 'markov' or 'literal', got {gae_horizon!r}")
    elif gae == "trajectory":
        traj = edges["traj_id"].rank("dense").to_numpy().astype(np.int64)
        refined = trajectory_gae(td, traj, edges["step"].to_numpy().astype(np.int64), gamma, lam)
    elif gae == "none":
        refined = td.copy()
    else:
        raise GraftError(f"advantage.gae must be 'graph', 'trajectory' or 'none', got {gae!r}")
    if step_rewards == "step":
        refined = refined + index.reward
    if normalize == "node":
        advantage, size = node_normalize(refined, index.src, index.n_nodes, std_floor=node_std_floor)
    elif normalize == "batch":
        advantage = batch_normalize(refined, index.src, index.n_nodes)
        size = np.full(td.size, td.size, dtype=np.int32)
    elif normalize == "none":
        advantage, size = refined.copy(), np.ones(td.size, dtype=np.int32)
    else:
        raise GraftError(f"advantage.normalize must be 'node', 'batch' or 'none', got {normalize!r}")
    return CreditOutput(advantage=advantage, norm_group_size=size, td=td, gae=refined)


def node_values(index: GraphIndex, values: pl.DataFrame) -> np.ndarray:
    """V per global node from a values table (the graph's node numbering), shape (m,)."""
    known = values.filter(pl.col("group_id").is_in(index.groups.implode()))
    code = known["group_id"].cast(pl.Enum(index.groups)).to_physical().to_numpy().astype(np.int64)
    node = known["node"].to_numpy().astype(np.int64)
    size = np.diff(index.offsets)[code]
    ok = (node >= 0) & (node < size)
    out = np.full(index.n_nodes, np.nan)
    out[index.offsets[code[ok]] + node[ok]] = known["value"].to_numpy()[ok]
    missing = np.flatnonzero(np.isnan(out))
    if missing.size:
        first = int(missing[0])
        group = int(index.node_group[first])
        raise GraftError(
            f"values table has no value for group '{index.groups[group]}' node {first - int(index.offsets[group])}"
        )
    return out


@register("graft")
def graft_estimator(inputs: CreditInputs, config: AdvantageConfig) -> CreditOutput:
    """GRAFT: A_t = γV(dst) − V(src) (Eq. 8), Graph GAE (Eq. 9-10), node normalization (Eq. 11).

    Uses ``inputs.edges``/``nodes``/``values`` (graph and solve outputs), ``inputs.step_rewards`` and
    ``config.gae``, ``gae_horizon``, ``lam``, ``normalize``, ``node_std_floor``; see the module
    docstring for the exact definitions and the known property of Graph GAE at the fixed point.
    """
    if inputs.values is None:
        raise GraftError("estimator 'graft' needs the values table (run graft solve first)")
    index = inputs.index if inputs.index is not None else index_graph(inputs.nodes, inputs.edges)
    value = node_values(index, inputs.values)
    return graft_credit(
        index,
        value,
        inputs.edges,
        inputs.gamma,
        config.lam,
        config.gae,
        config.normalize,
        step_rewards=inputs.step_rewards,
        gae_horizon=config.gae_horizon,
        node_std_floor=config.node_std_floor,
    )
