"""The tiny policy: deterministic weights, a tokenizer that reloads with the same ids, loading rules."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from graft_cli.app import app
from schemas.errors import GraftError
from stages.policy.models import check_model_dir, load_causal_lm, load_tokenizer, prompt_format
from stages.policy.tiny import TinySpec, build_tiny_model, environment_texts
from stages.policy.tokenizer import TAG_TOKENS
from tests.helpers.rollout_fakes import CorridorEnv, corridor_prompt

torch.set_num_threads(1)
SPEC = TinySpec(hidden=32, layers=1, heads=2)


def _build(path: Path, seed: int) -> Path:
    return build_tiny_model(
        path, CorridorEnv(), seed=seed, spec=SPEC, tasks_per_split=10, prompt_fn=corridor_prompt
    )


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return _build(tmp_path_factory.mktemp("tiny") / "model", seed=3)


def test_same_seed_gives_byte_identical_weights(tiny: Path, tmp_path: Path) -> None:
    again = _build(tmp_path / "again", seed=3)
    other = _build(tmp_path / "other", seed=4)
    assert _digest(again / "model.safetensors") == _digest(tiny / "model.safetensors")
    assert _digest(again / "tokenizer.json") == _digest(tiny / "tokenizer.json")
    assert _digest(other / "model.safetensors") != _digest(tiny / "model.safetensors")
    # the tokenizer depends on the environment only, not on the weight seed
    assert _digest(other / "tokenizer.json") == _digest(tiny / "tokenizer.json")


def test_build_leaves_global_torch_rng_alone(tmp_path: Path) -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    _build(tmp_path / "m", seed=9)
    assert torch.equal(torch.rand(3), expected)


def test_autotokenizer_reload_gives_the_same_ids(tiny: Path) -> None:
    built = load_tokenizer(tiny)
    reloaded = AutoTokenizer.from_pretrained(tiny)
    texts = list(environment_texts(CorridorEnv(), tasks_per_split=4, prompt_fn=corridor_prompt))
    texts += [
        "<think>go left</think><action>go to room 2</action>",
        "never seen words zyx 123 !?",
        "<|im_end|>",
    ]
    for text in texts:
        assert reloaded(text)["input_ids"] == built(text)["input_ids"], text
        assert reloaded.decode(reloaded(text)["input_ids"]) == text
    # the hand-built tokenizer object and the saved directory agree too
    assert reloaded.convert_tokens_to_ids("<action>") == built.convert_tokens_to_ids("<action>")


def test_every_environment_word_and_tag_is_one_token(tiny: Path) -> None:
    tok = load_tokenizer(tiny)
    pre = tok.backend_tokenizer.pre_tokenizer
    norm = tok.backend_tokenizer.normalizer
    tags = re.compile("(" + "|".join(re.escape(t) for t in TAG_TOKENS) + ")")
    for text in environment_texts(CorridorEnv(), tasks_per_split=4, prompt_fn=corridor_prompt):
        # added tags split the text first; each remaining fragment is pre-tokenized into words
        fragments = tags.split(text)
        expected = sum(
            1 if tags.fullmatch(f) else len(pre.pre_tokenize_str(norm.normalize_str(f))) for f in fragments
        )
        assert len(tok(text, add_special_tokens=False)["input_ids"]) == expected, text
    for tag in TAG_TOKENS:
        assert len(tok.encode(tag, add_special_tokens=False)) == 1


def test_model_loads_from_safetensors_as_a_raw_prompt_qwen2(tiny: Path) -> None:
    model = load_causal_lm(tiny)
    tok = load_tokenizer(tiny)
    assert model.config.model_type == "qwen2"
    assert prompt_format(model, tok) == "raw"
    assert prompt_format(model, tok, "chat") == "chat"
    assert model.config.vocab_size == len(tok)
    assert tok.chat_template  # saved with a chat template for chat-style use
    n = sum(p.numel() for p in model.parameters())
    assert 10_000 < n < 5_000_000
    out = model(torch.tensor([tok("go to room 1")["input_ids"]])).logits
    assert out.shape[-1] == len(tok)


def test_model_dirs_without_safetensors_are_refused(tiny: Path, tmp_path: Path) -> None:
    with pytest.raises(GraftError, match="not found"):
        check_model_dir(tmp_path / "missing")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((tiny / "config.json").read_text())
    (bad / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(GraftError, match="safetensors"):
        load_causal_lm(bad)


def test_init_model_cli(runner, tmp_path: Path) -> None:
    out = tmp_path / "m"
    args = [
        "init-model",
        str(out),
        "--tiny",
        "--env",
        "household",
        "--hidden",
        "32",
        "--layers",
        "1",
        "--heads",
        "2",
    ]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    model = load_causal_lm(out)
    assert model.config.hidden_size == 32 and model.config.num_hidden_layers == 1
    again = runner.invoke(app, args)
    assert again.exit_code == 2 and "exists" in again.output
    assert runner.invoke(app, ["init-model", str(tmp_path / "x")]).exit_code == 2
