"""Update stage under torch.distributed: 2 CPU processes (gloo) give the 1-process result (docs/design.md §7, §12)."""

from __future__ import annotations

import os
import shutil
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from schemas.rundir import Run
from tests.helpers.update_rows import make_run

torch.set_num_threads(1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, jobs: list[tuple[str, list[str]]]) -> None:
    os.environ.update(
        {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
        }
    )
    torch.set_num_threads(1)
    from stages.update import run_update

    for root, overrides in jobs:  # each run_update joins and leaves the process group
        run = Run(Path(root))
        run_update(run, 0, run.load_config(overrides))


def _run_distributed(jobs: list[tuple[Path, list[str]]], world_size: int = 2) -> None:
    args = (world_size, _free_port(), [(str(root), overrides) for root, overrides in jobs])
    mp.spawn(_worker, args=args, nprocs=world_size, join=True)


def _weights(run: Run) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(run.checkpoint_dir(0) / "model.safetensors"))


def _summary(run: Run) -> dict[str, float]:
    t = run.read(0, "update")
    return {n: v for e, n, v in t.select("epoch", "name", "value").iter_rows() if e == -1}


def _assert_same_update(single: Run, multi: Run) -> None:
    one, two = _weights(single), _weights(multi)
    assert one.keys() == two.keys()
    moved = max(float((one[k] - w0).abs().max()) for k, w0 in _weights_initial(single).items() if k in one)
    assert moved > 1e-3  # the update did something
    for k in one:
        torch.testing.assert_close(two[k], one[k], atol=5e-5, rtol=1e-4, msg=k)
    s1, s2 = _summary(single), _summary(multi)
    assert s2["world_size"] == 2 and s1["world_size"] == 1
    for name in (
        "loss",
        "policy_loss",
        "kl",
        "clip_fraction",
        "ratio_mean",
        "ratio_max",
        "grad_norm",
        "entropy",
    ):
        assert s2[name] == pytest.approx(s1[name], rel=1e-3, abs=1e-5), name
    # rank 0 alone wrote: one checkpoint, no stray temporary directories
    assert sorted(p.name for p in (multi.root / "checkpoints").iterdir()) == ["iter_0000"]


def _weights_initial(run: Run) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(run.initial_model_dir / "model.safetensors"))


def _pair(tmp_path: Path, name: str, **update) -> tuple[Run, Run]:
    from stages.update import run_update

    single, _ = make_run(tmp_path / f"{name}-single", "mixed", max_tokens_per_batch=120, **update)
    shutil.copytree(single.root, tmp_path / f"{name}-multi")
    run_update(single, 0, single.load_config())
    return single, Run(tmp_path / f"{name}-multi")


@pytest.mark.slow
def test_ddp_two_processes_equal_one_process(tmp_path):
    """Same global minibatches split over 2 gloo ranks: same weights as one process, for the row-mean
    (GRPO-C) and the token-mean (GRPO) normalization."""
    pairs = [_pair(tmp_path, objective, objective=objective) for objective in ("grpo_c", "grpo")]
    _run_distributed([(multi.root, []) for _, multi in pairs])
    for single, multi in pairs:
        _assert_same_update(single, multi)


@pytest.mark.slow
def test_fsdp2_two_processes_equal_one_process(tmp_path):
    single, multi = _pair(tmp_path, "fsdp")
    _run_distributed([(multi.root, ['update.parallel="fsdp"'])])
    _assert_same_update(single, multi)


@pytest.mark.slow
def test_the_loop_launches_torchrun_for_update_procs_2(tmp_path):
    # the update under torchrun launched by the driver (cluster.update_procs)
    from stages.loop import STAGE_RUNNERS

    single, multi = _pair(tmp_path, "launched")
    config = multi.load_config(["cluster.update_procs=2"])
    STAGE_RUNNERS["update"](multi, 0, config)
    _assert_same_update(single, multi)


def test_a_failed_launched_update_is_one_line(tmp_path, monkeypatch):
    import sys

    from schemas.errors import GraftError
    from stages.update import launch

    run, _ = make_run(tmp_path, "choose")
    config = run.load_config(["cluster.update_procs=2"])
    seen = []
    real_command = launch.torchrun_command

    def failing(run_dir, iteration, config_path, procs):  # what the loop would run, then a failure
        seen.append((run_dir, iteration, procs, config_path.read_text()))
        return [sys.executable, "-c", "raise SystemExit(3)"]

    monkeypatch.setattr(launch, "torchrun_command", failing)
    with pytest.raises(GraftError, match=r"update of iteration 0 under torchrun \(2 processes.*exit code 3"):
        launch.loop_update(run, 0, config)
    assert seen[0][:3] == (run.root, 0, 2) and "update_procs = 2" in seen[0][3]
    assert not run.checkpoint_dir(0).exists()
    command = real_command(run.root, 4, tmp_path / "c.toml", 8)
    assert command[1:5] == ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=8"]
    assert command[-4:] == ["stages.update.launch", str(run.root), "4", str(tmp_path / "c.toml")]
