"""Loading a policy model directory (docs/design.md §6, §11) and calling it with a KV cache.

Any local Hugging Face causal-LM directory is accepted. Weights load from safetensors only
(``use_safetensors=True``); custom modelling code runs only when the config sets
``model.trust_remote_code``.
"""

from __future__ import annotations

import functools
import inspect
import re
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from schemas.errors import GraftError
from stages.policy.quiet import quiet_transformers
from stages.policy.remote_code import remote_code_errors


def check_model_dir(path: str | Path) -> Path:
    """Refuse, with one line, a path that is not a local HF model directory with safetensors weights."""
    text = str(path)
    path = Path(path)
    if not path.is_dir():
        if looks_local(path):
            raise GraftError(missing_local_model(path))
        if re.fullmatch(r"[\w.-]+/[\w.-]+", text) and not text.startswith("."):
            # a Hugging Face Hub id: graft never downloads at run time
            raise GraftError(
                f"{text}: looks like a Hugging Face Hub id, and graft loads only local directories; "
                f"download it once where there is internet (huggingface-cli download {text} --local-dir "
                f"models/{text.split('/')[-1]}) and set model.path to that directory"
            )
        raise GraftError(f"{path}: model directory not found")
    from stages.policy.adapters import ADAPTER_WEIGHTS, adapter_base, is_adapter_dir

    if is_adapter_dir(path):  # a LoRA checkpoint: its adapters and the base they adapt
        if not (path / ADAPTER_WEIGHTS).is_file():
            raise GraftError(f"{path}: LoRA checkpoint without {ADAPTER_WEIGHTS}")
        adapter_base(path)
        return path
    if not (path / "config.json").is_file():
        raise GraftError(f"{path}: not a Hugging Face model directory (no config.json)")
    if not any(path.glob("*.safetensors")):
        raise GraftError(f"{path}: no *.safetensors weights (graft loads models from safetensors only)")
    return path


LOCAL_MODELS = "models"  # where the presets' headers put converted or downloaded models


def looks_local(path: Path) -> bool:
    """A path that names a local directory even though it does not exist (yet): under ``models/``
    (the presets' folder) or under a folder that exists here."""
    return path.parts[:1] == (LOCAL_MODELS,) or (len(path.parts) > 1 and path.parent.is_dir())


def missing_local_model(path: Path) -> str:
    """The one line for a local model directory that does not exist, with the command that makes it."""
    from stages.policy.gguf_import import PACKAGED_GGUF

    if path.name in PACKAGED_GGUF:
        make = f"graft init-model {path} --gguf {path.name}"
    else:
        make = f"graft init-model {path} --gguf FILE (a GGUF file), or download a model there"
    return f"{path}: local model directory not found (graft never downloads); create it first: {make}"


def resolve_device(device: str) -> torch.device:
    """``cpu`` | ``cuda`` | ``cuda:N`` | ``auto`` (cuda when available)."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise GraftError(f"run.device = '{device}' but no CUDA device is available")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """``auto`` = float32 on CPU (exact log-probs), bfloat16 on GPU."""
    if dtype == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    try:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    except KeyError:
        raise GraftError(f"model.dtype = '{dtype}': expected auto, float32, bfloat16 or float16") from None


def load_tokenizer(path: str | Path, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    path = check_model_dir(path)
    with remote_code_errors(path, trust_remote_code):
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_causal_lm(
    path: str | Path,
    *,
    device: str | torch.device = "cpu",
    dtype: str = "auto",
    trust_remote_code: bool = False,
) -> PreTrainedModel:
    """Load a causal LM from safetensors in eval mode on ``device`` (a LoRA checkpoint: its base with
    the adapters merged into the weights)."""
    path = check_model_dir(path)
    dev = device if isinstance(device, torch.device) else resolve_device(device)
    from stages.policy.adapters import is_adapter_dir, merged_model

    if is_adapter_dir(path):
        merged = merged_model(path, trust_remote_code=trust_remote_code)
        return merged.to(device=dev, dtype=resolve_dtype(dtype, dev)).eval()
    quiet_transformers()
    try:
        with remote_code_errors(path, trust_remote_code):
            model = AutoModelForCausalLM.from_pretrained(
                path,
                use_safetensors=True,
                trust_remote_code=trust_remote_code,
                dtype=resolve_dtype(dtype, dev),
            )
    except ValueError as exc:  # e.g. custom code without trust_remote_code
        raise GraftError(f"{path}: cannot load the model ({str(exc).splitlines()[0]})") from None
    return model.to(dev).eval()


def prompt_format(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, setting: str = "auto") -> str:
    """``raw`` (the template text is the model input) or ``chat`` (wrapped by the chat template).

    ``auto``: the tiny model says ``raw`` in its config (``graft_prompt_format``); any other model is
    ``chat`` when its tokenizer has a chat template.
    """
    if setting in ("raw", "chat"):
        return setting
    declared = getattr(model.config, "graft_prompt_format", None)
    if declared in ("raw", "chat"):
        return declared
    return "chat" if getattr(tokenizer, "chat_template", None) else "raw"


@functools.cache
def _cache_kwarg(model_cls: type) -> str:
    # transformers 5.x names the KV cache argument ``cache``; 4.x called it ``past_key_values``.
    params = inspect.signature(model_cls.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def forward_with_cache(model: PreTrainedModel, cache: Any, **inputs: Any) -> tuple[torch.Tensor, Any]:
    """Run ``model`` with a KV cache; return (logits, the updated cache)."""
    out = model(**inputs, **{_cache_kwarg(type(model)): cache}, use_cache=True)
    new_cache = getattr(out, "cache", None)
    if new_cache is None:
        new_cache = out.past_key_values
    return out.logits, new_cache
