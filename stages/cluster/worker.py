"""One rollout worker of the Ray executor: plays shard i of n of each iteration it is asked for.

A plain class (``RayRolloutPool`` turns it into a Ray actor), so it runs and is tested without Ray.
It keeps its environment between iterations, and its engine through ``live_engine``, which keeps one
engine per process and loads each new checkpoint into it (``engine.load``: the hf engine reloads the
weights from the checkpoint directory; vLLM follows ``rollout.engine_options.reload``).

The shard's outputs are those of ``graft rollout --shard i/n``: ``metrics_rollout.shard-i-of-n`` then
``steps.shard-i-of-n`` in the iteration's folder, each written atomically, the steps file last, so an
existing steps shard file is a finished shard and is never played again (a restarted actor, a resumed
loop); a killed write leaves only a ``.*.tmp`` file, which nothing reads and the loop removes.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from schemas import write_table
from schemas.config import Config
from schemas.rundir import Run
from stages.envs.base import Environment
from stages.envs.registry import make_environment
from stages.policy.live_engine import release_engines
from stages.rollout.runner import rollout_iteration
from stages.rollout.shards import shard_name

# Called with (iteration, shard) before a shard is played; tests inject faults through it.
ShardHook = Callable[[int, int], None]


@dataclass(frozen=True)
class ShardReport:
    """What a worker did for one shard: whether it played it (False: the file was already there),
    in which process (a restarted actor has a new pid) and how long the call took."""

    iteration: int
    shard: int
    shards: int
    played: bool
    pid: int
    seconds: float


class RolloutWorker:
    """Plays shard ``shard`` of ``shards`` (groups g with g % shards == shard) of an iteration."""

    def __init__(self, shard: int, shards: int, before_shard: ShardHook | None = None) -> None:
        self.shard, self.shards = shard, shards
        self.before_shard = before_shard
        self._env: Environment | None = None
        self._env_key = ""

    def environment(self, config: Config) -> Environment:
        """The run's environment, built once and kept while ``[env]`` stays the same."""
        key = repr(config.env)
        if self._env is None or key != self._env_key:
            self._env, self._env_key = make_environment(config), key
        return self._env

    def play(self, root: str, iteration: int, config: Config, model_dir: str, version: str) -> ShardReport:
        """Write this worker's shard files of ``iteration`` into the run at ``root`` (unless the steps
        shard file exists), acting with the policy in ``model_dir`` named ``version``."""
        start = time.perf_counter()
        run = Run(Path(root))
        shard = (self.shard, self.shards)
        steps_path = run.iter_dir(iteration) / shard_name("steps", shard)
        played = not steps_path.is_file()
        if played:
            if self.before_shard is not None:
                self.before_shard(iteration, self.shard)
            steps, metrics = rollout_iteration(
                config,
                iteration,
                Path(model_dir),
                version,
                shard=shard,
                progress=False,
                env=self.environment(config),
            )
            write_table(metrics, "metrics", run.iter_dir(iteration) / shard_name("metrics_rollout", shard))
            write_table(steps, "steps", steps_path)
        return ShardReport(
            iteration, self.shard, self.shards, played, os.getpid(), time.perf_counter() - start
        )

    def release_engine(self) -> int:
        """Free the engine's model (and a GPU's memory) for the driver's update; the next ``play``
        builds it again. Returns how many engines were closed."""
        return release_engines()
