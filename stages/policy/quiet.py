"""Third-party libraries without their own progress bars: graft reports its own progress."""

from __future__ import annotations


def quiet_transformers() -> None:
    """No per-file progress bars from transformers ("Loading weights", "Writing model shards"): graft
    reports its own progress, and the bars flood stderr and the loop's log."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
