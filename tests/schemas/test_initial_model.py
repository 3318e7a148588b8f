"""The run's initial model is recorded in its manifest and verified wherever it is loaded: a flipped
byte in ``model/model.safetensors``, or another model of the same shape in its place, was evaluated
by ``graft eval --checkpoint initial`` and trained against by the loop and the update, all exit 0. Now
each refuses with one line naming the file; a LoRA checkpoint is evaluated only on the run's own base
(the check ``graft export`` applies)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from graft_cli.app import app
from schemas.errors import GraftError
from schemas.initial_model import MODELS_KEY, record_initial_models, verify_initial_model
from schemas.manifest import MANIFEST_FILE
from schemas.rundir import Run
from tests.helpers.loop_runs import micro_config


def _flip(path: Path, count: int = 1000) -> None:
    data = bytearray(path.read_bytes())
    start = len(data) // 2
    for i in range(start, start + count):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


READERS = {
    "eval initial": ["eval", "{run}", "--checkpoint", "initial", "--force"],
    "loop": ["loop", "--run", "{run}", "--iters", "3"],
    "update": ["update", "{run}", "--iter", "0", "--force", "--yes"],
    "rollout": ["rollout", "{run}", "--iter", "0", "--force", "--yes", "--no-progress"],
}


def _refused(run: Path, args: list[str], names: str) -> None:
    before = sorted(p.relative_to(run) for p in run.rglob("*") if p.name != ".lock")
    result = CliRunner().invoke(app, [a.replace("{run}", str(run)) for a in args])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and names in lines[0], result.output
    assert "Traceback" not in result.output
    assert sorted(p.relative_to(run) for p in run.rglob("*") if p.name != ".lock") == before


def test_the_run_records_its_initial_model(run: Path) -> None:
    manifest = json.loads((run / MANIFEST_FILE).read_text())
    recorded = manifest[MODELS_KEY]["model"]
    assert "model.safetensors" in recorded and "config.json" in recorded
    assert CliRunner().invoke(app, ["loop", "--run", str(run), "--iters", "2"]).exit_code == 0


@pytest.mark.parametrize("reader", sorted(READERS))
def test_a_changed_initial_model_is_refused(run: Path, reader: str) -> None:
    _flip(run / "model" / "model.safetensors")
    _refused(run, READERS[reader], f"{run}/model/model.safetensors: checksum differs from the run's manifest")


def test_another_model_of_the_same_shape_is_refused(run: Path) -> None:
    from safetensors.torch import load_file, save_file

    path = run / "model" / "model.safetensors"
    tensors = {name: tensor + 0.01 for name, tensor in load_file(path).items()}  # same tensors, other values
    save_file(tensors, path, metadata={"format": "pt"})
    _refused(run, READERS["eval initial"], f"{run}/model/model.safetensors")
    _refused(run, READERS["loop"], f"{run}/model/model.safetensors")


def test_an_added_or_missing_file_is_refused(run: Path) -> None:
    (run / "model" / "extra.json").write_text("{}")
    _refused(run, READERS["eval initial"], "model/extra.json: not in the run's manifest")
    (run / "model" / "extra.json").unlink()
    (run / "model" / "tokenizer.json").unlink()
    _refused(run, READERS["eval initial"], "model/tokenizer.json: listed in the run's manifest but missing")


def test_a_run_from_before_the_record_is_read_then_recorded(run: Path) -> None:
    path = run / MANIFEST_FILE
    manifest = json.loads(path.read_text())
    del manifest[MODELS_KEY]
    path.write_text(json.dumps(manifest))
    for folder in run.glob("iter_*"):  # iterations finished before the record: they do not list it
        iteration_manifest = json.loads((folder / MANIFEST_FILE).read_text())
        del iteration_manifest["root"]
        (folder / MANIFEST_FILE).write_text(json.dumps(iteration_manifest))
    r = Run(run)
    verify_initial_model(r, r.initial_model_dir)  # nothing recorded: nothing to verify
    record_initial_models(r, micro_config())
    assert "model" in json.loads(path.read_text())[MODELS_KEY]
    _flip(run / "model" / "config.json", 1)
    with pytest.raises(GraftError, match=r"model/config.json: (size|checksum) differs"):
        verify_initial_model(r, r.initial_model_dir)


@pytest.mark.parametrize("sft", [False, True])
def test_no_stage_builds_the_initial_policy_and_the_refusal_names_the_command(
    tmp_path: Path, sft: bool
) -> None:
    # the rollout stage of a fresh run finds no initial policy: it builds nothing (no tiny model, no
    # warm start hidden inside a stage runner) and says which command makes it
    from schemas.config import load_config
    from schemas.initial_model import acting_policy
    from schemas.rundir import create_run
    from stages.rollout import run_rollout
    from tests.helpers.loop_runs import CONFIGS, MICRO

    config = load_config(CONFIGS / "quickstart.toml", [*MICRO, f"sft.enabled={str(sft).lower()}"])
    fresh = create_run(tmp_path / "fresh", config)
    command = f"graft sft {fresh.root}" if sft else f"graft loop --run {fresh.root}"
    for call in (lambda: run_rollout(fresh, 0, config), lambda: acting_policy(fresh, 0, config, "update")):
        with pytest.raises(GraftError, match="no initial policy yet") as caught:
            call()
        assert command in str(caught.value)
    assert not fresh.initial_model_dir.exists() and not fresh.sft_dir.exists()


def test_the_rollout_command_prepares_a_fresh_run_before_its_stage(tmp_path: Path) -> None:
    from schemas.config import load_config
    from schemas.rundir import create_run
    from tests.helpers.loop_runs import CONFIGS, MICRO

    fresh = create_run(tmp_path / "fresh", load_config(CONFIGS / "quickstart.toml", MICRO))
    result = CliRunner().invoke(app, ["rollout", str(fresh.root), "--iter", "0"])
    assert result.exit_code == 0, result.output
    assert (fresh.initial_model_dir / "config.json").is_file() and fresh.stage_complete("rollout", 0)


@pytest.mark.parametrize("lost", ["the models record", "the run manifest"])
@pytest.mark.parametrize("reader", sorted(READERS))
def test_a_lost_root_record_with_a_swapped_model_is_refused(run: Path, reader: str, lost: str) -> None:
    """The record deleted (the key or the whole manifest) and another model of the same shape put in
    place: recorded as the run's own and evaluated, trained with, exit 0. The run's finished
    iterations list the record they were made with, so its loss is damage."""
    from safetensors.torch import load_file, save_file

    path = run / MANIFEST_FILE
    if lost == "the run manifest":
        path.unlink()
    else:
        manifest = json.loads(path.read_text())
        del manifest[MODELS_KEY]
        path.write_text(json.dumps(manifest))
    weights = run / "model" / "model.safetensors"
    save_file({name: t + 0.01 for name, t in load_file(weights).items()}, weights, metadata={"format": "pt"})
    _refused(run, READERS[reader], f"{run}/manifest.json: ")
