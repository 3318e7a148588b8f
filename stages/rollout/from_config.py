"""What the rollout builds from the config: the engine, the environment, the initial model, the policy
of an iteration and the iteration's (group, task) pairs."""

from __future__ import annotations

from pathlib import Path

from schemas.config import Config
from schemas.errors import GraftError
from schemas.manifest import acting_checkpoint
from schemas.rundir import Run
from stages.envs.base import Environment, Task, environment_tasks
from stages.policy.engine import EngineOptions, PolicyEngine
from stages.policy.sampling import derive_rng

INITIAL_VERSION = "initial"  # policy_version of the initial (reference) model


def engine_options(config: Config) -> EngineOptions:
    """Engine settings from the config."""
    extra = dict(config.rollout.engine_options)
    if config.rollout.engine == "vllm":  # the longest request a rollout sends: the KV cache it needs
        extra.setdefault("max_model_len", config.rollout.max_prompt_tokens + config.rollout.max_new_tokens)
    return EngineOptions(
        device=config.run.device,
        dtype=config.model.dtype,
        trust_remote_code=config.model.trust_remote_code,
        prompt_format=config.model.prompt_format,
        lora_rank=config.update.lora.r,
        extra=extra,
    )


_ENGINES: dict[tuple[str, str], PolicyEngine] = {}  # one live engine per (kind, options), reloaded per policy


def make_engine(config: Config, model_dir: str | Path, version: str = INITIAL_VERSION) -> PolicyEngine:
    """The configured engine acting with ``model_dir`` (an engine of the same kind is reused and reloaded)."""
    from stages.policy.engine import make_engine as build

    options = engine_options(config)
    key = (config.rollout.engine, repr(options))
    engine = _ENGINES.get(key)
    if engine is None:
        for stale in _ENGINES.values():  # at most one model in memory (a vLLM engine holds the GPU)
            stale.close()
        _ENGINES.clear()
        engine = build(config.rollout.engine, Path(model_dir), version, options)
        _ENGINES[key] = engine
    else:
        engine.load(Path(model_dir), version)
    return engine


def release_engines() -> int:
    """Free the memory of every live rollout engine for the update: an engine that can sleep (vLLM on a
    GPU) sleeps and stays, to be woken by its next ``load``; any other is closed, and the next
    ``make_engine`` builds a new one. Returns how many were released or closed."""
    released = len(_ENGINES)
    for key, engine in list(_ENGINES.items()):
        if not engine.release():
            engine.close()
            del _ENGINES[key]
    if released:
        import gc

        import torch

        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return released


def engine_released_for_update(config: Config) -> bool:
    """Whether the loop frees the rollout engine before an update or evaluation
    (``rollout.release_engine``; "auto": when the run is on a GPU, where the update needs its memory)."""
    mode = config.rollout.release_engine
    if mode != "auto":
        return mode == "always"
    from stages.policy.models import resolve_device

    return resolve_device(config.run.device).type == "cuda"


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
