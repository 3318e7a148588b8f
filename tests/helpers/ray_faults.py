"""Faults the Ray executor tests inject into rollout actors (``RolloutWorker.before_shard``).

A module of its own, without test imports, because the actors import it by name."""

from __future__ import annotations

import os
from pathlib import Path


def crash_once(marker: str, iteration: int, shard: int, at: tuple[int, int]) -> None:
    """End the actor's process abruptly (as a crash or the OOM killer would) the first time it is about
    to play shard ``at[1]`` of iteration ``at[0]``; ``marker`` records that it happened, so the
    restarted actor plays the shard."""
    if (iteration, shard) != at or Path(marker).exists():
        return
    Path(marker).write_text(str(os.getpid()))
    os._exit(1)
