"""A literal, loop-based transcription of GRAFT (paper Sec. 3, docs/design.md §4): the test reference.

Deliberately naive and independent of stages/: plain Python dicts, lists and sets, one step at a time.

* graph: φ(state) by first visit in (trajectory, step) order; one edge per step; an end per trajectory
  at the dst of its last step (dropped under "bootstrap" when cut and the node has out-edges).
* values: plain Gauss-Seidel, node by node, nodes sorted by reverse-BFS distance to the nearest end
  (ties by node id), V(u) = (1/n_u)[Σ_out γ V(dst) + Σ_ends R] ("step"; "values": r + γ V(dst) in
  the sum), nodes reaching no end stay 0.
* advantages: TD A_t = γ V(dst) − V(src) ("values": + r_t); Graph GAE with k-hop node sets N_k and
  raw edge instances E_k, for H_t = T − 1 − t hops ("literal") or until E_k is empty or (γλ)^k < 1e-6
  ("markov"); trajectory GAE; "step": + r_t after the GAE; node normalization (Eq. 11) with the
  single-edge rule and an optional std floor.
"""

from __future__ import annotations

import math
import statistics
from collections import deque


def reference_graph(rows: list[dict], truncation: str = "fail") -> dict:
    """rows: steps rows as dicts (in table order). Returns a dict with per-group graphs and row edges."""
    traj_first: dict[str, int] = {}
    for i, row in enumerate(rows):
        traj_first.setdefault(row["traj_id"], i)
    visit_order = sorted(range(len(rows)), key=lambda i: (traj_first[rows[i]["traj_id"]], rows[i]["step"]))
    phi: dict[str, dict[str, int]] = {}
    states: dict[str, list[str]] = {}
    for i in visit_order:
        row = rows[i]
        g = row["group_id"]
        phi.setdefault(g, {})
        states.setdefault(g, [])
        for key in (row["state"], row["next_state"]):
            if key not in phi[g]:
                phi[g][key] = len(phi[g])
                states[g].append(key)
    edges = []  # per row: (group, src, dst, reward)
    out: dict[str, dict[int, list[int]]] = {g: {} for g in phi}
    for i, row in enumerate(rows):
        g = row["group_id"]
        src, dst = phi[g][row["state"]], phi[g][row["next_state"]]
        edges.append((g, src, dst, row["reward"]))
        out[g].setdefault(src, []).append(i)
    last_step: dict[str, int] = {}
    for row in rows:
        last_step[row["traj_id"]] = max(last_step.get(row["traj_id"], -1), row["step"])
    ends: dict[str, dict[int, list[tuple[str, float]]]] = {g: {} for g in phi}
    for i, row in enumerate(rows):
        if row["step"] != last_step[row["traj_id"]]:
            continue
        g, _, dst, _ = edges[i]
        cut = row["truncated"] and not row["terminated"]
        if truncation == "bootstrap" and cut and len(out[g].get(dst, [])) > 0:
            continue
        ends[g].setdefault(dst, []).append((row["traj_id"], row["outcome"]))
    return {"phi": phi, "states": states, "edges": edges, "out": out, "ends": ends, "rows": rows}


def reference_values(graph: dict, gamma: float, eps: float = 1e-8, step_rewards: str = "step") -> dict:
    """Per group: {'V': {node: value}, 'reaches': {node: bool}, 'propagation': {node: int}, 'sweeps': k}."""
    result = {}
    for g, phi in graph["phi"].items():
        nodes = list(range(len(phi)))
        out = graph["out"][g]
        ends = graph["ends"][g]
        succ: dict[int, list[int]] = {u: [] for u in nodes}
        pred: dict[int, list[int]] = {u: [] for u in nodes}
        for u, row_ids in out.items():
            for i in row_ids:
                dst = graph["edges"][i][2]
                succ[u].append(dst)
                pred[dst].append(u)
        dist = {u: 0 for u in ends}
        queue = deque(sorted(ends))
        while queue:
            x = queue.popleft()
            for p in pred[x]:
                if p not in dist:
                    dist[p] = dist[x] + 1
                    queue.append(p)
        order = sorted(dist, key=lambda u: (dist[u], u))
        V = {u: 0.0 for u in nodes}
        k_max = (len(nodes) + 50) if gamma >= 1 else math.ceil(math.log(eps) / math.log(gamma)) + 50
        sweeps = 0
        for _ in range(k_max):
            sweeps += 1
            delta = 0.0
            for u in order:
                total, n_u = 0.0, 0
                for i in out.get(u, []):
                    _, _, dst, r = graph["edges"][i]
                    total += (r if step_rewards == "values" else 0.0) + gamma * V[dst]
                    n_u += 1
                for _traj, outcome in ends.get(u, []):
                    total += outcome
                    n_u += 1
                new = total / n_u
                delta = max(delta, abs(new - V[u]))
                V[u] = new
            if delta < eps:
                break
        propagation = {}
        for u in nodes:
            seen, stack, trajs = {u}, [u], set()
            while stack:
                x = stack.pop()
                for traj, _ in ends.get(x, []):
                    trajs.add(traj)
                for y in succ[x]:
                    if y not in seen:
                        seen.add(y)
                        stack.append(y)
            propagation[u] = len(trajs)
        result[g] = {
            "V": V,
            "reaches": {u: u in dist for u in nodes},
            "propagation": propagation,
            "sweeps": sweeps if order else 0,
        }
    return result


def reference_advantages(
    graph: dict,
    values: dict,
    gamma: float,
    lam: float,
    gae: str = "graph",
    normalize: str = "node",
    step_rewards: str = "step",
    gae_horizon: str = "literal",
    std_floor: float = 0.0,
) -> dict[str, list[float]]:
    """Per row (table order): 'td', 'gae', 'advantage', 'norm_group_size'."""
    rows, edges = graph["rows"], graph["edges"]
    td = []
    for g, src, dst, r in edges:
        V = values[g]["V"]
        td.append((r if step_rewards == "values" else 0.0) + gamma * V[dst] - V[src])
    decay = gamma * lam
    if decay >= 1.0:
        markov_hops = max(len(phi) for phi in graph["phi"].values())
    elif decay > 0.0:
        markov_hops = math.ceil(math.log(1e-6) / math.log(decay))
    else:
        markov_hops = 0
    length: dict[str, int] = {}
    by_traj: dict[str, dict[int, int]] = {}
    for i, row in enumerate(rows):
        length[row["traj_id"]] = max(length.get(row["traj_id"], 0), row["step"] + 1)
        by_traj.setdefault(row["traj_id"], {})[row["step"]] = i
    refined = []
    for i, row in enumerate(rows):
        g, _, dst, _ = edges[i]
        horizon = length[row["traj_id"]] - 1 - row["step"]
        if gae == "none":
            refined.append(td[i])
        elif gae == "trajectory":
            total = 0.0
            for k in range(horizon + 1):
                total += (gamma * lam) ** k * td[by_traj[row["traj_id"]][row["step"] + k]]
            refined.append(total)
        else:
            total = td[i]
            node_set = {dst}
            for k in range(1, (horizon if gae_horizon == "literal" else markov_hops) + 1):
                edge_rows = [j for u in node_set for j in graph["out"][g].get(u, [])]
                if not edge_rows:
                    break
                mean = sum(td[j] for j in edge_rows) / len(edge_rows)
                total += (gamma * lam) ** k * mean
                node_set = {edges[j][2] for j in edge_rows}
            refined.append(total)
    if step_rewards == "step":
        refined = [x + edges[i][3] for i, x in enumerate(refined)]
    groups: dict[tuple[str, int], list[int]] = {}
    for i, (g, src, _, _) in enumerate(edges):
        groups.setdefault((g, src), []).append(i)
    advantage = list(refined)
    size = [1] * len(rows)
    if normalize == "node":
        # docs/design.md §4: credit below 1000 x the solve tolerance (1e-8) is solver noise and counts as 0, and a
        # node whose edges' spread is below it has no spread
        noise = 1000 * 1e-8
        for members in groups.values():
            xs = [0.0 if abs(refined[i]) < noise else refined[i] for i in members]
            for i, x in zip(members, xs, strict=True):
                size[i] = len(members)
                if len(xs) == 1:
                    advantage[i] = x / (max(abs(x), std_floor) + 1e-6)
                elif statistics.stdev(xs) < noise:
                    advantage[i] = 0.0
                else:
                    spread = max(statistics.stdev(xs), std_floor)
                    advantage[i] = (x - statistics.fmean(xs)) / (spread + 1e-6)
    return {"td": td, "gae": refined, "advantage": advantage, "norm_group_size": size}
