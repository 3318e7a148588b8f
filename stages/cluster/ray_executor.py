"""``graft loop --executor ray``: the rollout stage on a pool of Ray actors (docs/design.md §12).

``RayRolloutPool`` is the loop's rollout stage runner. Per iteration it sends shard i of n to actor i
(group g to actor g mod n, ``--shard i/n`` semantics, n = min(cluster.rollout_workers,
rollout.groups)); the actors write their shard files into the run directory, which every node must
see at the same path (a shared filesystem), and the driver merges them with ``merge_rollout_shards``.
Task draws, group names and every random stream are those of the unsharded run, so the merged steps
table equals the local one. With ``rollout.batch_scope = "group"`` it is the local file byte for byte;
under the default ``"all"`` only the scores (``response_logprobs``, ``choice_scores``) differ in the last float bits, because a batch
of other prompts pads and sums differently (docs/scaling.md "Same tables as a local run").

The actors live as long as the pool, keeping their environment and engine between iterations.
Failures: Ray restarts an actor that dies (``max_restarts``) and retries its call
(``max_task_retries``), which replays the shard on the new process: rollouts are deterministic per
group, so the table does not change. Past ``cluster.max_restarts`` the iteration stops with a
GraftError; finished shard files stay and a rerun of the loop plays only the missing shards.

Ray starts (or is joined) on the first rollout call, so a loop with nothing left to do never starts
it; ``close`` kills the actors and shuts down a Ray this pool started.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from types import TracebackType
from typing import Any

import ray
from ray.exceptions import RayActorError, RayTaskError

from schemas.config import ClusterConfig, Config
from schemas.errors import GraftError
from schemas.initial_model import acting_policy
from schemas.rundir import Run
from stages.cluster import joined_address, probe_address
from stages.cluster.worker import RolloutWorker, ShardHook, ShardReport
from stages.policy.live_engine import engine_released_for_update
from stages.rollout.shards import merge_rollout_shards

SOURCE_ROOT = Path(__file__).resolve().parents[2]  # the folder holding schemas/ and stages/
CONNECT_DEADLINE_S = 60.0  # joining a running cluster takes seconds; Ray alone would retry for ever


def worker_runtime_env() -> dict[str, Any]:
    """Ray's runtime_env for graft's actors: a source checkout's root on their PYTHONPATH, so they
    import the same graft as the driver even where it is not pip-installed, followed by the driver's
    own PYTHONPATH (a plug-in environment's module, e.g. ``PYTHONPATH=examples``); an installed graft
    needs nothing."""
    if not (SOURCE_ROOT / "pyproject.toml").is_file():
        return {}
    own = [os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    paths = [str(SOURCE_ROOT), *own]
    return {"env_vars": {"PYTHONPATH": os.pathsep.join(paths)}}


def connect(cluster: ClusterConfig) -> bool:
    """Join or start Ray for ``cluster`` unless this process already did; True when this call did
    (the caller then shuts it down).

    Joining a cluster (``cluster.address``, or ``RAY_ADDRESS``) first probes the address
    (``probe_address``), then gives ``ray.init`` at most ``CONNECT_DEADLINE_S``: Ray itself retries an
    address that does not answer as a Ray head for ever."""
    if ray.is_initialized():
        return False
    joined = joined_address(cluster.address) or _recorded_cluster(cluster.address)
    if joined is not None:
        probe_address(*joined)
    source = joined[1] if joined is not None else f"cluster.address = {cluster.address!r}"
    local = cluster.address == "" and not os.environ.get("RAY_ADDRESS", "").strip()
    options = {
        "address": cluster.address or None,
        "include_dashboard": False,
        "logging_level": logging.WARNING,
        "runtime_env": worker_runtime_env(),
    }
    quiet = _RayNoise()
    for name in _RayNoise.LOGGERS:
        logging.getLogger(name).addFilter(quiet)
    try:
        if local:
            ray.init(**options)  # a local Ray, started by this process
        else:
            _bounded_init(options, source)
    except (ConnectionError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise GraftError(f"{source}: cannot join a Ray cluster ({first})") from None
    finally:
        for name in _RayNoise.LOGGERS:
            logging.getLogger(name).removeFilter(quiet)
    return True


def _recorded_cluster(address: str) -> tuple[str, str] | None:
    """With 'auto' (cluster.address or RAY_ADDRESS): the address of the running cluster Ray recorded
    on this node (``ray start``), to probe like any other; None when there is none (ray.init then
    says so at once)."""
    if "auto" not in (address, os.environ.get("RAY_ADDRESS", "").strip()):
        return None
    from ray._private.services import canonicalize_bootstrap_address

    try:
        found = canonicalize_bootstrap_address("auto")
    except (ConnectionError, ValueError, OSError):
        return None
    if not found:
        return None
    return found, f"cluster.address = 'auto' (the Ray cluster recorded on this node: {found})"


class _RayNoise(logging.Filter):
    """Ray's lines about what graft does on purpose: no SIGTERM handler from ``_bounded_init``'s thread,
    token authentication on for the local Ray graft starts."""

    NOISE = ("current thread is not the main thread", "Token authentication is enabled for this Ray cluster")
    LOGGERS = ("ray._private.worker", "ray._private.authentication.authentication_token_setup")

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(text in record.getMessage() for text in self.NOISE)


def _bounded_init(options: dict[str, Any], source: str) -> None:
    """``ray.init(**options)`` in a helper thread, waited for at most ``CONNECT_DEADLINE_S``; a
    GraftError naming ``source`` past that (the thread is abandoned: it ends with the process)."""
    outcome: dict[str, BaseException] = {}
    done = threading.Event()

    def work() -> None:
        try:
            ray.init(**options)
        except BaseException as exc:  # handed to the waiting thread
            outcome["error"] = exc
        finally:
            done.set()

    threading.Thread(target=work, name="graft-ray-init", daemon=True).start()
    if not done.wait(CONNECT_DEADLINE_S):
        raise GraftError(
            f"{source}: no Ray cluster joined within {CONNECT_DEADLINE_S:g} s (is it a Ray head of the "
            "same Ray version?); check `ray status` there, or use cluster.address = '' for a local Ray"
        )
    if "error" in outcome:
        raise outcome["error"]


def check_resources(cluster: ClusterConfig, actors: int) -> None:
    """A GraftError when the Ray cluster can never hold ``actors`` actors of the configured size (Ray
    would wait for them forever)."""
    total = ray.cluster_resources()
    for key, name, per_actor in (("CPU", "cpus", cluster.worker_cpus), ("GPU", "gpus", cluster.worker_gpus)):
        need, have = actors * per_actor, float(total.get(key, 0.0))
        if need > have + 1e-9:
            raise GraftError(
                f"cluster.worker_{name} = {per_actor:g}: {actors} rollout actors need {need:g} {key}s but "
                f"the Ray cluster has {have:g} (lower cluster.worker_{name} or cluster.rollout_workers, or "
                "add nodes)"
            )


class RayRolloutPool:
    """The rollout stage runner (``StageRunner``) of the Ray executor; use it as a context manager.

    ``before_shard`` runs in the actor before it plays a shard (tests inject crashes with it).
    ``reports`` lists every shard call's ``ShardReport`` in the order the shards finished.
    """

    def __init__(self, before_shard: ShardHook | None = None) -> None:
        self.before_shard = before_shard
        self.actors: list[Any] = []
        self.reports: list[ShardReport] = []
        self._owns_ray = False

    def __enter__(self) -> RayRolloutPool:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.close()

    def __call__(self, run: Run, iteration: int, config: Config) -> None:
        """Play ``iteration`` on the actors and merge their shards into ``steps.parquet``."""
        model_dir, version = acting_policy(run, iteration, config, "rollout")
        shards = min(config.cluster.rollout_workers, config.rollout.groups)
        actors = self._actors(config.cluster, shards)
        root = str(run.root.resolve())
        calls = {
            actor.play.remote(root, iteration, config, str(model_dir), version): shard
            for shard, actor in enumerate(actors)
        }
        failure: GraftError | None = None
        while calls:
            [done], _ = ray.wait(list(calls), num_returns=1)
            shard = calls.pop(done)
            try:
                self.reports.append(self._result(done, shard, shards, iteration, config.cluster))
            except GraftError as exc:  # the other shards still finish: a rerun does not play them again
                failure = failure or exc
        if failure is not None:
            raise failure
        if not merge_rollout_shards(run, iteration, config, shards):
            raise GraftError(
                f"rollout of iteration {iteration}: the actors finished but not every "
                f"steps.shard-*-of-{shards}.parquet is in {run.iter_dir(iteration)} (is the run directory "
                "on a filesystem every node shares?)"
            )
        for stale in run.iter_dir(iteration).glob("*.shard-*-of-*.parquet"):
            stale.unlink(missing_ok=True)  # left by a pool of another size in an earlier process
        if engine_released_for_update(config):
            ray.get([actor.release_engine.remote() for actor in actors])

    def _result(
        self, ref: Any, shard: int, shards: int, iteration: int, cluster: ClusterConfig
    ) -> ShardReport:
        try:
            return ray.get(ref)
        except RayTaskError as exc:  # an exception inside play: a GraftError stays one line
            if isinstance(exc.cause, GraftError):
                raise GraftError(str(exc.cause)) from None
            raise
        except RayActorError as exc:
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise GraftError(
                f"rollout actor {shard} of {shards} died in iteration {iteration} ({reason}) and Ray "
                f"restarts a dead actor at most cluster.max_restarts = {cluster.max_restarts} times; "
                "finished shards are kept: rerun the loop to resume"
            ) from None

    def _actors(self, cluster: ClusterConfig, shards: int) -> list[Any]:
        """The pool's actors, one per shard; started (with Ray) on first use."""
        if len(self.actors) == shards:
            return self.actors
        self._kill_actors()
        self._owns_ray = connect(cluster) or self._owns_ray
        check_resources(cluster, shards)
        actor_class = ray.remote(RolloutWorker).options(
            num_cpus=cluster.worker_cpus,
            num_gpus=cluster.worker_gpus,
            max_restarts=cluster.max_restarts,
            max_task_retries=cluster.max_restarts,
        )
        self.actors = [actor_class.remote(shard, shards, self.before_shard) for shard in range(shards)]
        return self.actors

    def _kill_actors(self) -> None:
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.actors = []

    def close(self) -> None:
        """Kill the actors; shut Ray down when this pool started it."""
        if ray.is_initialized():
            self._kill_actors()
        if self._owns_ray:
            ray.shutdown()
            self._owns_ray = False
