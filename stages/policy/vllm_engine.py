"""The ``vllm`` policy engine: vLLM's offline ``LLM`` API on GPU (SPEC §6, §12). ``vllm`` is imported only
when this engine is chosen (it has no CPU wheel; install the ``vllm`` extra on a GPU machine).

Requests carry token ids (``{"prompt_token_ids": ids}``), so vLLM and the hf engine see identical
inputs; the tokenizer is the model directory's own, loaded with transformers.

* ``generate``: one ``SamplingParams(n=1, temperature, max_tokens, logprobs=0, seed, stop,
  include_stop_str_in_output=True)`` per prompt, ``seed`` = that prompt's own ``seeds[i]`` (vLLM
  samples each request from its own seeded generator, so a row does not depend on its batch).
  ``logprobs=0`` returns the log-prob of each sampled token. The engine is created with
  ``logprobs_mode="processed_logprobs"`` (log-probs after temperature), matching the hf engine's
  convention of storing the sampling distribution's log-probs.
* ``choose``: the exact policy of SPEC §6 needs each admissible action's per-token log-probs, so
  every (prompt + action) sequence is one request with ``max_tokens=1, prompt_logprobs=0``. vLLM V1
  does not serve prompt log-probs from its prefix cache, so each request recomputes its whole prompt:
  K actions cost K prefills (docs/rollout.md). (``StructuredOutputsParams(choice=[...])`` would
  sample a token-by-token constrained distribution instead — not the mean-log-prob softmax the
  update stage assumes — so it is not used.)
* New weights per iteration (``engine_options.reload``): ``"fresh"`` (default) builds a new
  ``LLM(model=<checkpoint>)`` whenever the checkpoint changes; ``"reload_weights"`` serves from a
  private staging copy of the first model, copies each new checkpoint's safetensors into it, then
  calls ``collective_rpc("reload_weights")`` and ``reset_prefix_cache()`` (no engine restart).

Weights dtype: checkpoints hold float32 master weights, which vLLM's ``dtype="auto"`` would serve in
float32; the engine asks for ``bfloat16`` unless ``model.dtype`` names a dtype or
``rollout.engine_options.dtype`` overrides both (e.g. ``"float32"`` to serve the stored weights as is).

Engine options (``rollout.engine_options``): ``gpu_memory_utilization`` (0.85),
``tensor_parallel_size`` (1), ``max_model_len``, ``reload``, ``logprobs_mode``, ``enforce_eager``,
``dtype``.
"""

from __future__ import annotations

import gc
import json
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from schemas.errors import GraftError
from stages.policy.adapters import export_merged, is_adapter_dir
from stages.policy.engine import STOP_STRINGS, EngineOptions, Generation, check_seeds
from stages.policy.models import check_model_dir, load_tokenizer

LLM_OPTION_KEYS = (
    "gpu_memory_utilization",
    "tensor_parallel_size",
    "max_model_len",
    "enforce_eager",
    "logprobs_mode",
    "dtype",
)
DEFAULT_DTYPE = "bfloat16"  # vLLM's dtype when model.dtype is "auto" (checkpoints are float32)
VLLM_DTYPES = ("auto", "bfloat16", "float16", "half", "float32", "float")
SEED_MOD = 2**63 - 1


def _import_vllm() -> Any:
    try:
        import vllm
    except ImportError:
        raise GraftError(
            "rollout.engine = 'vllm' but vllm is not installed (pip install -e '.[vllm]' in the graft checkout on a GPU machine)"
        ) from None
    return vllm


def _logprob_of(entry: Any, token: int) -> float:
    """The log-prob of ``token`` in one position's {token_id: Logprob | float} mapping."""
    value = entry[token]
    return float(getattr(value, "logprob", value))


class VLLMEngine:
    """vLLM acting as the policy."""

    name = "vllm"

    def __init__(
        self, model_dir: Path, version: str, options: EngineOptions, vllm_module: Any = None
    ) -> None:
        self.vllm = vllm_module if vllm_module is not None else _import_vllm()
        self.options = options
        self.reload_mode = str(options.extra.get("reload", "fresh"))
        if self.reload_mode not in ("fresh", "reload_weights"):
            raise GraftError(
                f"rollout.engine_options.reload = '{self.reload_mode}': expected fresh or reload_weights"
            )
        dtype = options.extra.get("dtype", DEFAULT_DTYPE)
        if dtype not in VLLM_DTYPES:
            raise GraftError(
                f"rollout.engine_options.dtype = {dtype!r}: expected one of {', '.join(VLLM_DTYPES)}"
            )
        self.llm: Any = None
        self.model_dir: Path | None = None
        self.staging: Path | None = None
        self.merged: Path | None = None  # the merged policy of a LoRA checkpoint (a temporary directory)
        self.policy_version = version
        self.load(model_dir, version)

    # -- model management ------------------------------------------------------------------------

    def _llm_kwargs(self, path: Path) -> dict[str, Any]:
        kwargs: dict[str, Any] = {
            "model": str(path),
            "tokenizer": str(path),
            "dtype": DEFAULT_DTYPE if self.options.dtype == "auto" else self.options.dtype,
            "trust_remote_code": self.options.trust_remote_code,
            "load_format": "safetensors",
            "enable_prefix_caching": True,
            "seed": 0,
            "gpu_memory_utilization": 0.85,
            "logprobs_mode": "processed_logprobs",
        }
        kwargs.update({k: self.options.extra[k] for k in LLM_OPTION_KEYS if k in self.options.extra})
        return kwargs

    def load(self, model_dir: Path, version: str) -> None:
        model_dir = check_model_dir(model_dir)
        self.policy_version = version
        if self.model_dir is not None and model_dir.resolve() == self.model_dir.resolve():
            return
        served = self._servable(model_dir)
        if self.llm is None or self.reload_mode == "fresh":
            self._start(served)
        else:
            self._reload(served)
        self.model_dir = model_dir
        self.tokenizer = load_tokenizer(served, self.options.trust_remote_code)
        self.prompt_format = self._prompt_format(served)

    def _servable(self, model_dir: Path) -> Path:
        """``model_dir`` itself, or for a LoRA checkpoint its merged policy written to a temporary
        directory (docs/lora.md: one plain model per iteration, so vLLM runs it at full-model speed;
        LoRA requests were not measured -- no GPU here)."""
        if not is_adapter_dir(model_dir):
            return model_dir
        if self.merged is not None:
            shutil.rmtree(self.merged, ignore_errors=True)
        self.merged = Path(tempfile.mkdtemp(prefix="graft-vllm-merged-"))
        return export_merged(model_dir, self.merged / "model", self.options.trust_remote_code)

    def _start(self, model_dir: Path) -> None:
        self._close_llm()  # not close(): a LoRA checkpoint's merged directory is what it will serve
        serve_from = model_dir
        if self.reload_mode == "reload_weights":
            self.staging = Path(tempfile.mkdtemp(prefix="graft-vllm-"))
            serve_from = self.staging / "model"
            shutil.copytree(model_dir, serve_from)
        self.llm = self.vllm.LLM(**self._llm_kwargs(serve_from))

    def _reload(self, model_dir: Path) -> None:
        assert self.staging is not None
        target = self.staging / "model"
        for old in target.glob("*.safetensors*"):
            old.unlink()
        for new in model_dir.glob("*.safetensors*"):  # weights (+ index for sharded checkpoints)
            shutil.copy2(new, target / new.name)
        self.llm.collective_rpc("reload_weights")
        self.llm.reset_prefix_cache()

    def _prompt_format(self, model_dir: Path) -> str:
        if self.options.prompt_format in ("raw", "chat"):
            return self.options.prompt_format
        declared = json.loads((model_dir / "config.json").read_text()).get("graft_prompt_format")
        if declared in ("raw", "chat"):
            return declared
        return "chat" if getattr(self.tokenizer, "chat_template", None) else "raw"

    def close(self) -> None:
        self._close_llm()
        if self.merged is not None:
            shutil.rmtree(self.merged, ignore_errors=True)
            self.merged = None

    def _close_llm(self) -> None:
        if self.llm is not None:
            self.llm = None
            gc.collect()
            try:
                import torch

                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
            except ImportError:  # pragma: no cover
                pass
        if self.staging is not None:
            shutil.rmtree(self.staging, ignore_errors=True)
            self.staging = None

    # -- policy calls ----------------------------------------------------------------------------

    def score_choices(
        self, prompts_ids: Sequence[Sequence[int]], choices_ids: Sequence[Sequence[Sequence[int]]]
    ) -> list[list[np.ndarray]]:
        requests, spans = [], []
        for prompt, choices in zip(prompts_ids, choices_ids, strict=True):
            for choice in choices:
                requests.append({"prompt_token_ids": [*prompt, *choice]})
                spans.append((len(prompt), list(choice)))
        params = self.vllm.SamplingParams(n=1, temperature=1.0, max_tokens=1, prompt_logprobs=0)
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        flat = []
        for out, (start, choice) in zip(outputs, spans, strict=True):
            entries = out.prompt_logprobs
            flat.append(
                np.array(
                    [_logprob_of(entries[start + i], tok) for i, tok in enumerate(choice)], dtype=np.float32
                )
            )
        result, k = [], 0
        for choices in choices_ids:
            result.append(flat[k : k + len(choices)])
            k += len(choices)
        return result

    def generate(
        self,
        prompts_ids: Sequence[Sequence[int]],
        *,
        temperature: float,
        max_new_tokens: int,
        stop: Sequence[str] = STOP_STRINGS,
        seeds: Sequence[int],
    ) -> list[Generation]:
        row_seeds = check_seeds(prompts_ids, seeds)
        if not prompts_ids:
            return []
        params = [
            self.vllm.SamplingParams(
                n=1,
                temperature=max(0.0, temperature),
                max_tokens=max_new_tokens,
                logprobs=0,
                seed=row_seed % SEED_MOD,
                stop=list(stop),
                include_stop_str_in_output=True,
                skip_special_tokens=True,
            )
            for row_seed in row_seeds
        ]
        outputs = self.llm.generate(
            [{"prompt_token_ids": list(p)} for p in prompts_ids], params, use_tqdm=False
        )
        gens = []
        for out in outputs:
            completion = out.outputs[0]
            ids = [int(t) for t in completion.token_ids]
            lps = [_logprob_of(entry, tok) for entry, tok in zip(completion.logprobs, ids, strict=True)]
            if completion.finish_reason == "length":
                reason = "length"
            elif isinstance(getattr(completion, "stop_reason", None), str):
                reason = "stop"
            else:
                reason = "eos"
            gens.append(Generation(ids, lps, completion.text, reason))
        return gens
