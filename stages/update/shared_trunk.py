"""The trunk once per row: the decoder layers below the adapters, computed once and shared by every pass.

With LoRA on the last K of a model's L decoder layers (``update.lora.layers = K``), the embeddings and
layers ``0 .. L-K-1`` -- the *trunk* -- carry the same frozen weights in the reference model and in the
policy being trained. For a row of tokens ``x`` (right-padded, positions ``0 .. n-1``)::

    h_trunk(x) = layer_{L-K-1}( ... layer_0(embed(x)) ... )                 (n, hidden), no gradient
    hidden(x)  = norm(layer_{L-1}( ... layer_{L-K}(h_trunk(x)) ... ))       (n, hidden)

and the reference pass, the policy's old-log-prob pass, every optimizer step (each epoch) and the
KL probe all need ``h_trunk`` of the same rows. Without this module each of them recomputes it: in the
headroom preset (SmolLM2-135M, K = 8 of 30 layers) the trunk is 22/30 of every forward. With it, the
first pass to meet a row computes ``h_trunk`` without a graph and stores it (keyed by the row's tokens
and the autocast mode, whose rounding differs); later passes read it and run only the top K layers.
The values are the plain forward's: causal attention with right padding means a real position never
attends to a padded one, so a row's trunk does not depend on the batch it was computed in (up to the
float rounding of a different batch shape). Choose rows, packed as ``prompt ++ choice_1 ++ ...`` with a
4-D mask and their own positions (``build_choice_batch``), share it the same way: their key adds the
positions and the mask among the row's real tokens, and a batch whose mask lets a real position see
the padding takes the plain forward.

A model takes part by :func:`join` ing a :class:`TrunkCache`, which checks (else the model keeps its
plain forward, the same numbers, only slower):

* Llama or Qwen2 architecture, every layer full attention, sdpa or eager attention, no FSDP units,
  no attention dropout, 0 < K < L;
* no trunk parameter is trainable (the trunk's output must not need a gradient);
* the trunk's weights are bit-identical to those of the first model that joined (a digest of the
  embeddings, the rotary tables and layers ``0 .. L-K-1``): the reference and the policy share a trunk
  only when they really do;
* the split forward gives the plain decoder's numbers on a short padded batch (the transformers
  internals it rebuilds the forward from are not a stable API; see ``last_layer``).

Memory: one float tensor (n, hidden) per distinct row (SmolLM2-135M: ~0.85 MB for a 370-token row in
float32), held for the update stage only. Single process only (the runner does not use it under
torchrun).
"""

from __future__ import annotations

import hashlib
import weakref
from dataclasses import dataclass, field

import numpy as np
import torch

from stages.update.last_layer import INTERNALS_IMPORTED, SELF_CHECK_ATOL, _causal_mask

SHAREABLE_MODEL_TYPES = ("llama", "qwen2")


@dataclass(eq=False)
class TrunkCache:
    """Trunk outputs shared by the models that joined it (see the module docstring).

    lora_layers: K, the adapted top layers; the trunk is every layer below them.
    digest: the trunk weights' digest, set by the first model that joins.
    states: (autocast mode, row tokens) -> the row's trunk output (n, hidden), no graph.
    rows_computed / rows_reused: rows whose trunk a pass computed / read from ``states``.
    """

    lora_layers: int
    digest: str | None = None
    states: dict[tuple[tuple[bool, str], bytes], torch.Tensor] = field(default_factory=dict)
    rows_computed: int = 0
    rows_reused: int = 0

    def clear(self) -> None:
        self.states.clear()


_JOINED: weakref.WeakKeyDictionary[torch.nn.Module, tuple[TrunkCache, int]] = weakref.WeakKeyDictionary()


def trunk_split(lm: torch.nn.Module, lora_layers: int) -> int | None:
    """The first adapted layer L - K of causal LM ``lm`` when its trunk can be shared, else None."""
    config = getattr(lm, "config", None)
    if config is None or getattr(config, "model_type", None) not in SHAREABLE_MODEL_TYPES:
        return None
    decoder = lm.get_decoder() if hasattr(lm, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    if decoder is None or layers is None or len(layers) != getattr(config, "num_hidden_layers", -1):
        return None
    if not 0 < lora_layers < len(layers):
        return None
    if any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or ["full_attention"]):
        return None
    if getattr(config, "_attn_implementation", None) not in ("sdpa", "eager"):
        return None
    if float(getattr(config, "attention_dropout", 0.0) or 0.0) != 0.0:
        return None
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        FSDPModule = ()  # noqa: N806
    if FSDPModule and any(isinstance(layer, FSDPModule) for layer in layers):
        return None
    return len(layers) - lora_layers


def _trunk_modules(lm: torch.nn.Module, split: int) -> list[tuple[str, torch.nn.Module]]:
    decoder = lm.get_decoder()
    return [("embed_tokens", decoder.embed_tokens), ("rotary_emb", decoder.rotary_emb)] + [
        (f"layers.{i}", decoder.layers[i]) for i in range(split)
    ]


def trunk_digest(lm: torch.nn.Module, split: int) -> str:
    """A digest of every parameter and buffer of the trunk (names, dtypes, shapes, bytes)."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(f"{lm.config.model_type}:{split}".encode())
    for prefix, module in _trunk_modules(lm, split):
        tensors = list(module.named_parameters()) + list(module.named_buffers())
        for name, tensor in sorted(tensors, key=lambda item: item[0]):
            data = tensor.detach().cpu().contiguous()
            digest.update(f"{prefix}.{name}:{data.dtype}:{tuple(data.shape)}".encode())
            digest.update(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"")
        scaling = getattr(module, "attention_scaling", None)  # rotary: a float, not a buffer
        if scaling is not None:
            digest.update(repr(float(scaling)).encode())
    return digest.hexdigest()


def join(lm: torch.nn.Module, cache: TrunkCache) -> bool:
    """Let ``lm``'s forward read and fill ``cache`` (see the module docstring); False, with nothing
    joined, where its trunk cannot be shared."""
    if not INTERNALS_IMPORTED:
        return False
    split = trunk_split(lm, cache.lora_layers)
    if split is None:
        return False
    if any(p.requires_grad for _, module in _trunk_modules(lm, split) for p in module.parameters()):
        return False
    digest = trunk_digest(lm, split)
    if cache.digest is not None and digest != cache.digest:
        return False
    if not _split_agrees(lm, split):
        return False
    cache.digest = digest
    _JOINED[lm] = (cache, split)
    return True


def leave(lm: torch.nn.Module) -> None:
    """``lm`` takes the plain forward again."""
    _JOINED.pop(lm, None)


def cache_of(lm: torch.nn.Module) -> TrunkCache | None:
    """The cache ``lm`` joined, or None."""
    joined = _JOINED.get(lm)
    return None if joined is None else joined[0]


def _autocast_mode(device: torch.device) -> tuple[bool, str]:
    if not torch.is_autocast_enabled(device.type):
        return (False, "")
    return (True, str(torch.get_autocast_dtype(device.type)))


def _run_layers(
    lm: torch.nn.Module,
    hidden: torch.Tensor,
    attention_mask: torch.Tensor,
    layers: range,
    position_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decoder layers ``layers`` over ``hidden`` (B, L, hidden), as ``LlamaModel.forward`` runs them
    (no cache): positions 0 .. L-1 and the causal mask of a 2-D padding mask, or a packed row's own
    positions (B, L) and 4-D mask (B, 1, L, L), which the mask builder passes through as it is."""
    decoder = lm.get_decoder()
    if position_ids is None:
        position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
    mask = _causal_mask(decoder.config, hidden, attention_mask, position_ids)
    cos, sin = decoder.rotary_emb(hidden, position_ids)
    for i in layers:
        hidden = decoder.layers[i](
            hidden, attention_mask=mask, position_ids=position_ids, position_embeddings=(cos, sin)
        )
    return hidden


def _packed_lengths(attention_mask: torch.Tensor) -> torch.Tensor | None:
    """Each row's real length for a packed 4-D mask (B, 1, L, L) -- bool (True = may attend) or additive
    float (0 = may attend) -- laid out as ``build_choice_batch`` lays out choose rows: position 0 and
    the padding after the row attend to themselves only, every other real position to some earlier
    one, and no real position to the padding. None when the mask has another form."""
    allowed = attention_mask[:, 0] if attention_mask.dtype == torch.bool else attention_mask[:, 0] == 0
    width = allowed.shape[-1]
    earlier = torch.ones(width, width, dtype=torch.bool, device=allowed.device).tril(-1)
    sees_earlier = (allowed & earlier).any(-1)  # (B, L)
    positions = torch.arange(width, device=allowed.device)
    lengths = torch.where(sees_earlier, positions + 1, 1).max(-1).values
    eye = torch.eye(width, dtype=torch.bool, device=allowed.device)
    padding = positions.unsqueeze(0) >= lengths.unsqueeze(1)  # (B, L)
    pad_rows_ok = torch.where(padding.unsqueeze(-1), allowed == eye, True).all()
    real_keys_ok = ~(allowed & ~padding.unsqueeze(-1) & padding.unsqueeze(1)).any()
    return lengths if bool(pad_rows_ok) and bool(real_keys_ok) else None


def _right_padded_lengths(attention_mask: torch.Tensor) -> torch.Tensor | None:
    """Each row's length when ``attention_mask`` (B, L) is ones then zeros in every row, else None."""
    lengths = attention_mask.sum(-1)
    positions = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    expected = (positions.unsqueeze(0) < lengths.unsqueeze(1)).to(attention_mask.dtype)
    return lengths if torch.equal(attention_mask, expected) else None


def final_hidden(
    lm: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """The decoder's final (normed) hidden states (B, L, hidden), the trunk read from (or first
    written to) the cache ``lm`` joined, for a right-padded batch (2-D mask, positions 0 .. L-1) or a
    batch of packed choose rows (4-D mask and its own positions, ``build_choice_batch``); None when
    ``lm`` joined none or the batch has another form (the caller then takes the plain forward). Equals
    the plain decoder's output at every real position.

    A row's key is its tokens up to its real length (and, for a packed row, their positions and the
    mask among them, which differ between two packings of the same tokens), so a row repeated in
    another batch, or by another model that joined, reads its trunk instead of computing it."""
    joined = _JOINED.get(lm)
    if joined is None:
        return None
    packed = attention_mask.dim() == 4 and position_ids is not None
    if packed:
        lengths = _packed_lengths(attention_mask)
    elif attention_mask.dim() == 2 and position_ids is None:
        lengths = _right_padded_lengths(attention_mask)
    else:
        return None
    if lengths is None:
        return None
    cache, split = joined
    mode = _autocast_mode(input_ids.device)
    ids = input_ids.cpu().numpy()
    keys = [
        (
            mode,
            _row_key(ids[b, : int(n)], attention_mask, position_ids, b, int(n))
            if packed
            else ids[b, : int(n)].tobytes(),
        )
        for b, n in enumerate(lengths.tolist())
    ]
    missing: dict[tuple[tuple[bool, str], bytes], int] = {}
    for b, key in enumerate(keys):
        if key not in cache.states and key not in missing:
            missing[key] = b
    if missing:
        rows = torch.tensor(list(missing.values()), device=input_ids.device)
        width = int(lengths[rows].max())
        with torch.no_grad():
            embedded = lm.get_decoder().embed_tokens(input_ids[rows, :width])
            if packed:
                assert position_ids is not None
                trunk = _run_layers(
                    lm,
                    embedded,
                    attention_mask[rows][:, :, :width, :width],
                    range(split),
                    position_ids[rows, :width],
                )
            else:
                trunk = _run_layers(lm, embedded, attention_mask[rows, :width], range(split))
        for i, (key, b) in enumerate(missing.items()):
            cache.states[key] = trunk[i, : int(lengths[b])].clone()
    cache.rows_computed += len(missing)
    cache.rows_reused += len(keys) - len(missing)
    first = cache.states[keys[0]]
    hidden = first.new_zeros((input_ids.shape[0], input_ids.shape[1], first.shape[-1]))
    for b, key in enumerate(keys):  # padded positions stay 0: no real position attends to them
        hidden[b, : int(lengths[b])] = cache.states[key]
    decoder = lm.get_decoder()
    top = range(split, len(decoder.layers))
    return decoder.norm(_run_layers(lm, hidden, attention_mask, top, position_ids if packed else None))


def _row_key(
    ids: np.ndarray, attention_mask: torch.Tensor, position_ids: torch.Tensor | None, b: int, n: int
) -> bytes:
    """A packed row's key: a digest of its n tokens, their positions and the mask among them."""
    assert position_ids is not None
    mask = attention_mask[b, 0, :n, :n]
    allowed = mask if mask.dtype == torch.bool else mask == 0
    digest = hashlib.blake2b(ids.tobytes(), digest_size=16)
    digest.update(position_ids[b, :n].cpu().numpy().astype(np.int64).tobytes())
    digest.update(np.packbits(allowed.cpu().numpy()).tobytes())
    return b"packed:" + digest.digest()


def _split_agrees(lm: torch.nn.Module, split: int) -> bool:
    """The split forward against the plain decoder on two short right-padded rows (float32, no
    autocast): True when every real position agrees within ``SELF_CHECK_ATOL``."""
    try:
        device = next(lm.parameters()).device
        vocab = int(lm.config.vocab_size)
        input_ids = (torch.arange(12, device=device).view(2, 6) * 7 + 3) % vocab
        attention_mask = torch.ones_like(input_ids)
        attention_mask[1, 4:] = 0
        real = attention_mask.bool()
        with torch.no_grad(), torch.autocast(device_type=device.type, enabled=False):
            plain = lm.get_decoder()(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)[0]
            hidden = _run_layers(lm, lm.get_decoder().embed_tokens(input_ids), attention_mask, range(split))
            top = _run_layers(lm, hidden, attention_mask, range(split, len(lm.get_decoder().layers)))
            split_out = lm.get_decoder().norm(top)
        return bool(
            torch.allclose(split_out[real].float(), plain[real].float(), rtol=0.0, atol=SELF_CHECK_ATOL)
        )
    except Exception:  # any change in the internals: the plain forward
        return False
