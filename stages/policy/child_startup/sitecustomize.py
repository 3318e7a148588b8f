"""Run by Python at the start of a process whose PYTHONPATH begins with this folder (see __init__.py):
hide the mismatched torch extensions, keep vLLM's import-time notices at ``VLLM_LOGGING_LEVEL`` (when
it is set), then run the environment's own ``sitecustomize`` if it has one."""

import importlib.machinery
import importlib.util
import os
import sys

from stages.policy.quiet import quiet_vllm
from stages.policy.torch_extensions import hide_mismatched_extensions

hide_mismatched_extensions()
if os.environ.get("VLLM_LOGGING_LEVEL"):
    quiet_vllm(os.environ["VLLM_LOGGING_LEVEL"])

_here = os.path.dirname(os.path.abspath(__file__))
_rest = [entry for entry in sys.path if os.path.abspath(entry or os.curdir) != _here]
_spec = importlib.machinery.PathFinder.find_spec("sitecustomize", _rest)
if _spec is not None and _spec.loader is not None:
    _module = importlib.util.module_from_spec(_spec)
    sys.modules["sitecustomize"] = _module
    _spec.loader.exec_module(_module)
