"""Starting or resuming the run of ``graft loop``: every check before the run directory is touched, the
run's lock, and which config changes do not count when a run resumes."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from schemas.config import Config, load_config
from schemas.errors import GraftError
from schemas.initial_model import verify_recorded_models
from schemas.lock import LOCK_FILE, run_lock
from schemas.run_config import refuse_config_edit, write_run_config
from schemas.rundir import Run, create_run, discard_refused_start, open_run, start_snapshot
from stages.loop.preflight import check_startable
from stages.loop.runner import check_resumable
from stages.observe.live_log import check_log_dir, require_backend
from stages.update.lora import check_continuation


def loop_root(
    config_path: str | None, run_dir: str | None, overrides: list[str], force: bool = False
) -> tuple[Path, Config]:
    """The run directory of a ``graft loop`` call and its validated config; reads, writes nothing. A
    saved config.toml edited by hand is a config change: refused unless ``force``."""
    if config_path is None and run_dir is None:
        raise GraftError("graft loop: give --config FILE (new run) or --run DIR (resume)")
    if config_path is None:
        config = open_run(run_dir).load_config(overrides, accept_edit=force)  # type: ignore[arg-type]
    else:
        config = load_config(config_path, overrides)
    # refuse what cannot start (model directory, vLLM, CUDA, environment data, a missing optional
    # writer) before anything is written, the run's lock file included
    require_backend(config)
    check_startable(config)
    root = Path(run_dir) if run_dir is not None else Path("runs") / config.run.name
    check_log_dir(root, config)
    return root, config


def resolve_loop_run(
    config_path: str | None, run_dir: str | None, overrides: list[str], iters: int | None, force: bool
) -> tuple[Run, Config, int]:
    """Create or reopen the run of ``graft loop``; return it, its config and the iteration target.

    Everything is checked before the run directory is touched, and the run's lock is taken before
    config.toml is compared or written (the caller holds it on through the loop): a second loop that
    is refused leaves the running one's config byte-identical.

    ``run.iters`` is the loop's stopping point, not part of what an iteration computes, so it never
    counts as a config change: ``--iters`` (or an edited ``run.iters``) extends or shortens a run
    without ``--force``, and the saved config records the newest target. ``[checkpoint]`` retention,
    ``[log]`` and ``[cluster]`` (where the rollout runs) are treated the same way.
    """
    return open_loop_run(*loop_root(config_path, run_dir, overrides, force), iters, force)


def open_loop_run(root: Path, config: Config, iters: int | None, force: bool) -> tuple[Run, Config, int]:
    """``resolve_loop_run`` after ``loop_root``: take the lock, then create or check the run."""
    target = iters if iters is not None else config.run.iters
    if target < 0:
        raise GraftError(f"--iters {target}: must be >= 0")
    with run_lock(root):
        saved_path = root / "config.toml"
        bookkeeping = (config.checkpoint, config.log, config.cluster)
        if saved_path.is_file():
            refuse_config_edit(Run(root), accept=force)  # a hand edit of config.toml is a config change
            check_resumable(Run(root), target)  # a changed iteration is refused before anything is written
            verify_recorded_models(Run(root))  # so is a changed initial model
            check_continuation(Run(root), config)  # so is a LoRA setting the next update would ignore
            saved = load_config(saved_path)
            # compare everything but what never changes an iteration's tables: the stopping point,
            # checkpoint retention, live logging and the executor
            config.run.iters, config.checkpoint, config.log = saved.run.iters, saved.checkpoint, saved.log
            config.cluster = saved.cluster
        run = create_run(root, config, force=force)
        config.run.iters = target
        config.checkpoint, config.log, config.cluster = bookkeeping
        write_run_config(run, config)  # the newest target, sealed (an accepted edit: recorded)
    return run, config, target


@contextmanager
def locked_start(root: Path) -> Iterator[None]:
    """Hold the run's lock for a ``graft loop`` start; when the block raises a GraftError before any
    iteration wrote a table, remove what this start added to a new run (``discard_refused_start``).

    The folder is looked at only once the lock is held: a start refused at the lock has seen nothing
    and removes nothing (the process that holds the lock may just have created the folder and its
    config.toml)."""
    existed, had_lock = root.is_dir(), (root / LOCK_FILE).exists()
    with run_lock(root):
        snapshot = start_snapshot(root, existed, had_lock)
        try:
            yield
        except GraftError:
            discard_refused_start(snapshot)
            raise
