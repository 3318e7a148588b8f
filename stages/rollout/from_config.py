"""What the rollout builds from the config: the engine, the environment, the initial model, the policy
of an iteration and the iteration's (group, task) pairs."""

from __future__ import annotations

from pathlib import Path

from schemas.config import Config
from schemas.errors import GraftError
from schemas.manifest import acting_checkpoint
from schemas.rundir import Run
from stages.envs.base import Environment, Task, environment_tasks
from stages.policy.engine import INITIAL_VERSION
from stages.policy.sampling import derive_rng


def make_environment(config: Config, options: dict | None = None) -> Environment:
    """The run's environment (``options``: instead of ``env.options``)."""
    from stages.envs.registry import make_env

    return make_env(
        config.env.name,
        max_turns=config.env.max_turns,
        invalid_penalty=config.env.invalid_penalty,
        data=config.env.data,
        **(config.env.options if options is None else options),
    )


def make_demo_environment(config: Config) -> Environment:
    """The environment the warm start's demos and DAgger rounds play: the run's, with
    ``sft.env_options`` over ``env.options`` (e.g. other rooms than the benchmark's)."""
    return make_environment(config, {**config.env.options, **config.sft.env_options})


def ensure_initial_model(run: Run, config: Config) -> Path:
    """The initial (reference) policy, made once: ``model.path`` or the tiny model built into
    ``run/model``, then — when ``sft.enabled`` — the warm start cloned from it into ``run/sft/model``."""
    from stages.policy.models import check_model_dir

    if config.model.path:
        base = check_model_dir(config.model.path)
    else:
        base = run.initial_model_dir
        if not (base / "config.json").is_file():  # the directory is renamed into place complete
            build_tiny_for_config(base, config)
    if not config.sft.enabled:
        return base
    from stages.sft import run_sft

    return run_sft(run, config, base)


def build_tiny_for_config(out: Path, config: Config) -> Path:
    """Build the tiny model of ``config`` (env, run seed, model.tiny_*) into ``out``."""
    from stages.policy.tiny import TinySpec, build_tiny_model

    spec = TinySpec(
        hidden=config.model.tiny_hidden, layers=config.model.tiny_layers, heads=config.model.tiny_heads
    )
    info = {"env": config.env.name, "env_options": dict(config.env.options)}
    # the warm start's rooms may show words the run's do not
    also = [make_demo_environment(config)] if config.sft.enabled and config.sft.env_options else []
    return build_tiny_model(
        out,
        make_environment(config),
        also=also,
        seed=config.run.seed,
        spec=spec,
        tasks_per_split=config.model.tiny_vocab_tasks,
        info=info,
    )


def policy_for_iteration(run: Run, iteration: int, config: Config) -> tuple[Path, str]:
    """(model directory, policy_version) acting in ``iteration``: the checkpoint of iteration - 1 (an error
    when it is missing), or the initial model in iteration 0."""
    checkpoint = acting_checkpoint(run, iteration, "rollout")
    if checkpoint is not None:
        return checkpoint, checkpoint.name
    return ensure_initial_model(run, config), INITIAL_VERSION


def iteration_groups(env: Environment, config: Config, iteration: int) -> list[tuple[int, Task]]:
    """The iteration's (group index, task) pairs: ``rollout.groups`` tasks drawn from the fixed ``train``
    set of ``env.train_tasks`` tasks (seeded by run seed), without replacement while they last."""
    pool = environment_tasks(env, "train", config.env.train_tasks, config.run.seed)
    if not pool:
        raise GraftError(f"environment '{config.env.name}' returned no train tasks")
    rng = derive_rng(config.run.seed, iteration, "rollout-tasks")
    n = config.rollout.groups
    picks = rng.choice(len(pool), size=n, replace=n > len(pool))
    return [(g, pool[int(i)]) for g, i in enumerate(picks)]
