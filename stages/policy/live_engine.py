"""The engine a run acts with: built from the config (``rollout.engine``, ``[model]``,
``rollout.engine_options``), kept alive between uses and reloaded with each new policy, released for the
update."""

from __future__ import annotations

import atexit
from pathlib import Path

from schemas.config import Config
from schemas.errors import GraftError
from stages.policy.engine import INITIAL_VERSION, EngineOptions, PolicyEngine


def build_engine(name: str, model_dir: str | Path, version: str, options: EngineOptions) -> PolicyEngine:
    """Build engine ``name`` (``hf`` | ``vllm``) acting with ``model_dir``."""
    if name == "hf":
        from stages.policy.hf_engine import HFEngine

        return HFEngine(Path(model_dir), version, options)
    if name == "vllm":
        from stages.policy.vllm_engine import VLLMEngine

        return VLLMEngine(Path(model_dir), version, options)
    raise GraftError(f"rollout.engine = '{name}': expected 'hf' or 'vllm'")


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
_ENGINES_CLOSED_AT_EXIT: list[bool] = []  # [True] once ``close_engines`` is registered with atexit


def live_engine(config: Config, model_dir: str | Path, version: str = INITIAL_VERSION) -> PolicyEngine:
    """The configured engine acting with ``model_dir`` (an engine of the same kind is reused and reloaded)."""
    options = engine_options(config)
    key = (config.rollout.engine, repr(options))
    engine = _ENGINES.get(key)
    if engine is None:
        for stale in _ENGINES.values():  # at most one model in memory (a vLLM engine holds the GPU)
            stale.close()
        _ENGINES.clear()
        engine = build_engine(config.rollout.engine, Path(model_dir), version, options)
        if not _ENGINES_CLOSED_AT_EXIT:
            # a stage command run on its own (`graft rollout`, `graft eval`) never reaches the loop's
            # close: without this, a vLLM engine's merged LoRA weights stay in the temp folder
            atexit.register(close_engines)
            _ENGINES_CLOSED_AT_EXIT.append(True)
        _ENGINES[key] = engine
    else:
        engine.load(Path(model_dir), version)
    return engine


def release_engines() -> int:
    """Free the memory of every live rollout engine for the update: an engine that can sleep (vLLM on a
    GPU) sleeps and stays, to be woken by its next ``load``; any other is closed, and the next
    ``live_engine`` builds a new one. Returns how many were released or closed."""
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


def close_engines() -> None:
    """Close every live rollout engine (the end of a loop: a vLLM engine's processes stop cleanly)."""
    for engine in _ENGINES.values():
        engine.close()
    _ENGINES.clear()


def engine_released_for_update(config: Config) -> bool:
    """Whether the loop frees the rollout engine before an update or evaluation
    (``rollout.release_engine``; "auto": when the run is on a GPU, where the update needs its memory)."""
    mode = config.rollout.release_engine
    if mode != "auto":
        return mode == "always"
    from stages.policy.models import resolve_device

    return resolve_device(config.run.device).type == "cuda"
