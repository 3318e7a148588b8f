"""graft_cli/config.py: typed TOML configs, unknown keys, --set overrides, defaults."""

from __future__ import annotations

import dataclasses

import pytest

from schemas.config import Config, SolveConfig, apply_overrides, config_from_dict, load_config
from schemas.errors import GraftError


def test_documented_defaults_exist():
    config = load_config()
    assert config.graph.canonicalize == "exact"
    assert config.graph.tau == 0.9
    assert config.graph.truncation == "fail"
    assert config.solve.gamma == 0.99
    assert config.solve.eps == 1e-8
    assert config.advantage.estimator == "graft"
    assert config.advantage.gae == "graph"
    assert config.advantage.lam == 0.95
    assert config.advantage.normalize == "node"


def test_unknown_key_lists_the_valid_keys(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[solve]\ngamma = 0.9\ngama = 0.5\n")
    with pytest.raises(GraftError) as info:
        load_config(path)
    message = str(info.value)
    assert message.startswith(str(path))
    assert "unknown config key 'solve.gama'" in message
    valid = ", ".join(sorted(f.name for f in dataclasses.fields(SolveConfig)))
    assert f"valid keys in [solve]: {valid}" in message and "gamma" in valid
    with pytest.raises(
        GraftError, match=r"unknown config key 'solver'; valid keys in the top level: .*solve"
    ):
        config_from_dict({"solver": {"gamma": 0.9}})


def test_set_overrides_parse_toml_literals_with_types():
    config = load_config(
        None,
        [
            "solve.gamma=0.9",
            "rollout.groups=4",
            "graph.canonicalize=similarity",
            'run.name="my run"',
            "update.bf16=false",
            "advantage.lam=1",  # an int where a float is expected is accepted as a float
        ],
    )
    assert config.solve.gamma == 0.9
    assert config.rollout.groups == 4 and isinstance(config.rollout.groups, int)
    assert config.graph.canonicalize == "similarity"
    assert config.run.name == "my run"
    assert config.update.bf16 is False
    assert config.advantage.lam == 1.0 and isinstance(config.advantage.lam, float)


def test_set_overrides_a_file_value(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[solve]\ngamma = 0.5\n[rollout]\ngroups = 2\n")
    config = load_config(path, ["solve.gamma=0.8"])
    assert config.solve.gamma == 0.8 and config.rollout.groups == 2


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("rollout.groups=1.5", r"'rollout.groups' = 1.5 is invalid; expected int"),
        ("rollout.groups=true", r"'rollout.groups' = True is invalid; expected int"),
        (
            "graph.canonicalize=fuzzy",
            r"'graph.canonicalize' = 'fuzzy' is invalid; expected 'exact' \| 'similarity'",
        ),
        ("solve.gamma=yes", r"'solve.gamma' = 'yes' is invalid; expected float"),
        ("update.bf16=1", r"'update.bf16' = 1 is invalid; expected bool"),
    ],
)
def test_wrong_types_are_refused(override, expected):
    with pytest.raises(GraftError, match=expected):
        load_config(None, [override])


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("solve.gamma=0", "solve.gamma must be in"),
        ("solve.gamma=1.5", "solve.gamma must be in"),
        ("advantage.lam=-0.1", "advantage.lam must be in"),
        ("graph.tau=0", "graph.tau must be in"),
        ("rollout.group_size=0", "rollout.group_size must be >= 1"),
        ("run.seed=-1", "run.seed must be >= 0"),
        ("update.lr=-1e-5", "update.lr must be >= 0"),
    ],
)
def test_out_of_range_values_are_refused(override, expected):
    with pytest.raises(GraftError, match=expected):
        load_config(None, [override])


def test_bad_override_syntax_and_files(tmp_path):
    with pytest.raises(GraftError, match="expected KEY=VALUE"):
        apply_overrides({}, ["solve.gamma"])
    with pytest.raises(GraftError, match="config key 'solve' must be a table"):
        config_from_dict({"solve": 3})
    with pytest.raises(GraftError, match="config file not found"):
        load_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[solve\n")
    with pytest.raises(GraftError, match=r"bad\.toml: invalid TOML"):
        load_config(bad)


def test_resolved_config_round_trips_through_toml(tmp_path):
    config = load_config(
        None, ["solve.gamma=0.5", "env.options={ split = 'dev', k = 3 }", "run.name='a \"b\"'"]
    )
    path = tmp_path / "resolved.toml"
    path.write_text(config.to_toml())
    again = load_config(path)
    assert again == config
    assert again.env.options == {"split": "dev", "k": 3}


def test_every_section_has_defaults_for_every_field():
    for section in dataclasses.fields(Config):
        sub = getattr(Config(), section.name)
        for f in dataclasses.fields(sub):
            assert f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING, (
                f"{section.name}.{f.name} has no default"
            )
