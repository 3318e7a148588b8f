"""The update's pruned forward (stages/update/last_layer.py) against the plain Hugging Face forward,
and the update stage's reuse of work (iteration-0 reference = old log-probs)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from stages.update import logprobs as lp_mod
from stages.update.last_layer import selected_final_hidden, supports_last_layer_pruning
from stages.update.logprobs import _model_mask, build_choice_batch, build_response_batch
from tests.helpers.tiny_qwen import tiny_qwen2

torch.set_num_threads(1)


def qwen2(layers: int, attn: str = "sdpa", kv_heads: int = 2, seed: int = 0) -> torch.nn.Module:
    cfg = transformers.Qwen2Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        max_position_embeddings=256,
    )
    torch.manual_seed(seed)
    model = transformers.Qwen2ForCausalLM(cfg).eval()
    model.config._attn_implementation = attn
    return model


def random_rows(rng: np.random.Generator, n: int, prompt: tuple[int, int], response: tuple[int, int]):
    prompts = [rng.integers(1, 64, size=int(rng.integers(*prompt))).tolist() for _ in range(n)]
    responses = [rng.integers(1, 64, size=int(rng.integers(*response))).tolist() for _ in range(n)]
    return prompts, responses


def full_selected(model, batch):
    """The reference: the whole decoder, then the selected rows of its output."""
    hidden = model.get_decoder()(
        input_ids=batch.input_ids,
        attention_mask=_model_mask(batch.attention_mask, model),
        position_ids=batch.position_ids,
        use_cache=False,
    )[0]
    return hidden[batch.selected.batch, batch.selected.position]


def pruned_selected(model, batch):
    return selected_final_hidden(
        model,
        batch.input_ids,
        _model_mask(batch.attention_mask, model),
        batch.position_ids,
        batch.selected.batch,
        batch.selected.position,
    )


def grads_of(model, fn) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    out = fn()
    weights = torch.linspace(-1.0, 1.0, out.numel()).reshape(out.shape)
    (out * weights).sum().backward()
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


@pytest.mark.parametrize("layers", [1, 3])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("kv_heads", [2, 4])
def test_token_rows_equal_the_full_forward(layers, attn, kv_heads):
    model = qwen2(layers, attn, kv_heads)
    rng = np.random.default_rng(layers * 10 + kv_heads)
    prompts, responses = random_rows(rng, 5, (3, 30), (1, 9))  # unequal lengths: right padding
    batch, _ = build_response_batch(prompts, responses)
    full, pruned = full_selected(model, batch), pruned_selected(model, batch)
    assert pruned.shape == full.shape
    torch.testing.assert_close(pruned, full, rtol=0, atol=1e-5)
    g_full = grads_of(model, lambda: full_selected(model, batch))
    g_pruned = grads_of(model, lambda: pruned_selected(model, batch))
    torch.testing.assert_close(g_pruned, g_full, rtol=1e-5, atol=1e-5)


def test_unpadded_rows_equal_the_full_forward():
    """Rows of one length: the model needs no mask (plain causal attention), a separate branch."""
    model = qwen2(2)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(1, 64, size=12).tolist() for _ in range(3)]
    responses = [rng.integers(1, 64, size=4).tolist() for _ in range(3)]
    batch, _ = build_response_batch(prompts, responses)
    assert bool(batch.attention_mask.all())
    torch.testing.assert_close(pruned_selected(model, batch), full_selected(model, batch), rtol=0, atol=1e-5)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_choice_rows_equal_the_full_forward(attn):
    """Choose rows: 4-D block mask and position ids that restart for every choice."""
    model = qwen2(2, attn)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(1, 64, size=int(rng.integers(4, 20))).tolist() for _ in range(4)]
    choices = [
        [rng.integers(1, 64, size=int(rng.integers(1, 4))).tolist() for _ in range(int(rng.integers(1, 5)))]
        for _ in range(4)
    ]
    batch, _ = build_choice_batch(prompts, choices)
    torch.testing.assert_close(pruned_selected(model, batch), full_selected(model, batch), rtol=0, atol=1e-5)
    g_full = grads_of(model, lambda: full_selected(model, batch))
    g_pruned = grads_of(model, lambda: pruned_selected(model, batch))
    # float32 gradients summed in another order (SDPA's CPU kernel picks the order by ISA): one element
    # of ~1.2 measured 2.3e-5 apart on this machine; a wrong mask or position id moves them by O(1)
    torch.testing.assert_close(g_pruned, g_full, rtol=1e-4, atol=1e-4)


def test_selection_order_is_kept_when_rows_are_interleaved():
    """The flat selection may list rows in any order; the output follows it."""
    model = qwen2(2)
    rng = np.random.default_rng(11)
    prompts, responses = random_rows(rng, 3, (5, 15), (2, 6))
    batch, _ = build_response_batch(prompts, responses)
    perm = torch.from_numpy(rng.permutation(batch.selected.target.numel()))
    sel = batch.selected
    shuffled = lp_mod.TokenBatch(
        batch.input_ids,
        batch.attention_mask,
        None,
        lp_mod.SelectedTokens(sel.batch[perm], sel.position[perm], sel.target[perm]),
    )
    torch.testing.assert_close(
        pruned_selected(model, shuffled), full_selected(model, batch)[perm], atol=1e-5, rtol=0
    )


def test_pruning_applies_to_qwen2_only():
    assert supports_last_layer_pruning(tiny_qwen2())
    llama = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4
        )
    )
    assert not supports_last_layer_pruning(llama)
    sliding = qwen2(2)
    sliding.config.layer_types = ["full_attention", "sliding_attention"]
    assert not supports_last_layer_pruning(sliding)


def test_response_log_probs_are_unchanged_by_pruning(monkeypatch):
    """The public scoring function gives the same log-probs and entropies either way."""
    model = qwen2(2)
    rng = np.random.default_rng(5)
    prompts, responses = random_rows(rng, 6, (4, 25), (1, 8))
    out = {}
    for prune in (False, True):
        monkeypatch.setattr(lp_mod.SelectedLogits, "prune_last_layer", prune)
        out[prune] = lp_mod.response_log_probs(model, prompts, responses, temperature=0.7, with_entropy=True)
    for a, b in zip(out[False], out[True], strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-5)


def test_changed_transformers_internals_turn_the_fast_path_off(monkeypatch):
    """A transformers release that renames or re-signs an internal the fast path uses (as
    ``create_causal_mask``'s cache argument was) must not crash the update: the model is scored with
    the plain forward, with the same numbers."""
    from stages.update import last_layer

    def renamed(**kwargs):
        raise TypeError("create_causal_mask() got an unexpected keyword argument")

    model = qwen2(2, seed=3)
    rng = np.random.default_rng(9)
    prompts, responses = random_rows(rng, 5, (4, 20), (1, 6))
    expected = lp_mod.response_log_probs(qwen2(2, seed=3), prompts, responses, temperature=1.0)
    monkeypatch.setattr(last_layer, "create_causal_mask", renamed)
    assert not supports_last_layer_pruning(model)
    got = lp_mod.response_log_probs(model, prompts, responses, temperature=1.0)
    for a, b in zip(expected, got, strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-5)


def test_internals_that_give_other_numbers_turn_the_fast_path_off(monkeypatch):
    """The once-per-model check compares numbers, not only signatures: an internal that still runs but
    computes something else (here the rotary helper) is caught before any update uses it."""
    from stages.update import last_layer

    monkeypatch.setattr(last_layer, "rotate_half", lambda x: torch.zeros_like(x))
    assert not supports_last_layer_pruning(qwen2(2, seed=4))
    monkeypatch.undo()
    assert supports_last_layer_pruning(qwen2(2, seed=4))
