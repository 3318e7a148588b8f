"""The loop's update stage on several processes: ``cluster.update_procs = N`` (docs/scaling.md).

With N > 1 the loop launches ``torchrun --standalone --nproc_per_node N`` for each update, running
this module's ``main``: every rank reads the iteration's rows and the run's resolved config (written
to a temporary TOML file, so a rank sees exactly what the loop resolved, ``--set`` included), joins
the process group (``stages.update.distributed``) and runs ``run_update``; rank 0 writes the tables
and the checkpoint. The loop holds the run lock throughout, so the ranks do not take it.

torchrun rather than Ray Train's ``TorchTrainer``: the update's multi-process path is torchrun's
already (DDP / FSDP2, tested against one process), a launched torchrun is the same code a user runs
by hand, and it needs no Ray -- so it also works with ``cluster.executor = "local"``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from schemas.config import Config, load_config
from schemas.errors import GraftError
from schemas.rundir import Run, open_run
from stages.update.runner import run_update


def torchrun_command(run_dir: Path, iteration: int, config_path: Path, procs: int) -> list[str]:
    """The command the loop runs for one update on ``procs`` processes of this node."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={procs}",
        "-m",
        "stages.update.launch",
        str(run_dir),
        str(iteration),
        str(config_path),
    ]


def loop_update(run: Run, iteration: int, config: Config) -> None:
    """The loop's update runner: in this process, or under a launched torchrun (``update_procs``)."""
    procs = config.cluster.update_procs
    if procs <= 1:
        run_update(run, iteration, config)
        return
    with tempfile.TemporaryDirectory(prefix="graft-update-") as scratch:
        config_path = Path(scratch) / "config.toml"
        config_path.write_text(config.to_toml())
        env = dict(os.environ)
        # the ranks import graft from where this process does (an uninstalled checkout included)
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
        done = subprocess.run(torchrun_command(run.root, iteration, config_path, procs), env=env, check=False)
    if done.returncode != 0:
        raise GraftError(
            f"update of iteration {iteration} under torchrun ({procs} processes, cluster.update_procs) "
            f"failed with exit code {done.returncode}; the ranks' output is above"
        )


def main(argv: list[str]) -> int:
    """A rank's entry point: ``python -m stages.update.launch RUN ITERATION CONFIG``."""
    run_dir, iteration, config_path = argv
    try:
        run_update(open_run(run_dir), int(iteration), load_config(config_path))
    except GraftError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
