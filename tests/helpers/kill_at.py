"""Test-only crash injection: SIGKILL the process in the middle of one stage's outputs.

``killing_runners("update:0:checkpoints")`` returns the loop's ``STAGE_RUNNERS`` with the runner of
``update`` wrapped so that, in iteration 0, the process kills itself at the first ``os.replace``
whose destination contains ``checkpoints`` — a temporary output written but not yet renamed into
place, the worst moment for a crash. The spec is ``<stage>[:<iter>[:<n or text>]]``: the n-th rename
of that stage (default 1) or the first whose destination contains ``text``. The library knows nothing
of this: the wrapper is passed to ``run_loop(runners=...)`` like any other runner table.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from typing import Any
from unittest import mock

from schemas.config import Config
from schemas.rundir import Run
from stages.loop import STAGE_RUNNERS, StageRunner


def killing(fn: Callable[..., Any], nth: int = 1, match: str = "") -> Callable[..., Any]:
    """``fn`` that SIGKILLs the process at its n-th ``os.replace`` whose destination contains ``match``."""
    original = os.replace

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        count = 0

        def replace(src, dst, *a, **kw):  # type: ignore[no-untyped-def]
            nonlocal count
            folder = kw.get("dst_dir_fd")  # a rename relative to an open folder (schemas.confine)
            where = os.path.join(os.readlink(f"/proc/self/fd/{folder}"), dst) if folder is not None else dst
            if match in str(where):
                count += 1
                if count >= nth:
                    os.kill(os.getpid(), signal.SIGKILL)
            return original(src, dst, *a, **kw)

        with mock.patch("os.replace", replace):
            return fn(*args, **kwargs)

    return wrapped


def killing_runners(spec: str) -> dict[str, StageRunner]:
    """The loop's runners with the one named by ``spec`` killing the process mid-write."""
    parts = spec.split(":")
    stage = parts[0]
    target_iter = int(parts[1]) if len(parts) > 1 and parts[1] != "" else None
    nth, match = 1, ""
    if len(parts) > 2:
        nth, match = (int(parts[2]), "") if parts[2].isdigit() else (1, parts[2])
    runners = dict(STAGE_RUNNERS)
    plain = runners[stage]
    killer = killing(plain, nth, match)

    def dispatch(run: Run, iteration: int, config: Config) -> None:
        chosen: Callable[[Run, int, Config], None] = (
            killer if target_iter is None or iteration == target_iter else plain
        )
        chosen(run, iteration, config)

    runners[stage] = dispatch
    return runners
