"""A tiny randomly initialized Qwen2 causal LM for the update tests (vocabulary 64, one layer)."""

from __future__ import annotations

import torch


def tiny_qwen2(seed: int = 0, attn: str | None = None):
    """A fresh model in eval mode, weights from ``torch.manual_seed(seed)``; ``attn`` sets the attention
    implementation (None: the transformers default)."""
    import transformers

    cfg = transformers.Qwen2Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    torch.manual_seed(seed)
    model = transformers.Qwen2ForCausalLM(cfg).eval()
    if attn is not None:
        model.config._attn_implementation = attn
    return model
