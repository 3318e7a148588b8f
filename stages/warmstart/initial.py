"""The initial policy of a run, built from the config: ``model.path`` or the tiny model, then the warm
start cloned from it. Which policy acts in an iteration is ``schemas.initial_model.acting_policy``,
which builds nothing: ``stages.loop.stage.run_stage`` calls ``ensure_initial_model`` before a stage
that uses the initial policy (one rule, ``uses_initial_policy``), and ``graft sft`` makes it on its
own."""

from __future__ import annotations

from pathlib import Path

from schemas.config import Config
from schemas.initial_model import record_initial_models
from schemas.rundir import Run
from stages.envs.prompts import layout_prompt_fn
from stages.envs.registry import make_environment
from stages.warmstart.demos import make_demo_environment


def ensure_initial_model(run: Run, config: Config) -> Path:
    """The initial (reference) policy, made once: ``model.path`` or the tiny model built into
    ``run/model``, then — when ``sft.enabled`` — the warm start cloned from it into ``run/sft/model``;
    recorded in the run's manifest the first time, verified against it after (schemas.initial_model)."""
    from stages.policy.models import check_model_dir

    if config.model.path:
        base = check_model_dir(config.model.path)
    else:
        base = run.initial_model_dir
        if not (base / "config.json").is_file():  # the directory is renamed into place complete
            build_tiny_for_config(base, config)
    policy = base
    if config.sft.enabled:
        from stages.warmstart.sft import run_sft

        policy = run_sft(run, config, base)
    if run.config_path.is_file():  # a run (not a scratch folder for the tiny model): recorded, or verified
        record_initial_models(run, config)
    return policy


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
        prompt_fn=layout_prompt_fn(config.rollout.prompt_layout),
        info=info,
    )
