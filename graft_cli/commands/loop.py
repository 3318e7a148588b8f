"""``graft loop``, ``graft eval``, ``graft report``, ``graft viz`` (docs/design.md §8)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import typer

from schemas.config import Config
from schemas.errors import GraftError

if TYPE_CHECKING:  # schemas.rundir imports polars: loaded when a command runs, not for --help
    from schemas.rundir import Run


def format_eta(seconds: float) -> str:
    """``1h02m``, ``4m05s``, ``12s``."""
    seconds = max(0, round(seconds))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    if seconds >= 60:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds}s"


class RunEta:
    """The whole run's remaining time: the mean wall seconds of the iterations this process ran, times
    the iterations left to the target."""

    def __init__(self, target: int) -> None:
        import time

        self.target, self.started, self.done = target, time.monotonic(), 0

    def after(self, iteration: int) -> str:
        import time

        self.done += 1
        left = self.target - 1 - iteration
        if left <= 0:
            return ""
        return format_eta((time.monotonic() - self.started) / self.done * left)


def _print_initial_policy_plan(console, run: Run, cfg: Config) -> None:  # type: ignore[no-untyped-def]
    """What the start will build before iteration 0 (the tiny model, the warm start), when not built yet."""
    if not cfg.model.path and not (run.initial_model_dir / "config.json").is_file():
        from stages.envs.registry import make_environment
        from stages.policy.tiny import vocab_tasks_for

        n = vocab_tasks_for(make_environment(cfg), cfg.model.tiny_vocab_tasks)
        console.print(
            f"building the tiny model: playing {n} train + {n} eval {cfg.env.name} tasks for its "
            "vocabulary (model.tiny_vocab_tasks)",
            highlight=False,
            soft_wrap=True,
        )
    if cfg.sft.enabled and not (run.sft_model_dir / "config.json").is_file():
        console.print(
            f"warm start: {cfg.sft.episodes} expert demos (noise {cfg.sft.noise:g}, "
            f"invalid noise {cfg.sft.invalid_noise:g}), "
            f"{cfg.sft.epochs} epochs of behaviour cloning"
            + (
                f", {cfg.sft.dagger_rounds} DAgger rounds of {cfg.sft.dagger_episodes} episodes "
                f"(each played, then {cfg.sft.dagger_epochs} epochs over all examples: "
                f"{1 + cfg.sft.dagger_rounds} training phases, a progress bar each)"
                if cfg.sft.dagger_rounds
                else ""
            )
            + f" -> {run.sft_model_dir}",
            highlight=False,
            soft_wrap=True,
        )


def valid_action_rate(values: dict[str, float]) -> float:
    """The valid action rate of a metrics dict; 1 − invalid_rate for tables written before it existed."""
    if "valid_action_rate" in values:
        return values["valid_action_rate"]
    return 1.0 - values.get("invalid_rate", float("nan"))


def _has_valid(values: dict[str, float]) -> bool:
    return "valid_action_rate" in values or "invalid_rate" in values


def stage_times(seconds: dict[str, float]) -> str:
    """The loop line's seconds per stage, each under its short label (schemas/stage_table.py)."""
    from schemas.rundir import STAGE_LABELS

    return " ".join(f"{STAGE_LABELS.get(s, s)} {v:.1f}s" for s, v in seconds.items())


def _print_iteration(console, run: Run, result, config: Config, eta: str = "") -> None:  # type: ignore[no-untyped-def]
    from stages.loop import iteration_summary

    summary = iteration_summary(run, result.iteration, config)
    for stage, damage in result.redone.items():
        console.print(f"iter {result.iteration}: redid {stage}: {damage[0]}", highlight=False, markup=False)
    times = stage_times(result.seconds)
    parts = [f"[bold]iter {result.iteration:4d}[/bold]"]
    parts.append(f"success {summary.get('success_rate', float('nan')):.3f}")
    parts.append(f"return {summary.get('mean_return', float('nan')):7.3f}")
    parts.append(f"turns {summary.get('mean_turns', float('nan')):5.2f}")
    generate = config.rollout.mode == "generate"  # in choose mode every action is admissible
    if generate and ("valid_action_rate" in summary or "invalid_rate" in summary):
        parts.append(f"valid {valid_action_rate(summary):.3f}")
    score = summary.get("mean_score")
    if score is not None and abs(score - summary.get("success_rate", score)) > 1e-9:  # partial credit
        parts.append(f"score {score:.3f}")
    if "eval_success_rate" in summary:
        held_out = {k[5:]: v for k, v in summary.items() if k.startswith("eval_")}
        valid = f" valid {valid_action_rate(held_out):.3f}" if generate and _has_valid(held_out) else ""
        parts.append(f"[cyan]eval {summary['eval_success_rate']:.3f}{valid}[/cyan]")
    parts.append(f"[dim]| {times}[/dim]")
    if eta:
        parts.append(f"[dim]eta {eta}[/dim]")
    console.print("  ".join(parts), highlight=False, soft_wrap=True)


def _print_initial_eval(console, run: Run, seconds: float, mode: str = "choose") -> None:  # type: ignore[no-untyped-def]
    """The evaluation of the initial policy (iter -1), in the columns of the iteration lines (with its
    valid action rate in ``generate`` mode)."""
    from schemas import read_table

    rows = read_table(run.initial_eval_path, "eval")
    overall = {
        r["name"]: r["value"]
        for r in rows.iter_rows(named=True)
        if r["task_type"] is None and r.get("split") is None
    }
    valid = f"valid {valid_action_rate(overall):.3f}  " if mode == "generate" and _has_valid(overall) else ""
    line = (
        f"[bold]initial  [/bold] [cyan]eval {overall.get('success_rate', float('nan')):.3f}[/cyan]  "
        f"return {overall.get('mean_return', float('nan')):7.3f}  "
        f"turns {overall.get('mean_turns', float('nan')):5.2f}  {valid}[dim]| eval {seconds:.1f}s[/dim]"
    )
    console.print(line, highlight=False, soft_wrap=True)


def loop(
    config: str = typer.Option(None, "--config", "-c", help="Run config TOML (new run or check on resume)."),
    iters: int = typer.Option(
        None, "--iters", help="Iterations to reach (overrides run.iters; not a config change)."
    ),
    run_dir: str = typer.Option(None, "--run", help="Run directory (default runs/<run.name>)."),
    overrides: list[str] = typer.Option(
        [], "--set", help="Override a config key, e.g. --set update.lr=1e-5."
    ),
    force: bool = typer.Option(False, "--force", help="Continue a run whose saved config differs."),
    executor: str = typer.Option(
        None,
        "--executor",
        help="local | ray: play the rollout groups in this process or on Ray actors "
        "(overrides cluster.executor; docs/scaling.md).",
    ),
) -> None:
    """Run rollout → graph → solve → advantage → update per iteration; resumes where it stopped."""
    from rich.console import Console

    from stages.loop import locked_start, loop_root, open_loop_run, run_loop

    console = Console(stderr=False)
    if iters is not None and iters < 0:  # before the run's lock file is created
        raise GraftError(f"--iters {iters}: must be >= 0")
    overrides = list(overrides)
    if executor is not None:
        if executor not in ("local", "ray"):
            raise GraftError(f"--executor {executor!r}: expected local or ray")
        overrides.append(f"cluster.executor={executor}")
    root, checked = loop_root(config, run_dir, overrides, force)  # checks the config before any write
    # a refused start of a new run leaves nothing behind; one refused at the lock removes nothing
    with locked_start(root):
        run, cfg, target = open_loop_run(root, checked, iters, force)
        # soft_wrap: off a terminal rich wraps at 80 columns and would split file paths in two
        console.print(f"run {run.root}  iterations 0..{target - 1}", highlight=False, soft_wrap=True)
        _print_initial_policy_plan(console, run, cfg)
        from stages.policy.cpu_precision import native_precision_line

        if line := native_precision_line(cfg):
            console.print(line, highlight=False, soft_wrap=True)
        eta = RunEta(target)
        results = run_loop(
            run,
            cfg,
            target,
            on_iteration=lambda r: _print_iteration(console, run, r, cfg, eta.after(r.iteration)),
            on_initial_eval=lambda seconds: _print_initial_eval(console, run, seconds, cfg.rollout.mode),
        )
        if not results:
            console.print(
                f"nothing to do: iterations 0..{target - 1} are finished",
                highlight=False,
                soft_wrap=True,
            )
            return
        from stages.observe.report import success_summary, write_report

        png, markdown, *_ = write_report([run.root])
    console.print(success_summary(run), highlight=False, soft_wrap=True)
    console.print(
        f"curves: {png}  table: {markdown}  (graft report RUN [RUN ...] overlays runs)",
        highlight=False,
        soft_wrap=True,
        markup=False,
    )


def evaluate(
    run_dir: str = typer.Argument(..., help="Run directory."),
    checkpoint: str = typer.Option(
        "latest", "--checkpoint", help="latest | initial | a checkpoint directory."
    ),
    iteration: int = typer.Option(None, "--iter", help="Evaluate the checkpoint of this iteration."),
    overrides: list[str] = typer.Option([], "--set", help="Override a config key for this evaluation."),
    force: bool = typer.Option(False, "--force", help="Replace an existing evaluation of it."),
) -> None:
    """Evaluate a checkpoint on held-out tasks; writes iter_NNNN/eval.parquet."""
    from schemas.rundir import open_run
    from stages.loop.commands import evaluate_on_run

    run = open_run(run_dir)
    cfg = run.load_config(list(overrides))
    evaluation = evaluate_on_run(run, cfg, checkpoint, iteration, force)
    rows, name, out = evaluation.rows, evaluation.name, evaluation.out
    overall_rows = rows.filter(rows["task_type"].is_null() & rows["split"].is_null())  # not a split's
    overall = {r["name"]: r["value"] for r in overall_rows.iter_rows(named=True)}
    valid = f"valid {valid_action_rate(overall):.3f}  " if cfg.rollout.mode == "generate" else ""
    typer.echo(
        f"{name}: success {overall['success_rate']:.3f}  return {overall['mean_return']:.3f}  "
        f"turns {overall['mean_turns']:.2f}  score {overall['mean_score']:.3f}  {valid}-> {out}"
    )


def report(
    runs: list[str] = typer.Argument(..., help="One or more run directories (overlaid)."),
    out: str = typer.Option(None, "-o", "--out", help="Output folder (default <first run>/report)."),
) -> None:
    """Learning curves (PNG) and a per-task-type success table (Markdown)."""
    from stages.observe.report import write_report

    for path in write_report(list(runs), out):
        typer.echo(str(path))


def viz(
    run_dir: str = typer.Argument(..., help="Run directory."),
    iteration: int = typer.Option(..., "--iter", help="Iteration."),
    group: str = typer.Option("0", "--group", help="group_id, or its index in the steps table."),
    fmt: str = typer.Option("png", "--format", help="png | svg (an .html view is written too)."),
    out: str = typer.Option(None, "-o", "--out", help="Output image path (default <run>/viz/...)."),
) -> None:
    """Draw one trajectory graph: nodes coloured by value, edges labelled with advantage."""
    from schemas.rundir import open_run
    from stages.observe.viz import write_viz

    if fmt not in ("png", "svg"):
        raise GraftError(f"--format {fmt}: expected png or svg")
    for path in write_viz(open_run(run_dir), iteration, group, fmt, out):
        typer.echo(str(path))


def register(app: typer.Typer) -> None:
    """Add this module's commands to the graft app."""
    app.command("loop")(loop)
    app.command("eval")(evaluate)
    app.command("report")(report)
    app.command("viz")(viz)
