"""The learning benchmark's Markdown tables: training success by iteration, held-out success,
per-seed runs, improvement over the warm start, per task type, graph diagnostics and the credit each
kind of turn gets.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import polars as pl

from bench.learning.runs import held_out, run_tables
from bench.learning.stats import mean_with_se, oracle_shares, paired_differences, paired_verdict
from stages.observe.report import training_curve


def success_table(runs: dict[str, list[Path]], every: int) -> tuple[str, dict[str, np.ndarray]]:
    """Markdown: rows = iteration, columns = variant, cells = mean ± std over seeds of training success."""

    curves: dict[str, np.ndarray] = {}
    for variant, dirs in runs.items():
        per_seed = []
        for d in dirs:
            c = training_curve(run_tables(d).metrics, "success_rate")
            per_seed.append(c["value"].to_numpy())
        n = min(len(c) for c in per_seed)
        curves[variant] = np.stack([c[:n] for c in per_seed])  # (seeds, iterations)
    n_iter = min(c.shape[1] for c in curves.values())
    rows = sorted(set(range(0, n_iter, every)) | {n_iter - 1})
    header = "| iteration | " + " | ".join(curves) + " |"
    lines = [header, "|" + "---|" * (len(curves) + 1)]
    for i in rows:
        cells = [
            f"{c[:, i].mean():.3f} ± {c[:, i].std(ddof=1) if c.shape[0] > 1 else 0.0:.3f}"
            for c in curves.values()
        ]
        lines.append(f"| {i} | " + " | ".join(cells) + " |")
    last = min(5, n_iter)

    def mean_se(per_seed: np.ndarray) -> str:  # mean ± standard error over seeds
        se = per_seed.std(ddof=1) / np.sqrt(len(per_seed)) if len(per_seed) > 1 else 0.0
        return f"{per_seed.mean():.3f} ± {se:.3f}"

    cells = [mean_se(c[:, -last:].mean(axis=1)) for c in curves.values()]
    lines.append(f"| mean of last {last} (± s.e.) | " + " | ".join(cells) + " |")
    cells = [mean_se(c[:, :n_iter].mean(axis=1)) for c in curves.values()]
    lines.append("| mean over all iterations (± s.e.) | " + " | ".join(cells) + " |")
    return "\n".join(lines), curves


def eval_table(runs: dict[str, list[Path]]) -> str:
    """Markdown: held-out success of the initial and the last evaluated policy per variant, each the
    mean over seeds ± its standard error (over seeds when there are several; one seed: the binomial
    s.e. of that run's episodes, ``stages.observe.report.success_standard_error``), the change last −
    initial paired by seed, the episodes per evaluation and the s.e. of one evaluation (the root mean
    square of the runs' binomial s.e. of the last evaluation: the eval's own sampling noise)."""
    from stages.observe.report import success_standard_error

    lines = [
        "| variant | episodes per evaluation | eval success, initial | eval success, last (updates) "
        "| last − initial, paired | s.e. of one evaluation |",
        "|---|---|---|---|---|---|",
    ]
    for variant, dirs in runs.items():
        points = [h for d in dirs if (h := held_out(d)) is not None]
        if not points:
            continue
        first = np.array([h["initial"] for h in points])
        last = np.array([h["last"] for h in points])
        one = [success_standard_error(h["last"], h["last_episodes"]) for h in points]
        noise = float(np.sqrt(np.mean(np.square(one))))
        one_first = success_standard_error(points[0]["initial"], points[0]["initial_episodes"])
        cells = [
            mean_with_se(first, one_first),
            mean_with_se(last, one[0]),
            mean_with_se(last - first, float(np.hypot(one_first, one[0]))),
        ]
        counts = sorted(
            {int(h[k]) for h in points for k in ("initial_episodes", "last_episodes") if h[k] == h[k]}
        )
        updates = int(max(h["x"] for h in points))
        text = [f"{m:.3f} ± {se:.3f}" for m, se in cells]
        lines.append(
            f"| {variant} | {'/'.join(map(str, counts)) or '-'} | {text[0]} | {text[1]} ({updates}) | "
            f"{'+' if cells[2][0] >= 0 else ''}{text[2]} | {noise:.3f} |"
        )
    return "\n".join(lines)


def per_seed_table(curves: dict[str, np.ndarray], runs: dict[str, list[Path]]) -> str:
    """Markdown: every run on its own row: AUC (mean training success over all iterations), mean of
    the last 5 iterations, and held-out success initial → last ± its binomial s.e. (episodes)."""
    from stages.observe.report import success_standard_error

    lines = [
        "| variant | seed run | AUC | last 5 | held-out initial | held-out last ± s.e. (episodes) |",
        "|---|---|---|---|---|---|",
    ]
    for variant, c in curves.items():
        for row, run_dir in zip(c, runs[variant], strict=False):
            h = held_out(run_dir)
            if h is None:
                ev = "- | -"
            else:
                se = success_standard_error(h["last"], h["last_episodes"])
                ev = f"{h['initial']:.3f} | {h['last']:.3f} ± {se:.3f} ({h['last_episodes']:.0f})"
            lines.append(f"| {variant} | {run_dir.name} | {row.mean():.3f} | {row[-5:].mean():.3f} | {ev} |")
    return "\n".join(lines)


def improvement_table(curves: dict[str, np.ndarray]) -> str:
    """Markdown: does RL improve the warm start? Per variant, the share of runs whose mean training
    success over the last 5 iterations is above its iteration 0, and the mean change; with a
    ``frozen`` control (same seeds, no update), also the last-5 difference to it, paired by seed (every
    variant of a seed draws the same tasks in the same iteration, so this removes the task draw)."""
    control = curves.get("frozen")
    head = "| variant | runs with last-5 mean > iteration 0 | mean of (last 5 − iteration 0) ± s.e. |"
    rule = "|---|---|---|"
    if control is not None:
        head += " last 5 − frozen's last 5, paired ± s.e. | runs above frozen |"
        rule += "---|---|"
    lines = [head, rule]

    def mean_se(x: np.ndarray) -> str:
        se = x.std(ddof=1) / np.sqrt(len(x)) if len(x) > 1 else 0.0
        return f"{x.mean():+.3f} ± {se:.3f}"

    for variant, c in curves.items():
        delta = c[:, -5:].mean(axis=1) - c[:, 0]
        row = f"| {variant} | {int((delta > 0).sum())} of {len(delta)} | {mean_se(delta)} |"
        if control is not None:
            n = min(len(c), len(control))
            paired = c[:n, -5:].mean(axis=1) - control[:n, -5:].mean(axis=1)
            row += f" {mean_se(paired)} | {int((paired > 0).sum())} of {n} |"
        lines.append(row)
    return "\n".join(lines)


def final_eval_by_type(runs: dict[str, list[Path]]) -> str:
    """Markdown (the paper's Table 1 columns): held-out success per task type of the last evaluated
    policy, mean ± s.e. over seeds."""

    per_variant: dict[str, dict[str, list[float]]] = {}
    for variant, dirs in runs.items():
        for d in dirs:
            ev = run_tables(d).eval.filter(pl.col("name") == "success_rate")
            if ev.height == 0:
                continue
            last = ev.filter(pl.col("x") == ev["x"].max())
            for row in last.iter_rows(named=True):
                key = row["task_type"] or "all"
                per_variant.setdefault(variant, {}).setdefault(key, []).append(row["value"])
    types = sorted({t for v in per_variant.values() for t in v if t != "all"}) + ["all"]
    lines = ["| variant | " + " | ".join(types) + " |", "|---|" + "---|" * len(types)]
    for variant, by_type in per_variant.items():
        cells = []
        for t in types:
            xs = np.array(by_type.get(t, []))
            se = xs.std(ddof=1) / np.sqrt(len(xs)) if len(xs) > 1 else 0.0
            cells.append(f"{xs.mean():.2f} ± {se:.2f}" if len(xs) else "-")
        lines.append(f"| {variant} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def diagnostics_table(runs: dict[str, list[Path]]) -> str:
    """Markdown: graph structure and rollout validity per variant, mean over seeds and iterations
    (what step credit had to work with: node group sizes, share of steps in node groups >= 2,
    propagation degree, invalid rate, mean turns)."""

    names = {
        ("graph", "mean_node_group_size"): "node group size",
        ("graph", "share_steps_group_ge2"): "steps in groups ≥ 2",
        ("solve", "propagation_mean"): "propagation degree",
        ("solve", "share_steps_propagation_1"): "steps with propagation 1",
        ("rollout", "invalid_rate"): "invalid rate",
        ("rollout", "mean_turns"): "mean turns",
    }
    lines = ["| variant | " + " | ".join(names.values()) + " |", "|---|" + "---|" * len(names)]
    for variant, dirs in runs.items():
        cells = []
        for stage, name in names:
            values = []
            for d in dirs:
                m = run_tables(d).metrics.filter(
                    (pl.col("stage") == stage) & (pl.col("name") == name) & pl.col("task_type").is_null()
                )
                values += m["value"].to_list()
            cells.append(f"{np.mean(values):.3f}" if values else "-")
        lines.append(f"| {variant} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def validity_credit_table(runs: dict[str, list[Path]], early: int = 3) -> str:
    """Markdown: the credit each kind of turn gets, per variant (all iterations and seeds; and the first
    ``early`` iterations): mean |A| (the scale the update sees), mean A of invalid turns, of valid
    moves (the state changes) and of valid no-ops (a valid turn that leaves the state as it was, e.g.
    ``inventory``), and the share of no-op turns overall and in the last 5 iterations. An estimator
    that credits no-ops above moves teaches the policy to stand still."""
    from schemas.rundir import open_run

    lines = [
        "| variant | mean abs A | mean A, invalid | mean A, valid move | mean A, valid no-op | "
        f"mean A, invalid / move / no-op (iters < {early}) | no-op share | no-op share, last 5 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    kinds = (
        pl.when(~pl.col("valid"))
        .then(pl.lit("invalid"))
        .when(pl.col("state") == pl.col("next_state"))
        .then(pl.lit("no-op"))
        .otherwise(pl.lit("move"))
    )
    for variant, dirs in runs.items():
        frames = []
        for d in dirs:
            run = open_run(d)
            for it in run.iterations():
                if not run.stage_complete("advantage", it):
                    continue
                steps = run.read(it, "steps").select("traj_id", "step", "valid", "state", "next_state")
                adv = run.read(it, "advantages").select("traj_id", "step", "advantage")
                frames.append(
                    steps.join(adv, on=["traj_id", "step"]).with_columns(
                        kinds.alias("kind"), pl.lit(it).alias("iter")
                    )
                )
        if not frames:
            continue
        frame = pl.concat(frames)
        first = frame.filter(pl.col("iter") < early)
        last = frame.filter(pl.col("iter") > frame["iter"].max() - 5)

        def mean(f: pl.DataFrame, kind: str) -> str:
            values = f.filter(pl.col("kind") == kind)["advantage"]
            return f"{values.mean():.3f}" if values.len() else "-"

        def share(f: pl.DataFrame) -> str:
            return f"{(f['kind'] == 'no-op').mean():.3f}"

        lines.append(
            f"| {variant} | {frame['advantage'].abs().mean():.3f} | {mean(frame, 'invalid')} | "
            f"{mean(frame, 'move')} | {mean(frame, 'no-op')} | "
            f"{mean(first, 'invalid')} / {mean(first, 'move')} / {mean(first, 'no-op')} | "
            f"{share(frame)} | {share(last)} |"
        )
    return "\n".join(lines)


ACTION_KINDS = {  # first word of a household action -> its kind in the net-credit table
    "go": "go",
    "take": "take",
    "put": "put",
    "open": "open/close",
    "close": "open/close",
    "clean": "clean/heat/cool",
    "heat": "clean/heat/cool",
    "cool": "clean/heat/cool",
    "use": "use",
    "look": "info",
    "inventory": "info",
    "examine": "info",
}


def net_credit_table(runs: dict[str, list[Path]], first: int = 5) -> str:
    """Markdown: the net push the update gives each kind of action, per variant: Σ A over the rows of
    that kind in an iteration (the policy-gradient direction on that kind, since the loss averages
    −w·A over rows), averaged over the first ``first`` iterations and the seeds. A kind with a
    negative net credit is unlearned whatever single steps of it deserved."""
    from schemas.rundir import open_run

    kinds = [*dict.fromkeys(ACTION_KINDS.values()), "invalid"]
    lines = ["| variant | " + " | ".join(kinds) + " |", "|---|" + "---|" * len(kinds)]
    verb = pl.col("action").str.split(" ").list.first()
    kind = (
        pl.when(~pl.col("valid"))
        .then(pl.lit("invalid"))
        .otherwise(verb.replace_strict(ACTION_KINDS, default="other"))
    )
    for variant, dirs in runs.items():
        sums: dict[str, list[float]] = {k: [] for k in kinds}
        for d in dirs:
            run = open_run(d)
            for it in [i for i in run.iterations() if i < first and run.stage_complete("advantage", i)]:
                steps = run.read(it, "steps").select("traj_id", "step", "action", "valid")
                adv = run.read(it, "advantages").select("traj_id", "step", "advantage")
                per_kind = (
                    steps.join(adv, on=["traj_id", "step"])
                    .with_columns(kind.alias("kind"))
                    .group_by("kind")
                    .agg(pl.col("advantage").sum())
                )
                got = dict(zip(per_kind["kind"], per_kind["advantage"], strict=True))
                for k in kinds:
                    sums[k].append(float(got.get(k, 0.0)))
        if sums[kinds[0]]:
            lines.append(f"| {variant} | " + " | ".join(f"{np.mean(sums[k]):+.1f}" for k in kinds) + " |")
    return "\n".join(lines)


def paired_sections(curves: dict[str, np.ndarray], runs: dict[str, list[Path]], base: str) -> list[str]:
    """The per-seed table, the differences to ``base`` paired by seed, and the paired rule's line."""
    table, auc = paired_differences(curves, runs, base)
    sections = [
        "Every run (AUC = mean training success over all iterations):",
        per_seed_table(curves, runs),
        f"Differences to {base}, paired by seed (mean ± s.e. of the per-seed differences):",
        table,
        paired_verdict(auc, base),
    ]
    shares = oracle_shares(curves, runs, base)
    if shares:
        sections += ["Each credit's share of the Monte-Carlo oracle's gain (docs/credit.md):", shares]
    return sections
