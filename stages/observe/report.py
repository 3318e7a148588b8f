"""Learning curves and per-type result tables of one or more runs (docs/design.md §8, ``graft report``).

Reads the long-format ``metrics`` rows of every iteration (``iter_NNNN/metrics_*.parquet``) and the
``eval`` rows (``iter_NNNN/eval.parquet`` plus ``eval.parquet`` at the run root for the policy before any
update), and writes

* ``curves.png``: success rate, mean return, mean turns and valid action rate (share of turns whose
  response parsed to an admissible action; 1 in ``choose`` mode) vs iteration, one colour per run; the
  training rollouts as lines, held-out evaluations as markers;
* ``update.png``: loss, KL, entropy, clip fraction and grad norm of the policy update per iteration
  (the ``metrics_update`` rows), when the runs have any;
* ``report.md``: a table per run like the paper's Table 1 (success % per task type and All, from the
  last evaluation, All with its standard error and the number of episodes behind it; score too when the
  environment has one; the valid action rate for ``generate``-mode runs) plus the images.

x axis: the number of policy updates behind the policy that acted. The rollout of iteration i uses
the policy after i updates (x = i); the evaluation stored in iteration i evaluates the checkpoint
written by update i (x = i + 1); the initial evaluation is x = 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import polars as pl

from schemas import read_table
from schemas.confine import refuse_links_out
from schemas.errors import GraftError
from schemas.manifest import verify_finished
from schemas.run_config import refuse_config_edit
from schemas.rundir import Run, open_run

# ALFWorld's subtask labels in the order of the paper's Table 1, with its column names; other task
# types follow alphabetically under their own names.
TYPE_LABELS = {
    "pick_and_place_simple": "Pick",
    "look_at_obj_in_light": "Look",
    "pick_clean_then_place_in_recep": "Clean",
    "pick_heat_then_place_in_recep": "Heat",
    "pick_cool_then_place_in_recep": "Cool",
    "pick_two_obj_and_place": "Pick2",
}
TYPE_ORDER = tuple(TYPE_LABELS)
SCORED_ENVS = ("shop",)  # environments whose task score is reported beside success
CURVES = (
    ("success_rate", "success rate"),
    ("mean_return", "mean return"),
    ("mean_turns", "mean turns"),
    ("valid_action_rate", "valid action rate"),
)
RATE_CURVES = ("success_rate", "valid_action_rate")  # drawn on [0, 1]
# update-stage summary rows (metrics_update.parquet: means over the iteration's optimizer steps)
UPDATE_PANELS = (
    ("loss", "loss"),
    ("kl", "KL to the reference (k3)"),
    ("entropy", "entropy (nats / token)"),
    ("clip_fraction", "clip fraction"),
    ("grad_norm", "grad norm (before clipping)"),
)


def success_standard_error(rate: float, episodes: float) -> float:
    """Standard error of a success rate measured on ``episodes`` 0/1 episodes (pure).

    The sample standard deviation of the episodes' successes over √n, ``s / √n`` with
    ``s² = n p (1 − p) / (n − 1)``, i.e. ``√(p (1 − p) / (n − 1))``; NaN for fewer than 2 episodes.
    It treats the episodes as independent draws on the fixed held-out tasks, so it is the noise of
    replaying the same evaluation with other sampling seeds (the spread over other task sets is
    larger where tasks differ in difficulty).
    """
    n = float(episodes)
    if not n >= 2:
        return float("nan")
    p = min(max(float(rate), 0.0), 1.0)
    return float(np.sqrt(p * (1.0 - p) / (n - 1.0)))


@dataclass(frozen=True)
class RunTables:
    """The metrics and eval rows of one run, each with an ``x`` column (policy updates behind it)."""

    label: str
    metrics: pl.DataFrame  # iter, stage, name, value, task_type, x
    eval: pl.DataFrame  # iter, checkpoint, name, value, task_type, x
    env: str = ""  # environment name from the run's config ("" if unknown)
    mode: str = ""  # rollout mode from the run's config: choose | generate ("" if unknown)


def _concat(frames: list[pl.DataFrame], table: str) -> pl.DataFrame:
    from schemas import TABLES

    if not frames:
        return pl.from_arrow(TABLES[table].schema.empty_table())  # type: ignore[return-value]
    return pl.concat(frames, how="vertical_relaxed")


def load_run_tables(run: Run, label: str | None = None) -> RunTables:
    """Read every metrics and eval table of ``run`` (complete files only; temp files are ignored);
    finished iterations only as their manifests record them, and a config.toml edited since graft
    sealed it refused (its env and mode label the report)."""
    verify_finished(run)
    refuse_config_edit(run)
    metrics_frames, eval_frames = [], []
    for it in run.iterations():
        folder = run.iter_dir(it)
        for path in sorted(folder.glob("metrics_*.parquet")):
            metrics_frames.append(read_table(path, "metrics"))
        eval_path = folder / "eval.parquet"
        if eval_path.is_file():
            eval_frames.append(read_table(eval_path, "eval"))
    initial = run.initial_eval_path
    if initial.is_file():
        eval_frames.append(read_table(initial, "eval"))
    metrics = _concat(metrics_frames, "metrics").with_columns(pl.col("iter").alias("x"))
    evals = _concat(eval_frames, "eval").with_columns((pl.col("iter") + 1).alias("x"))
    try:
        config = run.load_config()
        env, mode = config.env.name, config.rollout.mode
    except GraftError:  # a config this graft cannot read: the tables still report
        env = mode = ""
    return RunTables(label or run.root.name, metrics, evals, env, mode)


def training_curve(metrics: pl.DataFrame, name: str) -> pl.DataFrame:
    """Per-iteration value of rollout metric ``name`` over all tasks: columns x, value (sorted)."""
    return (
        metrics.filter(
            (pl.col("stage") == "rollout") & (pl.col("name") == name) & pl.col("task_type").is_null()
        )
        .group_by("x")
        .agg(pl.col("value").mean())
        .sort("x")
    )


def eval_curve(evals: pl.DataFrame, name: str) -> pl.DataFrame:
    """Per-evaluation value of eval metric ``name`` over all tasks: columns x, value (sorted)."""
    overall = pl.col("split").is_null() if "split" in evals.columns else pl.lit(True)
    return (
        evals.filter((pl.col("name") == name) & pl.col("task_type").is_null() & overall)
        .group_by("x")
        .agg(pl.col("value").mean())
        .sort("x")
    )


def valid_action_curve(frame: pl.DataFrame, curve) -> pl.DataFrame:  # type: ignore[no-untyped-def]
    """``curve(frame, "valid_action_rate")`` (``training_curve`` or ``eval_curve``); for tables written
    before that metric existed, 1 − its ``invalid_rate`` curve."""
    valid = curve(frame, "valid_action_rate")
    if valid.height:
        return valid
    return curve(frame, "invalid_rate").with_columns(1.0 - pl.col("value"))


def update_curve(metrics: pl.DataFrame, name: str) -> pl.DataFrame:
    """Per-iteration update metric ``name``: columns x, value (sorted). x = iter + 1: the update of
    iteration i produces the policy after i + 1 updates."""
    return (
        metrics.filter(
            (pl.col("stage") == "update") & (pl.col("name") == name) & pl.col("task_type").is_null()
        )
        .group_by("iter")
        .agg(pl.col("value").mean())
        .select((pl.col("iter") + 1).alias("x"), "value")
        .sort("x")
    )


_BARS = "▁▂▃▄▅▆▇█"


def sparkline(values: list[float], low: float = 0.0, high: float = 1.0) -> str:
    """One character per value on a fixed [low, high] scale (a success curve in one terminal line)."""
    span = (high - low) or 1.0
    last = len(_BARS) - 1
    return "".join(_BARS[min(last, max(0, round((v - low) / span * last)))] for v in values)


def success_summary(run: Run) -> str:
    """``training success 0.22 → 0.97  ▂▃▄▅▆▇█`` for a run's training rollouts, then the held-out
    success of its first and last evaluation with the last one's standard error and episodes
    (``held-out 0.20 → 0.66 ± 0.06 (64 episodes)``); empty if the run has neither."""
    tables = load_run_tables(run)
    curve = training_curve(tables.metrics, "success_rate")["value"].to_list()
    parts = [f"training success {curve[0]:.2f} → {curve[-1]:.2f}  {sparkline(curve)}"] if curve else []
    held_out = eval_curve(tables.eval, "success_rate")["value"].to_list()
    if held_out:
        episodes = eval_curve(tables.eval, "episodes")["value"].to_list()
        se = success_standard_error(held_out[-1], episodes[-1]) if episodes else float("nan")
        first = f"{held_out[0]:.2f} → " if len(held_out) > 1 else ""
        spread = f" ± {se:.2f}" if se == se else ""
        count = f" ({episodes[-1]:.0f} episodes)" if episodes else ""
        parts.append(f"held-out {first}{held_out[-1]:.2f}{spread}{count}")
    return "   ".join(parts)


def order_task_types(types: list[str]) -> list[str]:
    """ALFWorld's Table 1 order for the types it knows, then the rest alphabetically."""
    known = [t for t in TYPE_ORDER if t in types]
    return known + sorted(t for t in types if t not in TYPE_ORDER)


def per_type_table(tables: list[RunTables]) -> str:
    """A Markdown table like the paper's Table 1: success % per task type and All, last evaluation
    (plus Score %, the mean task score, for ``shop`` runs and wherever it differs from success).

    The All cell carries the standard error of the overall success (``success_standard_error``, in
    points) and the Episodes column the number of episodes behind it.
    A run without evaluations falls back to its last training rollout (marked ``(train)``).
    Cells of types a run never saw are ``–``.
    """
    rows: list[tuple[str, dict[str, float], float | None, float | None, float | None]] = []
    all_types: set[str] = set()
    for t in tables:
        frame, label = t.eval, t.label
        if frame.height == 0:
            frame = t.metrics.filter(pl.col("stage") == "rollout")
            label = f"{t.label} (train)"
        if frame.height == 0:
            rows.append((label, {}, None, None, None))
            continue
        last_x = frame["x"].max()
        last = frame.filter(pl.col("x") == last_x)
        if "split" not in last.columns:
            last = last.with_columns(pl.lit(None, dtype=pl.String).alias("split"))
        # all evaluated episodes first, then each split (e.g. ALFWorld valid_seen / valid_unseen)
        for split in [None, *last["split"].drop_nulls().unique().sort().to_list()]:
            part = last.filter(pl.col("split").is_null() if split is None else pl.col("split") == split)
            per_type, score, episodes = _success_and_score(part)
            all_types.update(k for k in per_type if k != "All")
            name = label if split is None else f"{label} [{split}]"
            rows.append((f"{name} @ {last_x} updates", per_type, score, episodes, _valid_percent(part)))
    types = order_task_types(sorted(all_types))
    # Score beside Success for WebShop-style environments (the paper's Table 1), and wherever the
    # score says more than success (partial credit)
    has_score = any(t.env in SCORED_ENVS for t in tables) or any(
        r[2] is not None and abs(r[2] - r[1].get("All", r[2])) > 1e-9 for r in rows
    )
    # the valid action rate for generate-mode runs (choose mode picks from the admissible set: always
    # 100), and wherever an action was invalid
    has_valid = any(t.mode == "generate" for t in tables) or any(
        r[4] is not None and r[4] < 100.0 - 1e-9 for r in rows
    )
    header = ["run", *(TYPE_LABELS.get(t, t or "(none)") for t in types), "All (± s.e.)"]
    header += (["Score"] if has_score else []) + (["Valid"] if has_valid else []) + ["Episodes"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for label, per_type, score, episodes, valid in rows:
        cells = [label] + [f"{per_type[k]:.1f}" if k in per_type else "–" for k in types]
        cells.append(_overall_cell(per_type.get("All"), episodes))
        if has_score:
            cells.append(f"{score:.1f}" if score is not None else "–")
        if has_valid:
            cells.append(f"{valid:.1f}" if valid is not None else "–")
        cells.append(f"{episodes:.0f}" if episodes is not None else "–")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _overall_cell(percent: float | None, episodes: float | None) -> str:
    """``37.5 ± 6.1``: overall success % with its standard error in points (no ± below 2 episodes)."""
    if percent is None:
        return "–"
    se = success_standard_error(percent / 100.0, episodes) if episodes is not None else float("nan")
    return f"{percent:.1f}" + (f" ± {100.0 * se:.1f}" if se == se else "")


def _valid_percent(last: pl.DataFrame) -> float | None:
    """The overall valid action rate in % (1 − invalid_rate for tables written before it; None without
    either)."""
    overall = last.filter(pl.col("task_type").is_null())
    for name, sign, offset in (("valid_action_rate", 1.0, 0.0), ("invalid_rate", -1.0, 1.0)):
        value = overall.filter(pl.col("name") == name)["value"]
        if value.len():
            return 100.0 * (offset + sign * float(value[0]))
    return None


def _success_and_score(last: pl.DataFrame) -> tuple[dict[str, float], float | None, float | None]:
    """Success % per task type and "All", the overall Score % (None without mean_score rows) and the
    number of episodes behind "All" (None without an episodes row)."""
    success = last.filter(pl.col("name") == "success_rate")
    per_type = {
        r["task_type"]: 100.0 * r["value"]
        for r in success.filter(pl.col("task_type").is_not_null()).iter_rows(named=True)
    }
    overall = success.filter(pl.col("task_type").is_null())["value"]
    per_type["All"] = 100.0 * float(overall[0]) if overall.len() else float("nan")
    score = last.filter((pl.col("name") == "mean_score") & pl.col("task_type").is_null())["value"]
    episodes = last.filter((pl.col("name") == "episodes") & pl.col("task_type").is_null())["value"]
    return (
        per_type,
        100.0 * float(score[0]) if score.len() else None,
        float(episodes[0]) if episodes.len() else None,
    )


def plot_curves(tables: list[RunTables], path: Path) -> Path:
    """Draw success / return / turns / valid action rate vs policy updates for every run into one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(1, len(CURVES), figsize=(4.5 * len(CURVES), 3.8), constrained_layout=True)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, t in enumerate(tables):
        colour = colours[i % len(colours)]
        for ax, (name, title) in zip(axes, CURVES, strict=True):
            if name == "valid_action_rate":
                train, ev = (
                    valid_action_curve(t.metrics, training_curve),
                    valid_action_curve(t.eval, eval_curve),
                )
            else:
                train, ev = training_curve(t.metrics, name), eval_curve(t.eval, name)
            if train.height:
                ax.plot(train["x"], train["value"], color=colour, lw=1.5, label=f"{t.label} (train)")
            if ev.height:
                ax.plot(
                    ev["x"], ev["value"], color=colour, ls="--", marker="o", ms=5, label=f"{t.label} (eval)"
                )
            ax.set_title(title)
            ax.set_xlabel("policy updates")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # updates are counts: no 0.5 ticks
            ax.grid(alpha=0.3)
    for ax, (name, _) in zip(axes, CURVES, strict=True):
        if name in RATE_CURVES:
            ax.set_ylim(-0.02, 1.02)
    handles, labels = axes[0].get_legend_handles_labels()
    if handles:
        axes[0].legend(fontsize=8, loc="best")
    return save_figure(fig, path)


def save_figure(fig, path: Path) -> Path:
    """Write a matplotlib figure to ``path`` atomically (temporary name, then rename) and close it."""
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)
    return path


def plot_update(tables: list[RunTables], path: Path) -> Path | None:
    """Draw the update panels (loss, KL, entropy, clip fraction, grad norm) vs policy updates into one
    PNG; None (nothing written) when no run has update metrics."""
    if not any(t.metrics.filter(pl.col("stage") == "update").height for t in tables):
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    n = len(UPDATE_PANELS)
    fig, axes = plt.subplots(1, n, figsize=(4 * n, 3.4), constrained_layout=True)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (name, title) in zip(axes, UPDATE_PANELS, strict=True):
        drawn = False
        for i, t in enumerate(tables):
            curve = update_curve(t.metrics, name)
            if curve.height:
                ax.plot(curve["x"], curve["value"], color=colours[i % len(colours)], lw=1.5, label=t.label)
                drawn = True
        if not drawn:  # e.g. KL when update.beta = 0: the loss has no KL term, nothing is measured
            note = "not measured (update.beta = 0)" if name == "kl" else "not measured"
            ax.text(0.5, 0.5, note, ha="center", va="center", transform=ax.transAxes, color="grey")
            ax.set_xticks([])
            ax.set_yticks([])
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # updates are whole numbers
        ax.set_title(title)
        ax.set_xlabel("policy updates")
        ax.grid(alpha=0.3)
    if len(tables) > 1:
        axes[0].legend(fontsize=8, loc="best")
    return save_figure(fig, path)


def write_report(run_paths: list[str | Path], out: str | Path | None = None) -> list[Path]:
    """Write ``curves.png`` and ``report.md`` for ``run_paths`` into ``out`` (default: first run/report)."""
    if not run_paths:
        raise GraftError("graft report: give at least one run directory")
    runs = [open_run(p) for p in run_paths]
    for run in runs:  # it reads them and (without -o) writes into the first
        refuse_links_out(run.root, "graft report reads or writes")
    labels = _unique_labels(runs)
    tables = [load_run_tables(r, label) for r, label in zip(runs, labels, strict=True)]
    if all(t.metrics.height == 0 and t.eval.height == 0 for t in tables):
        raise GraftError(f"{runs[0].root}: no metrics or eval tables yet (run `graft loop` first)")
    folder = Path(out) if out is not None else runs[0].root / "report"
    png = plot_curves(tables, folder / "curves.png")
    update_png = plot_update(tables, folder / "update.png")
    from schemas.atomic import atomic_write_text

    sections = [
        "# graft report",
        "Runs: " + ", ".join(f"`{r.root}`" for r in runs),
        "## Success rate (%) per task type, last evaluation",
        per_type_table(tables),
        "## Learning curves",
        f"![learning curves]({png.name})",
    ]
    if update_png is not None:
        sections += [
            "## Policy update",
            "Per iteration, means over its optimizer steps (`metrics_update.parquet`).",
            f"![policy update]({update_png.name})",
        ]
    md = folder / "report.md"
    atomic_write_text(md, "\n\n".join(sections) + "\n")
    return [png, md] + ([update_png] if update_png is not None else [])


def _unique_labels(runs: list[Run]) -> list[str]:
    names = [r.root.name for r in runs]
    if len(set(names)) == len(names):
        return names
    return [str(r.root) for r in runs]
