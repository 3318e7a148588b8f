"""Final hidden states at selected positions only, with the last decoder layer run for those queries.

The update scores a few positions per row (generated tokens, or the ~2% choice tokens of a choose row)
out of ~300 prompt positions. Every layer but the last must run at all positions (their outputs are
the last layer's keys and values), but the last layer's output at position p feeds only the logits at
p. So, with ``S`` the selected positions of a row and ``h`` the input of the last layer::

    x    = RMSNorm_in(h)                                      (all L positions)
    K, V = rope(W_k x), W_v x                                 (all L positions)
    Q    = rope(W_q x[S])                                     (S positions only)
    a    = softmax(Q K^T * scale + mask[S, :]) V              (S x L instead of L x L scores)
    y    = h[S] + W_o a;   out = RMSNorm_final(y + MLP(RMSNorm_post(y)))

which is the Qwen2 decoder layer (``transformers.models.qwen2.modeling_qwen2.Qwen2DecoderLayer``) and
the model's final norm evaluated at the rows ``S`` -- the same numbers as the full forward, with the
last layer's query projection, attention rows, output projection and MLP cut to the selected
positions (about 40% of a 2-layer tiny model's forward + backward). It is used for Qwen2 models
whose last layer is full attention and whose layers are not FSDP units (a sharded unit gathers its
parameters only when called as a whole); every other model takes the plain forward.

The path rebuilds ``Qwen2Model.forward`` from transformers internals (``create_causal_mask``, the
attention interface registry, ``rotate_half``), which are not a stable API: their names and
signatures change between releases. So it is a fast path behind two checks, never a dependency:
the internals must import, and the first time a model is scored, the pruned result is compared with
the plain decoder forward on a short padded batch (:func:`_agrees_with_plain_forward`). Any import
error, exception or difference above ``SELF_CHECK_ATOL`` turns the fast path off for that model, and
the update takes the plain forward -- the same numbers, only slower.
"""

from __future__ import annotations

import inspect
import weakref
from typing import Any

import torch

try:  # internals: see the module docstring
    from transformers.masking_utils import create_causal_mask
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.qwen2.modeling_qwen2 import eager_attention_forward, rotate_half

    INTERNALS_IMPORTED = True
except ImportError:  # pragma: no cover - depends on the installed transformers
    INTERNALS_IMPORTED = False

PRUNABLE_MODEL_TYPES = ("qwen2",)
SELF_CHECK_ATOL = 1e-4  # float32 rounding of the two paths differs by ~1e-6 on the tiny model
_SELF_CHECKED: weakref.WeakKeyDictionary[torch.nn.Module, bool] = weakref.WeakKeyDictionary()


def supports_last_layer_pruning(lm: torch.nn.Module) -> bool:
    """Whether :func:`selected_final_hidden` applies to causal LM ``lm`` (else use the full forward):
    a Qwen2 model whose shape the fast path covers, with transformers internals that still give the
    plain forward's numbers on this model (checked once per model)."""
    if not INTERNALS_IMPORTED or not _shape_supported(lm):
        return False
    verdict = _SELF_CHECKED.get(lm)
    if verdict is None:
        verdict = _agrees_with_plain_forward(lm)
        _SELF_CHECKED[lm] = verdict
    return verdict


def _shape_supported(lm: torch.nn.Module) -> bool:
    config = getattr(lm, "config", None)
    if config is None or getattr(config, "model_type", None) not in PRUNABLE_MODEL_TYPES:
        return False
    decoder = lm.get_decoder() if hasattr(lm, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    if decoder is None or layers is None or len(layers) == 0:
        return False
    if getattr(config, "layer_types", ["full_attention"])[len(layers) - 1] != "full_attention":
        return False
    if len(layers) != config.num_hidden_layers:
        return False
    if getattr(config, "_attn_implementation", None) not in ("sdpa", "eager"):
        return False
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return True
    return not isinstance(layers[-1], FSDPModule)


def _agrees_with_plain_forward(lm: torch.nn.Module) -> bool:
    """Run both paths on two short rows (one left-padded) and compare the selected hidden states."""
    try:
        device = next(lm.parameters()).device
        vocab = int(lm.config.vocab_size)
        length = 6
        input_ids = (torch.arange(2 * length, device=device).view(2, length) * 7 + 3) % vocab
        attention_mask = torch.ones_like(input_ids)
        attention_mask[1, :2] = 0
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        sel_batch = torch.tensor([0, 0, 1, 1], device=device)
        sel_position = torch.tensor([1, 5, 2, 5], device=device)
        with torch.no_grad():
            plain = lm.get_decoder()(
                input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
            )[0][sel_batch, sel_position]
            pruned = selected_final_hidden(
                lm, input_ids, attention_mask, position_ids, sel_batch, sel_position
            )
        return bool(torch.allclose(pruned.float(), plain.float(), rtol=0.0, atol=SELF_CHECK_ATOL))
    except Exception:  # any change in the internals: take the plain forward
        return False


def _cache_keyword() -> str:
    """The name of ``create_causal_mask``'s cache argument: ``past_key_values`` up to transformers
    5.19, ``cache`` after (where the old name is deprecated)."""
    parameters = inspect.signature(create_causal_mask).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def _causal_mask(config: Any, hidden: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor):
    """The decoder's attention mask as ``Qwen2Model.forward`` builds it (no cache)."""
    return create_causal_mask(
        config=config,
        inputs_embeds=hidden,
        attention_mask=attention_mask,
        position_ids=position_ids,
        **{_cache_keyword(): None},
    )


def _query_layout(
    sel_batch: torch.Tensor, sel_position: torch.Tensor, n_rows: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Place the N flat selections in a padded (B, S) layout: returns (column (N,), positions (B, S)).

    Padded query slots read position 0 (their result is discarded; position 0 always sees a key, so no
    softmax row is empty)."""
    counts = torch.bincount(sel_batch, minlength=n_rows)
    order = torch.argsort(sel_batch, stable=True)
    starts = torch.cumsum(counts, 0) - counts
    column = torch.empty_like(sel_batch)
    column[order] = torch.arange(sel_batch.numel(), device=sel_batch.device) - starts[sel_batch[order]]
    width = int(counts.max()) if counts.numel() else 0
    positions = torch.zeros((n_rows, max(width, 1)), dtype=torch.long, device=sel_batch.device)
    positions[sel_batch, column] = sel_position
    return column, positions


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of (B, heads, T, d) with cos/sin (B, T, d) -- Qwen2's ``apply_rotary_pos_emb``."""
    return x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)


def selected_final_hidden(
    lm: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor | None,
    sel_batch: torch.Tensor,
    sel_position: torch.Tensor,
) -> torch.Tensor:
    """The final (normed) hidden state at each selected (row, position): (N, hidden).

    Same inputs as the decoder's forward (2-D padding mask or a prepared 4-D mask); equals
    ``lm.get_decoder()(...)[0][sel_batch, sel_position]`` up to float rounding.
    """
    decoder = lm.get_decoder()
    config = decoder.config
    b_n, length = input_ids.shape
    hidden = decoder.embed_tokens(input_ids)
    if position_ids is None:
        position_ids = torch.arange(length, device=hidden.device).unsqueeze(0)
    # the masks and rotary tables exactly as Qwen2Model.forward builds them
    mask = _causal_mask(config, hidden, attention_mask, position_ids)
    cos, sin = decoder.rotary_emb(hidden, position_ids)
    for layer in decoder.layers[:-1]:
        hidden = layer(hidden, attention_mask=mask, position_ids=position_ids, position_embeddings=(cos, sin))

    last = decoder.layers[-1]
    attn = last.self_attn
    column, q_pos = _query_layout(sel_batch, sel_position, b_n)
    rows = torch.arange(b_n, device=hidden.device).unsqueeze(1)  # (B, 1)
    x = last.input_layernorm(hidden)
    cos_b, sin_b = cos.expand(b_n, -1, -1), sin.expand(b_n, -1, -1)
    key = _rope(attn.k_proj(x).view(b_n, length, -1, attn.head_dim).transpose(1, 2), cos_b, sin_b)
    value = attn.v_proj(x).view(b_n, length, -1, attn.head_dim).transpose(1, 2)
    x_q = x[rows, q_pos]  # (B, S, H)
    width = q_pos.shape[1]
    query = attn.q_proj(x_q).view(b_n, width, -1, attn.head_dim).transpose(1, 2)
    query = _rope(query, cos_b[rows, q_pos], sin_b[rows, q_pos])
    if mask is None:  # no padding: plain causal attention
        keys = torch.arange(length, device=hidden.device)
        q_mask = (keys.view(1, 1, 1, length) <= q_pos.view(b_n, 1, width, 1)).contiguous()
    else:
        q_mask = mask.expand(b_n, -1, -1, -1)[rows, :, q_pos].transpose(1, 2).contiguous()  # (B, 1, S, L)
    interface = ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, eager_attention_forward)
    dropout = attn.attention_dropout if attn.training else 0.0
    out, _ = interface(
        attn, query, key, value, q_mask, dropout=dropout, scaling=attn.scaling, is_causal=False
    )
    out = attn.o_proj(out.reshape(b_n, width, -1).contiguous())
    y = hidden[rows, q_pos] + out
    y = y + last.mlp(last.post_attention_layernorm(y))
    y = decoder.norm(y)
    return y[sel_batch, column]
