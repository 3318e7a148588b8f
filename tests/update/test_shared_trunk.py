"""The trunk once per row (stages/update/shared_trunk.py): the split forward against the plain Hugging
Face forward, who may share a trunk, how often it is computed, and an update with it against one
without."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import transformers

from stages.update import shared_trunk
from stages.update.logprobs import build_choice_batch, build_response_batch, selected_log_probs
from stages.update.shared_trunk import TrunkCache, cache_of, final_hidden, join, leave, trunk_split

torch.set_num_threads(1)


def llama(layers: int = 3, seed: int = 0, attn: str = "sdpa") -> torch.nn.Module:
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.config._attn_implementation = attn
    return model


def adapt_top(model: torch.nn.Module, k: int) -> list[torch.nn.Parameter]:
    """Freeze every weight but those of the last ``k`` decoder layers (what LoRA on the top K leaves
    trainable, as far as the trunk is concerned); returns the trainable ones."""
    model.requires_grad_(False)
    top = [p for layer in model.get_decoder().layers[-k:] for p in layer.parameters()]
    for p in top:
        p.requires_grad_(True)
    return top


def rows(seed: int, n: int = 5):
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(1, 64, size=int(rng.integers(3, 30))).tolist() for _ in range(n)]
    responses = [rng.integers(1, 64, size=int(rng.integers(1, 9))).tolist() for _ in range(n)]
    return prompts, responses


def scores_and_grads(model, batch, top):
    """Log-probs of ``batch`` at T = 0.7 and the gradient of a fixed weighting of them on ``top``."""
    model.zero_grad(set_to_none=True)
    logp, _ = selected_log_probs(model, batch, temperature=0.7)
    (logp * torch.linspace(-1, 1, logp.numel())).sum().backward()
    return logp.detach(), torch.cat([p.grad.flatten() for p in top])


@pytest.fixture(autouse=True)
def _leave_all():
    yield
    shared_trunk._JOINED.clear()


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_split_forward_equals_the_plain_decoder_at_every_real_position(attn):
    model = llama(3, attn=attn)
    adapt_top(model, 1)
    cache = TrunkCache(lora_layers=1)
    assert trunk_split(model, 1) == 2 and join(model, cache) and cache_of(model) is cache
    batch, _ = build_response_batch(*rows(1))  # unequal lengths: right padding
    real = batch.attention_mask.bool()
    with torch.no_grad():
        plain = model.get_decoder()(input_ids=batch.input_ids, attention_mask=batch.attention_mask)[0]
        split = final_hidden(model, batch.input_ids, batch.attention_mask)
    assert split is not None and split.shape == plain.shape
    torch.testing.assert_close(split[real], plain[real], rtol=0, atol=1e-5)
    assert (cache.rows_computed, cache.rows_reused) == (5, 0)


def test_token_rows_score_and_train_like_the_plain_forward():
    model = llama(3)
    top = adapt_top(model, 1)
    batch, _ = build_response_batch(*rows(2, n=6))

    plain_lp, plain_grad = scores_and_grads(model, batch, top)
    assert join(model, TrunkCache(lora_layers=1))
    shared_lp, shared_grad = scores_and_grads(model, batch, top)  # computes the trunk
    again_lp, again_grad = scores_and_grads(model, batch, top)  # reads it
    for lp, grad in ((shared_lp, shared_grad), (again_lp, again_grad)):
        torch.testing.assert_close(lp, plain_lp, rtol=0, atol=1e-5)
        torch.testing.assert_close(grad, plain_grad, rtol=1e-4, atol=1e-6)
    assert cache_of(model).rows_reused == 6


def test_the_reference_and_the_policy_compute_each_row_once_and_keep_their_own_top():
    policy = llama(3, seed=0)
    reference = copy.deepcopy(policy)
    with torch.no_grad():  # the reference's top layer differs (the adapters moved), its trunk does not
        for p in reference.get_decoder().layers[2].parameters():
            p.add_(0.05 * torch.randn_like(p))
    adapt_top(policy, 1)
    reference.requires_grad_(False)
    prompts, responses = rows(3, n=7)
    prompts[6], responses[6] = prompts[0], responses[0]  # a repeated row: one trunk
    batch, _ = build_response_batch(prompts, responses)
    with torch.no_grad():
        plain_ref, _ = selected_log_probs(reference, batch)
        plain_pol, _ = selected_log_probs(policy, batch)
    cache = TrunkCache(lora_layers=1)
    assert join(reference, cache)
    with torch.no_grad():
        ref_lp, _ = selected_log_probs(reference, batch)
    leave(reference)
    assert (cache.rows_computed, cache.rows_reused) == (6, 1)
    assert join(policy, cache)
    with torch.no_grad():
        pol_lp, _ = selected_log_probs(policy, batch)
    assert (cache.rows_computed, cache.rows_reused) == (6, 8)  # the policy computed no trunk
    torch.testing.assert_close(ref_lp, plain_ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(pol_lp, plain_pol, rtol=0, atol=1e-5)
    assert not torch.allclose(plain_ref, plain_pol, atol=1e-3)  # the two tops really differ


def test_only_models_with_the_same_frozen_trunk_may_join():
    cache = TrunkCache(lora_layers=1)
    first = llama(3, seed=0)
    adapt_top(first, 1)
    assert join(first, cache)
    other = llama(3, seed=1)  # other trunk weights
    adapt_top(other, 1)
    assert not join(other, cache) and cache_of(other) is None
    trainable = llama(3, seed=0)
    adapt_top(trainable, 2)  # a trunk layer trains: its output needs a gradient
    assert not join(trainable, TrunkCache(lora_layers=1))
    whole = llama(3, seed=0)
    assert trunk_split(whole, 0) is None and trunk_split(whole, 3) is None  # no trunk / no top


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_choice_rows_share_the_trunk_and_score_and_train_like_the_plain_forward(attn):
    # packed choose rows (prompt ++ choice_1 ++ ... with a 4-D mask and their own positions): the
    # trunk once per distinct row -- the same tokens packed as other choices are another row
    model = llama(3, attn=attn)
    top = adapt_top(model, 1)
    prompts, _ = rows(4, n=3)
    prompts = [*prompts, prompts[0], prompts[0]]
    choices = [[[5, 6], [7]], [[8], [9, 10, 11]], [[12]], [[5, 6], [7]], [[5], [6, 7]]]
    batch, _ = build_choice_batch(prompts, choices)

    plain_lp, plain_grad = scores_and_grads(model, batch, top)
    cache = TrunkCache(lora_layers=1)
    assert join(model, cache)
    shared_lp, shared_grad = scores_and_grads(model, batch, top)
    assert (cache.rows_computed, cache.rows_reused) == (4, 1)  # row 3 repeats row 0; row 4 does not
    again_lp, again_grad = scores_and_grads(model, batch, top)
    assert (cache.rows_computed, cache.rows_reused) == (4, 6)
    for lp, grad in ((shared_lp, shared_grad), (again_lp, again_grad)):
        torch.testing.assert_close(lp, plain_lp, rtol=0, atol=1e-5)
        torch.testing.assert_close(grad, plain_grad, rtol=1e-4, atol=1e-6)


def test_masks_of_another_form_take_the_plain_forward():
    model = llama(3)
    adapt_top(model, 1)
    assert join(model, TrunkCache(lora_layers=1))
    left = torch.tensor([[0, 1, 1], [1, 1, 1]])
    assert final_hidden(model, torch.tensor([[0, 4, 5], [6, 7, 8]]), left) is None
    batch, _ = build_choice_batch([[1, 2, 3], [1]], [[[4], [5]], [[6]]])  # row 1: 2 tokens, 3 padding
    leaky = batch.attention_mask.clone()
    leaky[1, 0, 1, 3] = True  # a real position that sees the padding: its trunk depends on the batch
    assert final_hidden(model, batch.input_ids, leaky, batch.position_ids) is None
    assert final_hidden(model, batch.input_ids, batch.attention_mask, batch.position_ids) is not None


def test_autocast_modes_keep_their_own_trunk():
    model = llama(3)
    adapt_top(model, 1)
    cache = TrunkCache(lora_layers=1)
    assert join(model, cache)
    batch, _ = build_response_batch(*rows(5, n=4))
    with torch.no_grad():
        full = final_hidden(model, batch.input_ids, batch.attention_mask)
        with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
            half = final_hidden(model, batch.input_ids, batch.attention_mask)
        plain_half = None
        leave(model)
        with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
            plain_half = model.get_decoder()(input_ids=batch.input_ids, attention_mask=batch.attention_mask)[
                0
            ]
    assert cache.rows_computed == 8 and len(cache.states) == 8  # one trunk per row per mode
    real = batch.attention_mask.bool()
    torch.testing.assert_close(half[real].float(), plain_half[real].float(), rtol=0, atol=2e-2)
    assert not torch.equal(half[real].float(), full[real])


def test_changed_internals_leave_the_plain_forward(monkeypatch):
    model = llama(3)
    adapt_top(model, 1)

    def wrong_mask(config, hidden, attention_mask, position_ids):  # a mask that ignores causality
        return torch.zeros(
            (hidden.shape[0], 1, hidden.shape[1], hidden.shape[1]), dtype=torch.bool
        ).logical_not()

    monkeypatch.setattr(shared_trunk, "_causal_mask", wrong_mask)
    assert not join(model, TrunkCache(lora_layers=1)) and cache_of(model) is None
    monkeypatch.setattr(shared_trunk, "INTERNALS_IMPORTED", False)
    assert not join(model, TrunkCache(lora_layers=1))


@pytest.mark.parametrize("mode", ["generate", "choose"])
def test_an_update_with_the_shared_trunk_equals_one_without(tmp_path, mode):
    pytest.importorskip("peft")
    from schemas.config import LoraConfig
    from stages.policy.tiny import TinySpec, random_qwen2
    from stages.update import run_update
    from tests.helpers.update_rows import make_run, make_tokenizer, reuse_rows, update_values

    results = {}
    for shared in (False, True):
        root = tmp_path / f"shared-{shared}"
        run, config = make_run(
            root, mode, lora=LoraConfig(r=4, alpha=8.0, layers=1), shared_trunk=shared, kl_probe_rows=4
        )
        tok = make_tokenizer()
        spec = TinySpec(hidden=32, layers=3, heads=2, max_positions=512)
        random_qwen2(tok, spec=spec, seed=0).save_pretrained(run.initial_model_dir, safe_serialization=True)
        run_update(run, 0, config)
        reuse_rows(run, 1)
        run_update(run, 1, config)  # the reference pass, then the policy on the same trunk
        results[shared] = run
    plain, shared = (update_values(results[s], 1) for s in (False, True))
    assert shared[(-1, -1, "trunk_shared")] == 1.0
    assert shared[(-1, -1, "trunk_rows_reused")] > shared[(-1, -1, "trunk_rows_computed")] > 0
    # the reference and the policy passes score the same sequences (choose rows packed in both), so
    # each distinct row's trunk is computed once in the iteration
    steps = results[True].read(1, "steps")
    what = ["prompt_ids", "choices"] if mode == "choose" else ["prompt_ids", "response_ids"]
    assert shared[(-1, -1, "trunk_rows_computed")] == steps.select(what).unique().height
    assert not any(name.startswith("trunk_") for (_, _, name) in plain)
    for key, value in plain.items():
        if key[2].endswith("seconds") or key[2] in ("tokens_per_s", "rows_per_s"):
            continue
        assert shared[key] == pytest.approx(value, rel=1e-3, abs=1e-5), key
    from safetensors.torch import load_file

    a_plain = load_file(str(results[False].checkpoint_dir(1) / "adapter_model.safetensors"))
    a_shared = load_file(str(results[True].checkpoint_dir(1) / "adapter_model.safetensors"))
    for name, tensor in a_plain.items():
        torch.testing.assert_close(a_shared[name], tensor, rtol=1e-3, atol=1e-5)
