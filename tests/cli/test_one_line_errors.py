"""Inputs that used to end in a traceback end in one ``error:`` line (exit 2) and write nothing: files
that are not GGUF, model sizes beyond the tiny model's bounds, an unknown estimator (refused with every
other key, before a run is created, and by ``graft schema config``), a malformed ``--option`` named as
itself; a Graph GAE setting the chosen estimator ignores is said in a warning."""

from __future__ import annotations

import random
import struct
from pathlib import Path

import pytest
from typer.testing import CliRunner

from graft_cli.app import app
from tests.helpers.damage import one_error_line
from tests.helpers.paths import CONFIGS

NOT_GGUF = {
    "empty": b"",
    "text": b"root:x:0:0:root:/root:/bin/bash\n" * 20,
    "random": b"\x00" + random.Random(0).randbytes(4095),
    "header without metadata": b"GGUF" + struct.pack("<IQQ", 3, 0, 0),
    "header then noise": b"GGUF" + struct.pack("<IQQ", 3, 1, 1) + b"\xff\xfe" * 300,
    "cut header": b"GGUF\x03\x00",
}


@pytest.mark.parametrize("label", sorted(NOT_GGUF))
def test_a_file_that_is_not_gguf_is_one_line(label: str, tmp_path: Path) -> None:
    source = tmp_path / "model.gguf"
    source.write_bytes(NOT_GGUF[label])
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["init-model", str(out), "--gguf", str(source)])
    one_error_line(result, str(source))
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir()] == ["model.gguf"]  # no temporary directory left


@pytest.mark.parametrize(
    "args", [["--hidden", "1000000000"], ["--layers", "100000"], ["--heads", "4096", "--hidden", "4096"]]
)
def test_init_model_refuses_a_tiny_model_beyond_its_bounds(args: list[str], tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["init-model", str(out), "--tiny", *args])
    one_error_line(result, "too large")
    assert not out.exists()


@pytest.mark.parametrize(
    "item", ["model.tiny_hidden=1000000000", "model.tiny_layers=1000", "model.tiny_heads=100000"]
)
def test_the_config_bounds_the_tiny_model(item: str) -> None:
    result = CliRunner().invoke(app, ["schema", "config", "--set", item])
    one_error_line(result, item.split("=")[0])


@pytest.mark.parametrize("name", ["bogus", "os:system", ""])
def test_schema_config_refuses_an_unknown_estimator(name: str) -> None:
    result = CliRunner().invoke(app, ["schema", "config", "--set", f"advantage.estimator={name!r}"])
    one_error_line(result, "advantage.estimator")


def test_every_registered_estimator_is_a_valid_name() -> None:
    from schemas.config import BUILTIN_ESTIMATORS, load_config
    from stages.credit.advantage import ESTIMATORS

    assert set(BUILTIN_ESTIMATORS) == set(ESTIMATORS)
    for name in ESTIMATORS:
        assert load_config(None, [f"advantage.estimator={name}"]).advantage.estimator == name


def test_an_estimator_registered_from_python_is_accepted() -> None:
    from schemas.config import load_config
    from stages.credit.advantage import ESTIMATORS, register

    @register("test_only_estimator")
    def _estimator(inputs, config):  # type: ignore[no-untyped-def]
        raise AssertionError("not run")

    try:
        assert load_config(None, ["advantage.estimator=test_only_estimator"]).advantage.estimator
    finally:
        del ESTIMATORS["test_only_estimator"]


def test_a_loop_with_an_unknown_estimator_writes_nothing(tmp_path: Path) -> None:
    run = tmp_path / "run"
    result = CliRunner().invoke(
        app,
        ["loop", "--config", str(CONFIGS / "quickstart.toml"), "--run", str(run), "--set",
         "advantage.estimator=bogus"],
    )  # fmt: skip
    one_error_line(result, "advantage.estimator")
    assert not run.exists()  # was: the tiny model built and iteration 0 played before the refusal


def test_init_model_names_option_in_its_own_error(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["init-model", str(tmp_path / "m"), "--tiny", "--option", "bogus"])
    line = one_error_line(result, "--option 'bogus'")
    assert "--set" not in line


@pytest.mark.parametrize("item", ["advantage.lam=0.5", "advantage.gae=none", "advantage.gae_horizon=markov"])
def test_a_gae_setting_graphmc_ignores_is_a_warning(item: str) -> None:
    from schemas.config import load_config
    from schemas.errors import GraftWarning

    with pytest.warns(GraftWarning, match=f"{item.split('=')[0]}.*ignored.*graphmc"):
        load_config(None, ["advantage.estimator=graphmc", item])


def test_graft_reads_its_gae_settings_without_a_warning(recwarn: pytest.WarningsRecorder) -> None:
    from schemas.config import load_config
    from schemas.errors import GraftWarning

    load_config(None, ["advantage.lam=0.5", "advantage.gae=none"])
    load_config(None, ["advantage.estimator=graphmc"])
    assert not [w for w in recwarn if issubclass(w.category, GraftWarning)]
