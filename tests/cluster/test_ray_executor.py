"""The Ray executor (docs/design.md §12, docs/scaling.md "The Ray executor"): ``graft loop --executor ray``.

The loops run the micro config of tests/loop/test_loop.py on a local Ray cluster (2 CPUs, 2 rollout actors)
and are compared with its local reference run: every table and checkpoint the same, a killed actor
included. The merge and config/CLI tests need no Ray; the Ray ones skip where ray is not installed.
"""

from __future__ import annotations

import functools
import logging
import re
import shutil
from pathlib import Path

import numpy as np
import polars as pl
import pytest

from graft_cli.app import app
from schemas import read_table
from schemas.config import load_config
from schemas.errors import GraftError
from schemas.rundir import create_run
from stages.cluster.worker import RolloutWorker
from stages.loop import STAGE_RUNNERS, run_loop
from stages.rollout import merge_rollout_shards, shard_name
from tests.helpers.loop_runs import WALL_CLOCK, micro_config, micro_run
from tests.helpers.paths import CONFIGS
from tests.helpers.ray_faults import crash_once

# the merge's own row: how many shards it joined (a local rollout has none)
MERGE_ONLY = "shards"


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray cluster for this module's loops (2 CPUs: one per rollout actor), shut down after."""
    ray = pytest.importorskip("ray", reason="the ray extra is not installed")
    from stages.cluster.ray_executor import worker_runtime_env

    ray.init(
        num_cpus=2, include_dashboard=False, logging_level=logging.WARNING, runtime_env=worker_runtime_env()
    )
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The micro config's 2-iteration run with the local executor (shared with tests/loop/test_loop.py)."""
    return micro_run(tmp_path_factory.mktemp("ref"))


# the behaviour policy's scores: their last float bits depend on how the policy calls were batched
SCORES = ["response_logprobs", "choice_scores"]


def ray_config():
    config = micro_config()
    config.cluster.executor = "ray"
    return config


def _parquet_names(root: Path) -> list[str]:
    return sorted(
        str(p.relative_to(root))
        for p in root.rglob("*.parquet")
        if not any(part.startswith(".") for part in p.relative_to(root).parts)
    )


def assert_same_run(want: Path, got: Path) -> None:
    """Run ``got`` holds the tables and checkpoints of run ``want``: every table equal (rows, order,
    values) but for wall-clock metrics rows and the merge's ``shards`` row, and the behaviour policy's
    scores (``response_logprobs``, ``choice_scores``) equal to float32 rounding (another batch pads and
    sums differently); checkpoint tensors bit-identical."""
    from safetensors.torch import load_file

    assert _parquet_names(got) == _parquet_names(want)
    for name in _parquet_names(want):
        a, b = pl.read_parquet(want / name), pl.read_parquet(got / name)
        if "name" in a.columns:
            keep = ~pl.col("name").str.contains(WALL_CLOCK) & (pl.col("name") != MERGE_ONLY)
            a, b = a.filter(keep), b.filter(keep)
        for column in SCORES:
            if column in a.columns:
                x, y = (f[column].explode().to_numpy() for f in (a, b))
                np.testing.assert_allclose(y, x, rtol=0, atol=1e-5, err_msg=f"{name}: {column}")
                a, b = a.drop(column), b.drop(column)
        assert b.equals(a), name
    tensors = sorted(str(p.relative_to(want)) for p in (want / "checkpoints").rglob("*.safetensors"))
    assert tensors and tensors == sorted(
        str(p.relative_to(got)) for p in (got / "checkpoints").rglob("*.safetensors")
    )
    for name in tensors:
        a, b = load_file(want / name), load_file(got / name)
        assert sorted(a) == sorted(b)
        assert all((a[k] == b[k]).all() for k in a), name


def _shards_merged(root: Path, iteration: int) -> float:
    rows = read_table(root / f"iter_{iteration:04d}" / "metrics_rollout.parquet", "metrics")
    return rows.filter(pl.col("name") == MERGE_ONLY)["value"].item()


# ---------------------------------------------------------------------------------------------
# (a) a Ray loop equals a local loop


@pytest.mark.slow
def test_a_two_iteration_ray_loop_equals_the_local_loop(ray_cluster, reference: Path, tmp_path: Path) -> None:
    config = ray_config()
    run = create_run(tmp_path / "ray", config)
    run_loop(run, config, config.run.iters)  # cluster.executor = "ray": the loop builds the pool itself
    assert [_shards_merged(run.root, it) for it in (0, 1)] == [2.0, 2.0]  # two actors' shards, merged
    assert not list(run.root.rglob("*.shard-*"))
    assert_same_run(reference, run.root)


@pytest.mark.slow
def test_a_with_group_batch_scope_the_ray_steps_file_is_the_local_one_byte_for_byte(
    ray_cluster, tmp_path: Path
) -> None:
    """docs/design.md §12's byte-identical merge: with ``rollout.batch_scope = "group"`` an actor's policy calls
    batch exactly what the local run's do, so the merged steps file is the local file's bytes,
    log-probs included (under the default "all" they differ in the last bits: tests/rollout/test_rollout.py)."""
    files = []
    for executor in ("local", "ray"):
        config = micro_config()
        config.rollout.batch_scope, config.cluster.executor = "group", executor
        run = create_run(tmp_path / executor, config)
        run_loop(run, config, 1)
        files.append(run.table_path(0, "steps").read_bytes())
    assert files[0] == files[1]


# ---------------------------------------------------------------------------------------------
# (b) failures: a dead actor is replaced; past max_restarts a rerun plays only the missing shards


@pytest.mark.slow
def test_b_an_actor_that_dies_mid_iteration_is_replaced_and_the_run_is_unchanged(
    ray_cluster, reference: Path, tmp_path: Path
) -> None:
    from stages.cluster.ray_executor import RayRolloutPool

    config = ray_config()
    run = create_run(tmp_path / "ray", config)
    marker = tmp_path / "crashed"
    crash = functools.partial(crash_once, str(marker), at=(1, 0))  # actor 0, iteration 1
    with RayRolloutPool(before_shard=crash) as pool:
        run_loop(run, config, config.run.iters, runners={**STAGE_RUNNERS, "rollout": pool})
    assert marker.is_file(), "the fault did not fire"
    calls = {(r.iteration, r.shard): r for r in pool.reports}
    assert sorted(calls) == [(0, 0), (0, 1), (1, 0), (1, 1)] and len(pool.reports) == 4
    assert all(r.played for r in pool.reports)
    assert calls[0, 1].pid == calls[1, 1].pid  # an actor keeps its process between iterations
    assert calls[0, 0].pid == int(marker.read_text()) != calls[1, 0].pid  # the dead one was replaced
    assert_same_run(reference, run.root)


@pytest.mark.slow
def test_b_past_max_restarts_the_loop_stops_and_a_rerun_plays_only_the_missing_shard(
    ray_cluster, reference: Path, tmp_path: Path
) -> None:
    from stages.cluster.ray_executor import RayRolloutPool

    config = ray_config()
    config.cluster.max_restarts = 0
    run = create_run(tmp_path / "ray", config)
    crash = functools.partial(crash_once, str(tmp_path / "crashed"), at=(0, 0))
    with (
        pytest.raises(GraftError, match=r"rollout actor 0 of 2 died in iteration 0 .*max_restarts = 0"),
        RayRolloutPool(before_shard=crash) as pool,
    ):
        run_loop(run, config, config.run.iters, runners={**STAGE_RUNNERS, "rollout": pool})
    folder = run.iter_dir(0)
    assert (folder / shard_name("steps", (1, 2))).is_file()  # the other actor's shard finished
    assert not (folder / shard_name("steps", (0, 2))).exists() and not run.stage_complete("rollout", 0)
    # as if a driver were killed while actor 0 wrote its shard: a half-written file nobody may read
    half = folder / ".steps.shard-0-of-2.parquet.k1ll3d.tmp"
    half.write_bytes(b"PAR1 half a table")
    with RayRolloutPool() as resumed:
        run_loop(run, config, config.run.iters, runners={**STAGE_RUNNERS, "rollout": resumed})
    played = sorted((r.iteration, r.shard, r.played) for r in resumed.reports)
    assert played == [(0, 0, True), (0, 1, False), (1, 0, True), (1, 1, True)]
    assert not half.exists()
    assert_same_run(reference, run.root)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (["cluster.rollout_workers=3"], "3 rollout actors need 3 CPUs but the Ray cluster has 2"),
        (
            ["cluster.worker_gpus=1"],
            "cluster.worker_gpus = 1: 2 rollout actors need 2 GPUs but the Ray cluster",
        ),
    ],
)
def test_b_actors_the_cluster_can_never_place_are_refused_not_awaited(
    ray_cluster, reference: Path, tmp_path: Path, settings: list[str], message: str
) -> None:
    from stages.cluster.ray_executor import RayRolloutPool

    config = load_config(CONFIGS / "quickstart.toml", ["rollout.groups=4", *settings])
    run = create_run(tmp_path / "run", config)
    shutil.copytree(reference / "model", run.initial_model_dir)  # any model will do: nothing plays
    with RayRolloutPool() as pool, pytest.raises(GraftError, match=re.escape(message)):
        pool(run, 0, config)
    assert pool.actors == [] and not list(run.iter_dir(0).glob("*.parquet"))


# ---------------------------------------------------------------------------------------------
# (c) the comparison sees a lost, duplicated or reordered shard; the merge refuses or waits


def test_c_a_lost_duplicated_or_reordered_shard_changes_the_table_and_the_merge_refuses_it(
    reference: Path, tmp_path: Path
) -> None:
    config = micro_config()
    run = create_run(tmp_path / "run", config)
    shutil.copytree(reference / "model", run.initial_model_dir)
    folder = run.iter_dir(0)
    for shard in (0, 1):  # the actors' work, played in this process
        report = RolloutWorker(shard, 2).play(str(run.root), 0, config, str(run.initial_model_dir), "initial")
        assert report.played
    first, second = (read_table(folder / shard_name("steps", (s, 2)), "steps") for s in (0, 1))
    want = read_table(reference / "iter_0000" / "steps.parquet", "steps").drop(SCORES)
    for wrong in (first, pl.concat([first, first]), pl.concat([second, first])):  # lost, twice, reordered
        assert not wrong.drop(SCORES).equals(want)

    steps1 = folder / shard_name("steps", (1, 2))
    kept = steps1.read_bytes()
    shutil.copy(folder / shard_name("steps", (0, 2)), steps1)  # shard 0 written twice
    with pytest.raises(GraftError, match="duplicate"):
        merge_rollout_shards(run, 0, config, 2)
    steps1.unlink()  # lost: the merge waits for it
    assert not merge_rollout_shards(run, 0, config, 2) and not run.stage_complete("rollout", 0)
    steps1.write_bytes(kept)
    assert merge_rollout_shards(run, 0, config, 2)
    assert run.read(0, "steps").drop(SCORES).equals(want)
    # a worker asked again for a finished shard does not play it
    worker = RolloutWorker(1, 2)
    shutil.copy(folder / "steps.parquet", folder / shard_name("steps", (1, 2)))
    assert not worker.play(str(run.root), 0, config, str(run.initial_model_dir), "initial").played


# ---------------------------------------------------------------------------------------------
# (d) the [cluster] section and --executor


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('executor = "slurm"', "'cluster.executor' = 'slurm' is invalid; expected 'local' | 'ray'"),
        ('address = "http://head:6379"', "'cluster.address' = 'http://head:6379' is invalid; must be ''"),
        ('address = "head"', "'cluster.address' = 'head' is invalid"),
        ("rollout_workers = 0", "'cluster.rollout_workers' = 0 is invalid; must be >= 1"),
        ("rollout_workers = 1.5", "'cluster.rollout_workers' = 1.5 is invalid; expected int"),
        ("worker_cpus = 0", "'cluster.worker_cpus' = 0.0 is invalid; must be > 0"),
        ("worker_cpus = nan", "'cluster.worker_cpus' = nan is invalid; numbers must be finite"),
        ("worker_gpus = -0.5", "'cluster.worker_gpus' = -0.5 is invalid; must be >= 0"),
        ("max_restarts = -1", "'cluster.max_restarts' = -1 is invalid; must be >= 0"),
        ("workers = 2", "unknown config key 'cluster.workers'; valid keys in [cluster]: address, executor"),
    ],
)
def test_d_the_cluster_section_is_validated(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "c.toml"
    path.write_text(f"[cluster]\n{line}\n")
    with pytest.raises(GraftError, match=f"^{path}: config key |^{path}: unknown") as caught:
        load_config(path)
    assert message in str(caught.value)


def test_d_cluster_settings_that_load() -> None:
    for address in ("", "auto", "10.0.0.5:6379", "ray://head.example:10001", "[::1]:6379"):
        config = load_config(None, [f'cluster.address="{address}"', "cluster.worker_gpus=0.25"])
        assert config.cluster.address == address and config.cluster.worker_gpus == 0.25
    assert load_config(None).cluster.executor == "local"  # the default install needs no ray


def _loop(runner, tmp_path: Path, *args: str):
    return runner.invoke(
        app, ["loop", "--config", str(CONFIGS / "quickstart.toml"), "--run", str(tmp_path / "run"), *args]
    )


def test_d_executor_flag_errors_are_one_line_and_write_nothing(
    runner, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import stages.cluster

    result = _loop(runner, tmp_path, "--executor", "slurm")
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines() == ["error: --executor 'slurm': expected local or ray"]

    monkeypatch.setattr(stages.cluster, "ray_installed", lambda: False)
    result = _loop(runner, tmp_path, "--executor", "ray")
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines() == [
        "error: cluster.executor = 'ray' (--executor ray) but ray is not installed "
        "(pip install -e '.[ray]' in the graft checkout, or use --executor local)"
    ]

    monkeypatch.setattr(stages.cluster, "ray_installed", lambda: True)
    result = _loop(runner, tmp_path, "--executor", "ray", "--set", "cluster.address=127.0.0.1:1")
    assert result.exit_code == 2
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("error: cluster.address = '127.0.0.1:1': no Ray head answers there")
    assert not (tmp_path / "run").exists()  # refused before the run directory was made


def test_d_the_executor_is_bookkeeping_a_resumed_run_may_switch_it(tmp_path: Path) -> None:
    from stages.loop.start import open_loop_run

    config = load_config(CONFIGS / "quickstart.toml")
    open_loop_run(tmp_path / "run", config, 0, force=False)
    switched = load_config(CONFIGS / "quickstart.toml", ["cluster.executor=ray", "cluster.rollout_workers=4"])
    run, resumed, _ = open_loop_run(tmp_path / "run", switched, 0, force=False)  # no --force needed
    assert resumed.cluster.executor == "ray" and run.saved_config().cluster.rollout_workers == 4


@pytest.fixture
def not_ray():
    """A local TCP server that accepts and answers like a web server, not a Ray head."""
    import socket
    import threading

    server = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve() -> None:
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            with conn:
                conn.settimeout(1.0)
                try:
                    conn.recv(1024)
                    conn.sendall(b"HTTP/1.0 400 Bad Request\r\n\r\n")
                except OSError:
                    pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.getsockname()[1]}"
    stop.set()
    thread.join()
    server.close()


@pytest.fixture
def silent():
    """A local TCP server that accepts and never answers."""
    import socket

    server = socket.create_server(("127.0.0.1", 0))
    yield f"127.0.0.1:{server.getsockname()[1]}"
    server.close()


def test_d_an_address_that_is_not_a_ray_head_is_refused_at_once(
    runner, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, not_ray: str, silent: str
) -> None:
    # ray.init waited forever on a port where something else listens, and on RAY_ADDRESS pointing nowhere
    import time

    monkeypatch.setattr("stages.cluster.ray_installed", lambda: True)
    for address in (not_ray, silent):
        start = time.monotonic()
        result = _loop(runner, tmp_path, "--executor", "ray", "--set", f"cluster.address={address}")
        assert result.exit_code == 2, result.output
        [line] = result.stderr.strip().splitlines()
        assert line.startswith(f"error: cluster.address = '{address}': ") and "not a Ray head" in line
        assert time.monotonic() - start < 15 and not (tmp_path / "run").exists()
    for value in ("127.0.0.1:1", not_ray):
        monkeypatch.setenv("RAY_ADDRESS", value)
        for address in ("", "auto"):
            result = _loop(runner, tmp_path, "--executor", "ray", "--set", f"cluster.address={address!r}")
            assert result.exit_code == 2, result.output
            [line] = result.stderr.strip().splitlines()
            assert line.startswith(
                f"error: RAY_ADDRESS = '{value}' (where ray.init connects with cluster.address"
            )
            assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("address", ["127.0.0.1:99999", "127.0.0.1:0", "[::1]:65536"])
def test_d_an_address_with_an_impossible_port_is_invalid(address: str) -> None:
    with pytest.raises(GraftError, match=r"config key 'cluster.address' = .* port must be in \[1, 65535\]"):
        load_config(None, [f'cluster.address="{address}"'])


def test_d_joining_ray_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """ray.init itself never waits longer than CONNECT_DEADLINE_S for a remote cluster."""
    pytest.importorskip("ray")
    import threading

    import stages.cluster.ray_executor as executor

    release = threading.Event()
    monkeypatch.setattr(executor, "probe_address", lambda *a, **k: None)
    monkeypatch.setattr(executor.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(executor.ray, "init", lambda **kw: release.wait(30))
    monkeypatch.setattr(executor, "CONNECT_DEADLINE_S", 0.5)
    config = ray_config()
    config.cluster.address = "10.0.0.5:6379"
    try:
        with pytest.raises(
            GraftError, match=r"cluster.address = '10.0.0.5:6379': no Ray cluster joined within 0.5 s"
        ):
            executor.connect(config.cluster)
    finally:
        release.set()


def test_d_starting_ray_prints_no_token_auth_line(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("ray")
    import logging

    import stages.cluster.ray_executor as executor

    def init(**options) -> None:
        logging.getLogger("ray._private.authentication.authentication_token_setup").warning(
            "Token authentication is enabled for this Ray cluster. Set RAY_AUTH_MODE=disabled to opt out."
        )
        logging.getLogger("ray._private.worker").warning("something else")

    monkeypatch.setattr(executor.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(executor.ray, "init", init)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("ray").addHandler(handler)  # ray's loggers do not propagate to the root
    try:
        assert executor.connect(ray_config().cluster) is True
    finally:
        logging.getLogger("ray").removeHandler(handler)
    assert seen == ["something else"]
