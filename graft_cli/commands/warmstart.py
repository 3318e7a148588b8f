"""Warm-start commands (docs/design.md §6): ``graft demos`` (expert play into a steps table) and ``graft sft``
(behaviour cloning of the demos: the run's initial policy)."""

from __future__ import annotations

from pathlib import Path

import typer


def demos(
    env_name: str = typer.Argument(
        ..., metavar="ENV", help="Environment with an expert (household, shop, ...)."
    ),
    out: Path = typer.Option(..., "-o", "--out", help="Output directory; DIR/steps.parquet is written."),
    episodes: int = typer.Option(64, "--episodes", help="Expert episodes, round-robin over the task set."),
    noise: float = typer.Option(
        0.0,
        "--noise",
        help="Probability that a turn executes a random admissible action (its response stays the "
        "expert's answer there: DART).",
    ),
    invalid_noise: float = typer.Option(
        0.0,
        "--invalid-noise",
        help="Probability that another turn executes an inadmissible action (one admissible earlier "
        "in the episode; the world stays, the response is the expert's answer there).",
    ),
    keep_noise: float = typer.Option(
        0.0,
        "--keep-noise",
        help="Probability that a random turn keeps its own action as the response (plain noise, not DART).",
    ),
    think: str = typer.Option(
        "verb",
        "--think",
        help="The responses' thinking text: verb (the action's first word) | situation (where the "
        "agent is and what it carries; household) | plan (goal, situation and next action; household).",
    ),
    split: str = typer.Option("train", "--split", help="Task set: train | eval."),
    seed: int = typer.Option(0, "--seed", help="Task-set and noise seed."),
    config: Path = typer.Option(None, "--config", help="Run config (TOML) whose [env] section to use."),
    overrides: list[str] = typer.Option(
        [], "--set", help="Config override KEY=VALUE, e.g. --set env.options.receptacles=8 (repeatable)."
    ),
    force: bool = typer.Option(False, "--force", help="Replace an existing DIR/steps.parquet."),
) -> None:
    """Play the scripted expert into DIR/steps.parquet (valid input for graft advantage and graft sft)."""
    from schemas.config import check_seed

    check_seed(seed)
    from schemas import write_table
    from schemas.config import load_config
    from schemas.errors import GraftError
    from stages.envs.registry import make_environment
    from stages.warmstart.demos import demo_summary, split_demos

    if split not in ("train", "eval"):
        raise GraftError(f"--split {split!r}: expected train or eval")
    if (out.parent / "config.toml").is_file() and out.name.startswith("iter_"):
        raise GraftError(
            f"{out}: an iteration of run {out.parent}; demos are not its rollout (write them to another "
            "directory; a run's warm start plays its own demos: graft sft)"
        )
    if (out / "steps.parquet").exists() and not force:
        raise GraftError(f"{out / 'steps.parquet'}: exists; use --force to replace it")
    cfg = load_config(config, [f"env.name={env_name}", f"run.seed={seed}", *overrides])
    env = make_environment(cfg)
    steps = split_demos(env, cfg, split, episodes, noise, invalid_noise, keep_noise, think=think)
    path = write_table(steps, "steps", out / "steps.parquet")
    summary = demo_summary(steps, float(env.success_outcome))
    typer.echo(
        f"{int(summary['episodes'])} episodes, {steps.height} steps, success {summary['success_rate']:.3f}, "
        f"mean turns {summary['mean_turns']:.2f} -> {path}"
    )


def sft(
    run_dir: Path = typer.Argument(..., help="Run directory (holds config.toml with sft.enabled = true)."),
) -> None:
    """Run the warm start of a run: demos, behaviour cloning, the initial-policy checkpoint."""
    import polars as pl

    from schemas import read_table
    from schemas.rundir import open_run
    from stages.loop.commands import warm_start

    run = open_run(run_dir)
    config = run.load_config()
    path = warm_start(run, config)
    rows = read_table(run.sft_dir / "metrics_sft.parquet", "metrics").filter(pl.col("task_type").is_null())
    values = dict(zip(rows["name"].to_list(), rows["value"].to_list(), strict=True))
    typer.echo(
        f"sft: {int(values['rows'])} rows (demo success {values['demo_success_rate']:.3f}), "
        f"{int(values['optimizer_steps'])} steps, loss {values['loss_first']:.3f} -> {values['loss_last']:.3f} "
        f"-> {path}"
    )
    for r in range(1, config.sft.dagger_rounds + 1):
        typer.echo(
            f"  dagger round {r}: the clone played with invalid rate {values[f'dagger{r}_invalid_rate']:.3f} "
            f"and success {values[f'dagger{r}_success_rate']:.3f}; {int(values[f'dagger{r}_rows'])} turns relabelled"
        )


def register(app: typer.Typer) -> None:
    """Add this module's commands to the graft app."""
    app.command("demos")(demos)
    app.command("sft")(sft)
