"""``graft update RUN --iter I``: the policy update stage (docs/design.md §7); ``graft export``: a checkpoint
as a plain model directory.

Under ``torchrun --nproc_per_node K $(which graft) update RUN --iter I`` the same command shards each
minibatch across K processes (DDP; ``--set update.parallel=fsdp`` for FSDP2); rank 0 writes.
"""

from __future__ import annotations

from pathlib import Path

import typer

from graft_cli.commands.confirm import YES_OPTION


def update(
    run_dir: Path = typer.Argument(..., help="Run directory (holds config.toml)."),
    iteration: int = typer.Option(..., "--iter", help="Iteration whose steps and advantages to train on."),
    overrides: list[str] = typer.Option(
        [], "--set", help="Override a config key for this command only, e.g. --set update.lr=1e-5."
    ),
    force: bool = typer.Option(
        False, "--force", help="Retrain a finished iteration and remove what was computed from it."
    ),
    yes: bool = YES_OPTION,
) -> None:
    """Train the policy on an iteration's steps and advantages; write the checkpoint and update table."""
    import polars as pl

    from graft_cli.commands.confirm import print_removed, stage_command
    from schemas.errors import GraftError
    from schemas.rundir import open_run
    from stages.loop import run_stage
    from stages.loop.stage import distributed_rank
    from stages.update import run_update

    if iteration < 0:
        raise GraftError(f"--iter {iteration}: iterations are >= 0")
    run = open_run(run_dir)
    config = run.load_config(overrides)
    command = stage_command(force, yes, overrides)
    # under torchrun every rank trains; rank 0 alone guards, prepares, records and prints
    done = run_stage(run, "update", iteration, config, runner=run_update, command=command)
    if distributed_rank() != 0:
        return
    print_removed(run, iteration, done.removed)
    summary = run.read(iteration, "update").filter(pl.col("epoch") == -1)
    values = dict(zip(summary["name"].to_list(), summary["value"].to_list(), strict=True))
    shown = ("loss", "kl", "clip_fraction", "ratio_mean", "grad_norm", "rows", "steps", "seconds")
    typer.echo(
        f"update iter {iteration}: "
        + ", ".join(f"{k}={values[k]:.4g}" for k in shown if k in values)
        + f" -> {run.checkpoint_dir(iteration)}"
    )


def export(
    run_dir: Path = typer.Argument(..., help="Run directory (holds config.toml)."),
    out: Path = typer.Option(..., "-o", "--out", help="New directory for the exported model."),
    iteration: int = typer.Option(
        -1, "--iter", help="Iteration whose checkpoint to export (default: the newest)."
    ),
) -> None:
    """Write a checkpoint's policy as a plain Hugging Face model directory (LoRA adapters merged in)."""
    from stages.policy.export import export_checkpoint

    exported, source = export_checkpoint(run_dir, iteration, out)
    typer.echo(f"exported {source} -> {exported}")


def register(app: typer.Typer) -> None:
    """Add this module's commands to the graft app."""
    app.command("update")(update)
    app.command("export")(export)
