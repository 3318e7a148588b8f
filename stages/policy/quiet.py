"""Third-party libraries without their own progress bars and start-up notices: graft reports its own
progress."""

from __future__ import annotations

import logging
import warnings


def quiet_transformers() -> None:
    """No per-file progress bars from transformers ("Loading weights", "Writing model shards"): graft
    reports its own progress, and the bars flood stderr and the loop's log."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def quiet_vllm(level: str) -> None:
    """vLLM's import-time notices at ``level`` (``VLLM_LOGGING_LEVEL``) in this process.

    Some vLLM modules log while they are imported, before vLLM configures its own logging ("Triton is
    installed, but doesn't include CPU backend" on the CPU build, once per engine process); Python's
    last-resort handler prints those whatever ``VLLM_LOGGING_LEVEL`` says, so the ``vllm`` logger gets
    the level here first. FutureWarnings raised from vLLM's own modules (torch deprecations it
    triggers) are not the user's to act on and are dropped. An unknown level name changes nothing."""
    try:
        logging.getLogger("vllm").setLevel(level.upper())
    except ValueError:
        return
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"vllm\.")
