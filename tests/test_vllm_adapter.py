"""The vLLM adapter against a fake ``vllm`` module: requests it builds, outputs it parses, reloads."""

from __future__ import annotations

import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from schemas import validate_steps
from schemas.errors import GraftError
from stages.policy.engine import EngineOptions
from stages.policy.tiny import TinySpec, build_tiny_model
from stages.policy.vllm_engine import VLLMEngine
from stages.rollout import collect_episodes
from tests.rollout_fakes import CorridorEnv, corridor_prompt


def fake_logprob(position: int, token: int) -> float:
    """The fake model's log p(token at ``position``): any deterministic function works for parsing tests."""
    return -0.01 * ((7 * token + 3 * position) % 97) - 0.05


@dataclass
class Logprob:
    logprob: float
    rank: int = 1
    decoded_token: str = ""


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    max_tokens: int = 16
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True


class FakeLLM:
    instances: list[FakeLLM] = []
    script: list[tuple[list[int], str, str, Any]] = []  # (token ids, text, finish_reason, stop_reason)

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs
        self.calls: list[tuple[list[dict], Any]] = []
        self.rpcs: list[str] = []
        self.prefix_resets = 0
        self.weights_at_reload: list[bytes] = []
        FakeLLM.instances.append(self)

    def generate(self, prompts, params, use_tqdm=True):
        self.calls.append((prompts, params))
        outs = []
        for i, prompt in enumerate(prompts):
            ids = prompt["prompt_token_ids"]
            p = params[i] if isinstance(params, list) else params
            prompt_lps = [None] + [{t: Logprob(fake_logprob(pos, t))} for pos, t in enumerate(ids) if pos > 0]
            tokens, text, reason, stop_reason = (
                FakeLLM.script[i % len(FakeLLM.script)] if FakeLLM.script else ([1], "x", "length", None)
            )
            tokens = tokens[: p.max_tokens]
            sample_lps = [{t: Logprob(fake_logprob(len(ids) + k, t))} for k, t in enumerate(tokens)]
            completion = types.SimpleNamespace(
                token_ids=tokens,
                logprobs=sample_lps,
                text=text,
                finish_reason=reason,
                stop_reason=stop_reason,
            )
            outs.append(
                types.SimpleNamespace(
                    prompt_logprobs=prompt_lps if p.prompt_logprobs is not None else None,
                    outputs=[completion],
                )
            )
        return outs

    def collective_rpc(self, method: str, *args, **kwargs):
        self.rpcs.append(method)
        self.weights_at_reload.append((Path(self.kwargs["model"]) / "model.safetensors").read_bytes())

    def reset_prefix_cache(self) -> None:
        self.prefix_resets += 1


fake_vllm = types.SimpleNamespace(LLM=FakeLLM, SamplingParams=SamplingParams)


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
    FakeLLM.script = []


def test_llm_is_built_safetensors_only_with_processed_logprobs(models) -> None:
    engine = VLLMEngine(
        models[0], "initial", EngineOptions(extra={"tensor_parallel_size": 2}), vllm_module=fake_vllm
    )
    kwargs = FakeLLM.instances[0].kwargs
    assert kwargs["model"] == str(models[0]) and kwargs["load_format"] == "safetensors"
    assert kwargs["logprobs_mode"] == "processed_logprobs" and kwargs["tensor_parallel_size"] == 2
    assert kwargs["trust_remote_code"] is False
    assert kwargs["dtype"] == "bfloat16"  # the float32 checkpoint is served in bf16 by default
    assert engine.prompt_format == "raw"  # the tiny model's config says so


@pytest.mark.parametrize(
    ("model_dtype", "extra", "served"),
    [
        ("auto", {}, "bfloat16"),
        ("float16", {}, "float16"),
        ("auto", {"dtype": "float32"}, "float32"),
        ("float16", {"dtype": "bfloat16"}, "bfloat16"),
    ],
)
def test_dtype_from_model_dtype_and_engine_options(models, model_dtype, extra, served) -> None:
    VLLMEngine(models[0], "initial", EngineOptions(dtype=model_dtype, extra=extra), vllm_module=fake_vllm)
    assert FakeLLM.instances[0].kwargs["dtype"] == served


def test_unknown_engine_dtype_is_a_user_error(models) -> None:
    with pytest.raises(GraftError, match="rollout.engine_options.dtype = 'fp8'"):
        VLLMEngine(models[0], "initial", EngineOptions(extra={"dtype": "fp8"}), vllm_module=fake_vllm)
    assert not FakeLLM.instances


def test_score_choices_requests_and_parsing(models) -> None:
    engine = VLLMEngine(models[0], "initial", EngineOptions(), vllm_module=fake_vllm)
    prompts = [[5, 6, 7, 8], [9, 10]]
    choices = [[[11, 12], [13]], [[14, 15, 16]]]
    scored = engine.score_choices(prompts, choices)
    prompts_sent, params = FakeLLM.instances[0].calls[0]
    assert [p["prompt_token_ids"] for p in prompts_sent] == [
        [5, 6, 7, 8, 11, 12],
        [5, 6, 7, 8, 13],
        [9, 10, 14, 15, 16],
    ]
    assert params.max_tokens == 1 and params.prompt_logprobs == 0 and params.temperature == 1.0
    expected = [
        [[fake_logprob(4, 11), fake_logprob(5, 12)], [fake_logprob(4, 13)]],
        [[fake_logprob(2, 14), fake_logprob(3, 15), fake_logprob(4, 16)]],
    ]
    assert len(scored) == 2 and [len(s) for s in scored] == [2, 1]
    for got_prompt, exp_prompt in zip(scored, expected, strict=True):
        for got, exp in zip(got_prompt, exp_prompt, strict=True):
            np.testing.assert_allclose(got, exp, rtol=1e-6)


def test_generate_requests_and_finish_reasons(models) -> None:
    engine = VLLMEngine(models[0], "initial", EngineOptions(), vllm_module=fake_vllm)
    FakeLLM.script = [
        ([3, 4, 5], "<action>look</action>", "stop", "</action>"),
        ([3, 0], "think", "stop", None),  # stopped by EOS: stop_reason None
        ([3, 3, 3, 3], "aaaa", "length", None),
    ]
    seeds = [41, 7, 2**62 + 3]
    gens = engine.generate([[1, 2], [1], [2, 2, 2]], temperature=0.7, max_new_tokens=4, seeds=seeds)
    _, params = FakeLLM.instances[0].calls[0]
    assert [p.seed for p in params] == seeds  # each request samples from its own row's seed
    assert all(p.temperature == 0.7 and p.max_tokens == 4 and p.logprobs == 0 for p in params)
    assert all(p.include_stop_str_in_output and "</action>" in p.stop for p in params)
    assert [g.finish_reason for g in gens] == ["stop", "eos", "length"]
    assert gens[0].response_ids == [3, 4, 5] and gens[0].text == "<action>look</action>"
    np.testing.assert_allclose(
        gens[2].response_logprobs, [fake_logprob(3 + k, 3) for k in range(4)], rtol=1e-6
    )
    with pytest.raises(ValueError, match="one per prompt"):
        engine.generate([[1], [2]], temperature=0.7, max_new_tokens=4, seeds=[1])


def test_fresh_reload_builds_a_new_llm_per_checkpoint(models) -> None:
    engine = VLLMEngine(models[0], "initial", EngineOptions(), vllm_module=fake_vllm)
    engine.load(models[0], "initial")
    assert len(FakeLLM.instances) == 1  # same checkpoint: nothing to do
    engine.load(models[1], "iter_0000")
    assert len(FakeLLM.instances) == 2 and FakeLLM.instances[1].kwargs["model"] == str(models[1])
    assert engine.policy_version == "iter_0000"


def test_reload_weights_mode_swaps_weights_in_place(models) -> None:
    options = EngineOptions(extra={"reload": "reload_weights"})
    engine = VLLMEngine(models[0], "initial", options, vllm_module=fake_vllm)
    llm = FakeLLM.instances[0]
    served = Path(llm.kwargs["model"])
    assert (
        served != models[0]
        and (served / "model.safetensors").read_bytes() == (models[0] / "model.safetensors").read_bytes()
    )
    engine.load(models[1], "iter_0000")
    assert len(FakeLLM.instances) == 1
    assert llm.rpcs == ["reload_weights"] and llm.prefix_resets == 1
    assert llm.weights_at_reload[0] == (models[1] / "model.safetensors").read_bytes()
    assert (models[0] / "model.safetensors").read_bytes() != (models[1] / "model.safetensors").read_bytes()
    engine.close()
    assert not served.exists()


def test_unknown_reload_mode_and_missing_vllm(models) -> None:
    with pytest.raises(GraftError, match="reload"):
        VLLMEngine(models[0], "initial", EngineOptions(extra={"reload": "hot"}), vllm_module=fake_vllm)
    try:
        import vllm  # noqa: F401
    except ImportError:
        with pytest.raises(GraftError, match="not installed"):
            VLLMEngine(models[0], "initial", EngineOptions())


def test_rollout_through_the_adapter_gives_a_valid_table(models) -> None:
    engine = VLLMEngine(models[0], "initial", EngineOptions(), vllm_module=fake_vllm)
    env = CorridorEnv(max_turns=3)
    steps = collect_episodes(
        engine,
        env,
        env.tasks("train", 2, 0),
        2,
        mode="choose",
        temperature=1.0,
        history_length=2,
        seed=0,
        iteration=0,
        policy_version="initial",
        progress=False,
        prompt_fn=corridor_prompt,
    )
    validate_steps(steps)
    for row in steps.iter_rows(named=True):
        start = len(row["prompt_ids"])
        expected = [fake_logprob(start + i, t) for i, t in enumerate(row["response_ids"])]
        np.testing.assert_allclose(row["response_logprobs"], expected, rtol=1e-6)
        assert row["action"] in row["choices"]


@pytest.mark.parametrize("reload", ["fresh", "reload_weights"])
def test_a_lora_checkpoint_is_served_as_its_merged_policy(models, tmp_path, reload) -> None:
    # issue 26 item 2: vLLM acts with the merged policy of a LoRA checkpoint (a plain model directory)
    pytest.importorskip("peft")
    import torch
    from peft import get_peft_model
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from schemas.config import LoraConfig
    from stages.update.checkpoint import save_adapters
    from stages.update.lora import peft_config

    base = AutoModelForCausalLM.from_pretrained(models[0], dtype=torch.float32)
    torch.manual_seed(0)
    adapters = get_peft_model(base, peft_config(LoraConfig(r=2, alpha=4.0)))
    with torch.no_grad():
        for name, param in adapters.named_parameters():
            if ".lora_B." in name:
                param.normal_(0, 0.1)
    checkpoint = tmp_path / "run" / "checkpoints" / "iter_0000"
    checkpoint.mkdir(parents=True)
    save_adapters(checkpoint, checkpoint, adapters, models[0])
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (checkpoint / name).write_bytes((models[0] / name).read_bytes())
    merged = {k: v.clone() for k, v in adapters.merge_and_unload().state_dict().items()}

    engine = VLLMEngine(models[0], "initial", EngineOptions(extra={"reload": reload}), vllm_module=fake_vllm)
    engine.load(checkpoint, "iter_0000")
    llm = FakeLLM.instances[-1]
    served = Path(llm.kwargs["model"]) if reload == "fresh" else Path(engine.staging) / "model"
    assert served != checkpoint and not (served / "adapter_config.json").exists()
    weights = load_file(str(served / "model.safetensors"))
    assert weights.keys() <= merged.keys()
    for key, value in weights.items():
        torch.testing.assert_close(value, merged[key], msg=key)
    assert engine.policy_version == "iter_0000" and engine.prompt_format == "raw"
    merged_dir = engine.merged
    engine.close()
    assert merged_dir is not None and not merged_dir.exists()
