"""The learning benchmark's statistics over seeds: means with standard errors, the protocols'
decision rule on the area under the curve, and differences paired by seed.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from bench.learning.runs import held_out, run_seed


def mean_with_se(values: np.ndarray, single_se: float = float("nan")) -> tuple[float, float]:
    """Mean over seeds and its standard error (std ddof=1 / √k); one seed: ``single_se``."""
    if len(values) > 1:
        return float(values.mean()), float(values.std(ddof=1) / np.sqrt(len(values)))
    return float(values.mean()), single_se


def verdict(curves: dict[str, np.ndarray]) -> str:
    """The protocol's decision rule on the area under the training-success curve (mean over
    iterations): a variant wins only if its AUC exceeds every other variant's by more than twice the
    larger of the two standard errors over seeds."""
    auc = {v: c.mean(axis=1) for v, c in curves.items()}  # per seed
    stats = {
        v: (a.mean(), a.std(ddof=1) / np.sqrt(len(a)) if len(a) > 1 else float("nan")) for v, a in auc.items()
    }
    best = max(stats, key=lambda v: stats[v][0])
    margins, wins = [], True
    for other, (mean, se) in stats.items():
        if other == best:
            continue
        gap, bound = stats[best][0] - mean, 2 * max(stats[best][1], se)
        margins.append(f"{best} − {other} = {gap:+.3f} (2 s.e. = {bound:.3f})")
        wins = wins and bool(gap > bound)  # a NaN s.e. (one seed) never counts as a win
    if wins:
        return f"**{best} wins** (AUC gap > 2 s.e. against every variant): {'; '.join(margins)}."
    return f"**No detectable difference** (decision rule: AUC gap > 2 s.e.): {'; '.join(margins)}."


def paired_differences(
    curves: dict[str, np.ndarray], runs: dict[str, list[Path]], base: str
) -> tuple[str, dict[str, tuple[float, float]]]:
    """Markdown and numbers: each variant minus ``base``, paired by seed (the seeds both have): AUC,
    last-5 mean and the last held-out success, each mean ± s.e. of the per-seed differences (std
    ddof=1 / √k) with the number of seeds where the variant is ahead; returns the AUC (mean, s.e.)
    per variant for the decision rule."""
    lines = [
        f"| variant − {base} | seeds | AUC, paired ± s.e. | ahead on | last 5, paired ± s.e. "
        "| held-out last, paired ± s.e. |",
        "|---|---|---|---|---|---|",
    ]
    auc: dict[str, tuple[float, float]] = {}

    def mean_se(x: np.ndarray) -> tuple[float, float]:
        se = float(x.std(ddof=1) / np.sqrt(len(x))) if len(x) > 1 else float("nan")
        return float(x.mean()), se

    def by_seed(variant: str) -> dict[int, tuple[np.ndarray, dict[str, float] | None]]:
        return {
            run_seed(d): (row, held_out(d)) for row, d in zip(curves[variant], runs[variant], strict=True)
        }

    base_runs = by_seed(base)
    for variant in curves:
        if variant == base:
            continue
        mine = by_seed(variant)
        seeds = sorted(set(mine) & set(base_runs))
        if not seeds:
            continue
        n = len(seeds)
        d_auc = np.array([mine[s][0].mean() - base_runs[s][0].mean() for s in seeds])
        d_last = np.array([mine[s][0][-5:].mean() - base_runs[s][0][-5:].mean() for s in seeds])
        evals = [(mine[s][1], base_runs[s][1]) for s in seeds]
        d_eval = np.array([a["last"] - b["last"] for a, b in evals if a is not None and b is not None])
        auc[variant] = mean_se(d_auc)
        text = [f"{m:+.3f} ± {se:.3f}" for m, se in (mean_se(d_auc), mean_se(d_last))]
        text.append(f"{mean_se(d_eval)[0]:+.3f} ± {mean_se(d_eval)[1]:.3f}" if len(d_eval) else "-")
        lines.append(
            f"| {variant} | {n} | {text[0]} | {int((d_auc > 0).sum())} of {n} | {text[1]} | {text[2]} |"
        )
    return "\n".join(lines), auc


def paired_verdict(auc: dict[str, tuple[float, float]], base: str) -> str:
    """One benchmark's half of the rule: a variant is ahead of ``base`` when its AUC minus base's,
    paired by seed, exceeds twice the s.e. of those differences (a NaN s.e. never counts)."""
    parts = []
    for variant, (mean, se) in auc.items():
        ahead = bool(mean > 2 * se)
        parts.append(
            f"{variant} − {base} = {mean:+.3f} (2 paired s.e. = {2 * se:.3f}): "
            + ("**ahead**" if ahead else "not ahead")
        )
    return "Paired rule (AUC difference > 2 paired s.e.): " + "; ".join(parts) + "."


def oracle_shares(
    curves: dict[str, np.ndarray],
    runs: dict[str, list[Path]],
    base: str,
    oracle: str = "oracle",
    draws: int = 10_000,
) -> str:
    """Markdown: each variant's share of the oracle's gain over ``base``, on AUC and on the last
    held-out success, over the seeds all three have:

        share(v) = mean_s(v_s − base_s) / mean_s(oracle_s − base_s)

    (1 = everything better credit could buy over ``base``, 0 = nothing, below 0 = worse than
    ``base``), with a 90% interval from resampling the seeds with replacement (``draws`` resamples,
    a fixed generator; resamples whose oracle gain is 0 are dropped). A share of a gain that is not
    itself above 2 paired s.e. is not a measurement: the table says so."""
    if oracle not in curves or base not in curves:
        return ""

    def by_seed(variant: str) -> dict[int, tuple[float, float]]:
        out = {}
        for row, d in zip(curves[variant], runs[variant], strict=True):
            evals = held_out(d)
            out[run_seed(d)] = (float(row.mean()), float("nan") if evals is None else float(evals["last"]))
        return out

    base_runs, oracle_runs = by_seed(base), by_seed(oracle)
    rng = np.random.default_rng(0)
    lines = [
        f"| variant | seeds | share of the oracle's AUC gain over {base} (90% interval) "
        f"| share of its held-out gain (90% interval) |",
        "|---|---|---|---|",
    ]
    notes = []
    for variant in curves:
        if variant in (base, oracle):
            continue
        mine = by_seed(variant)
        seeds = sorted(set(mine) & set(base_runs) & set(oracle_runs))
        if len(seeds) < 2:
            continue
        cells = []
        for k, name in ((0, "AUC"), (1, "held-out")):
            gain = np.array([oracle_runs[s][k] - base_runs[s][k] for s in seeds])
            mine_gain = np.array([mine[s][k] - base_runs[s][k] for s in seeds])
            if np.isnan(gain).any() or np.isnan(mine_gain).any() or gain.mean() == 0:
                cells.append("-")
                continue
            picks = rng.integers(0, len(seeds), size=(draws, len(seeds)))
            denominators = gain[picks].mean(axis=1)
            keep = denominators != 0
            ratios = mine_gain[picks].mean(axis=1)[keep] / denominators[keep]
            low, high = np.quantile(ratios, [0.05, 0.95])
            cells.append(f"{mine_gain.mean() / gain.mean():.2f} [{low:.2f}, {high:.2f}]")
            se = gain.std(ddof=1) / np.sqrt(len(gain))
            if not gain.mean() > 2 * se:
                notes.append(
                    f"{name}: the oracle's gain {gain.mean():+.3f} is not above 2 paired s.e. ({2 * se:.3f})"
                )
        lines.append(f"| {variant} | {len(seeds)} | {cells[0]} | {cells[1]} |")
    if len(lines) == 2:
        return ""
    caveat = (
        f" Not measurements where the oracle's own gain is not detectable ({'; '.join(sorted(set(notes)))})."
        if notes
        else ""
    )
    return (
        "\n".join(lines)
        + "\n\n"
        + (
            f"Share = mean over seeds of (variant − {base}) / mean of ({oracle} − {base}); interval: seeds "
            f"resampled with replacement.{caveat}"
        )
    )
