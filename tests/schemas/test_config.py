"""schemas/config.py: typed TOML configs, unknown keys, --set overrides, defaults."""

from __future__ import annotations

import dataclasses
import re
import tomllib
import typing

import pytest
from hypothesis import given
from hypothesis import strategies as st

from schemas.config import RANGES, Config, SolveConfig, apply_overrides, config_from_dict, load_config
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
        ("solve.gamma=0", r"'solve.gamma' = 0.0 is invalid; must be in \(0, 1\]"),
        ("solve.gamma=1.5", "'solve.gamma' = 1.5 is invalid; must be in"),
        ("advantage.lam=-0.1", "'advantage.lam' = -0.1 is invalid; must be in"),
        ("graph.tau=0", "'graph.tau' = 0.0 is invalid; must be in"),
        ("rollout.group_size=0", "'rollout.group_size' = 0 is invalid; must be >= 1"),
        ("run.seed=-1", "'run.seed' = -1 is invalid; must be in"),
        ("update.lr=-1e-5", "'update.lr' = -1e-05 is invalid; must be >= 0"),
        ("update.epochs=0", "'update.epochs' = 0 is invalid; must be >= 1"),
        ("update.minibatch_size=0", "'update.minibatch_size' = 0 is invalid; must be >= 1"),
        ("update.beta=-0.01", "'update.beta' = -0.01 is invalid; must be >= 0"),
        ("rollout.temperature=-1", "'rollout.temperature' = -1.0 is invalid; must be 0"),
        ("eval.temperature=-0.5", "'eval.temperature' = -0.5 is invalid; must be 0"),
        ("advantage.gigpo_gamma=1.01", "'advantage.gigpo_gamma' = 1.01 is invalid; must be in"),
        ("advantage.graphgpo_w=0", "'advantage.graphgpo_w' = 0.0 is invalid; must be in"),
        ("rollout.max_prompt_tokens=0", "'rollout.max_prompt_tokens' = 0 is invalid; must be >= 1"),
        ("rollout.history=-2", "'rollout.history' = -2 is invalid; must be >= -1"),
        ("update.clip_low=1.5", "'update.clip_low' = 1.5 is invalid; must be in"),
        ("run.torch_threads=0", "'run.torch_threads' = 0 is invalid; must be >= 1"),
        ("run.device='tpu'", r"'run.device' = 'tpu' is invalid; expected 'cpu' \| 'cuda' \| 'auto'"),
        (
            'run.name="a\\u001b[31mb"',
            r"'run.name' = 'a\\x1b\[31mb' is invalid; must be a non-empty directory",
        ),
        ('run.name="a\\nb"', r"'run.name' = 'a\\nb' is invalid"),
        ('run.name="../escape"', "'run.name' = '../escape' is invalid"),
        ('run.name=""', "'run.name' = '' is invalid"),
    ],
)
def test_out_of_range_values_are_refused(override, expected):
    with pytest.raises(GraftError, match=expected):
        load_config(None, [override])


@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "+inf"])
@pytest.mark.parametrize(
    "key",
    [
        "update.lr",
        "rollout.temperature",
        "env.invalid_penalty",
        "update.beta",
        "solve.eps",
        "update.grad_clip",
    ],
)
def test_non_finite_numbers_are_refused(key, value):
    with pytest.raises(GraftError, match=f"'{re.escape(key)}' = .* is invalid; numbers must be finite"):
        load_config(None, [f"{key}={value}"])


def test_non_finite_numbers_inside_option_tables_are_refused():
    with pytest.raises(GraftError, match=r"'rollout.engine_options.gpu_memory_utilization' = inf"):
        load_config(None, ["rollout.engine_options={ gpu_memory_utilization = inf }"])
    with pytest.raises(GraftError, match=r"'env.options.weights\[1\]' = nan"):
        load_config(None, ["env.options={ weights = [1.0, nan] }"])


def _numeric_keys(cls: type = Config, prefix: str = "") -> list[str]:
    """Every int/float key, nested tables (``update.lora.r``) included."""
    hints = typing.get_type_hints(cls)
    keys = []
    for item in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[item.name]):
            keys += _numeric_keys(hints[item.name], f"{prefix}{item.name}.")
        elif hints[item.name] in (int, float):
            keys.append(f"{prefix}{item.name}")
    return keys


def test_every_number_has_a_range_rule():
    """A new int/float key must say its range in RANGES (the one place settings are checked)."""
    missing = [key for key in _numeric_keys() if key not in RANGES]
    assert not missing, missing
    text_rules = {"run.name", "update.lora.target_modules", "sft.lora.target_modules", "advantage.estimator"}
    assert not set(RANGES) - set(_numeric_keys()) - text_rules


def _setting(tree: object, key: str) -> object:
    for part in key.split("."):
        tree = tree[part] if isinstance(tree, dict) else getattr(tree, part)
    return tree


@given(key=st.sampled_from(sorted(RANGES)), value=st.floats(allow_nan=False, allow_infinity=False))
def test_range_rules_accept_exactly_what_they_describe(key, value):
    """Property: a value the rule accepts loads; one it refuses raises a GraftError naming the key."""
    if key in (
        "run.name",
        "model.tiny_hidden",
        "model.tiny_heads",
        "update.lora.target_modules",
        "sft.lora.target_modules",
    ):
        return  # text rules; the latter two numbers have a cross-key rule too
    ok, _ = RANGES[key]
    default = _setting(dataclasses.asdict(Config()), key)
    number = int(value) if isinstance(default, int) and abs(value) < 2**62 else value
    if isinstance(default, int) and not isinstance(number, int):
        return
    literal = repr(number)
    if ok(number):
        assert _setting(load_config(None, [f"{key}={literal}"]), key) == number
    else:
        with pytest.raises(GraftError, match=f"'{re.escape(key)}' = "):
            load_config(None, [f"{key}={literal}"])


def test_a_config_file_that_is_not_utf8_is_one_error(tmp_path):
    path = tmp_path / "latin1.toml"
    path.write_bytes('[run]\nname = "caf\xe9"\n'.encode("latin-1"))
    with pytest.raises(GraftError, match=r"latin1.toml: not UTF-8 text \(byte 17\)"):
        load_config(path)


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


@given(text=st.text(max_size=30))
def test_any_string_setting_round_trips_through_the_saved_toml(text):
    """config.toml stays parseable whatever a string holds (control characters are escaped)."""
    config = Config()
    config.env.data = text
    config.model.path = text
    config.env.options = {"note": text}
    assert config_from_dict(tomllib.loads(config.to_toml())) == config


def test_the_config_writer_quotes_keys_that_are_not_bare() -> None:
    # a dotted key in an options table came back as a nested table and the saved run
    # refused to resume
    import tomllib

    from schemas.config import Config, config_from_dict

    config = Config()
    config.env.options = {"a.b": 1, "x y": "z", 'q"uote': 2.5, "plain_key-1": True}
    text = config.to_toml()
    assert config_from_dict(tomllib.loads(text)).env.options == config.env.options
    assert config_from_dict(tomllib.loads(text)) == config


def test_lora_table_is_validated_where_it_is_defined(tmp_path):
    """``[update] lora = {...}``: nested keys are checked like the others, and the table round-trips."""
    config = load_config(None, ["update.lora={ r = 8, alpha = 16.0, target_modules = ['q_proj', 'v_proj'] }"])
    assert (config.update.lora.r, config.update.lora.target_modules) == (8, ["q_proj", "v_proj"])
    path = tmp_path / "resolved.toml"
    path.write_text(config.to_toml())
    assert load_config(path) == config
    with pytest.raises(GraftError, match=r"'update.lora.r' = -1 is invalid; must be in \[0, 65536\]"):
        load_config(None, ["update.lora.r=-1"])
    with pytest.raises(GraftError, match=r"'update.lora.dropout' = 1.0 is invalid; must be in \[0, 1\)"):
        load_config(None, ["update.lora.dropout=1.0"])
    with pytest.raises(
        GraftError, match=r"'update.lora.target_modules' = \[1\] is invalid; expected a list of str"
    ):
        load_config(None, ["update.lora.target_modules=[1]"])
    with pytest.raises(
        GraftError, match=r"'update.lora.target_modules' = \['q proj'\] is invalid; must be module"
    ):
        load_config(None, ["update.lora.target_modules=['q proj']"])
    with pytest.raises(
        GraftError, match=r"unknown config key 'update.lora.rank'; valid keys in \[update.lora\]"
    ):
        load_config(None, ["update.lora.rank=4"])
    with pytest.raises(GraftError, match=r"'update.lora.alpha' = inf is invalid; numbers must be finite"):
        load_config(None, ["update.lora.alpha=inf"])


@pytest.mark.parametrize(
    ("engine", "item", "message"),
    [
        (
            "vllm",
            "gpu_memory_util=0.5",
            r"'rollout.engine_options.gpu_memory_util' is not an option of "
            r"rollout.engine = 'vllm' \(valid: block_size, choose_prefix_cache, cpu_cores, dtype, enforce_eager, gpu_memory_utilization, "
            r"kv_cache_gib, lora, max_model_len, reload, tensor_parallel_size\)",
        ),
        (
            "vllm",
            "reload='reload_weights'",
            r"'rollout.engine_options.reload' = 'reload_weights' is invalid; "
            r"must be one of 'in_place', 'fresh'",
        ),
        ("vllm", "gpu_memory_utilization=1.5", r"must be in \(0, 1\]"),
        ("vllm", "kv_cache_gib=inf", r"numbers must be finite"),
        ("vllm", "tensor_parallel_size=true", r"expected int"),
        ("vllm", "enforce_eager=1", r"expected bool"),
        (
            "vllm",
            "choose_prefix_cache='yes'",
            r"'rollout.engine_options.choose_prefix_cache' = 'yes' is invalid; expected bool",
        ),
        ("vllm", "dtype='fp8'", r"must be one of 'float32', 'bfloat16', 'float16'"),
        (
            "vllm",
            "cpu_cores='half'",
            r"'rollout.engine_options.cpu_cores' = 'half' is invalid; must be one of 'auto', 'all'",
        ),
        ("vllm", "cpu_cores=2", r"'rollout.engine_options.cpu_cores' = 2 is invalid; expected str"),
        (
            "vllm",
            "block_size=24",
            r"'rollout.engine_options.block_size' = 24 is invalid; must be a multiple of 16",
        ),
        ("vllm", "block_size=0", r"must be a multiple of 16"),
        (
            "vllm",
            "block_size=16",
            r"block_size' = 16 is invalid; vLLM's CPU attention needs a multiple of 32",
        ),
        (
            "hf",
            "reload='fresh'",
            r"not an option of rollout.engine = 'hf' \(valid: logit_budget, token_budget\)",
        ),
        ("hf", "token_budget=0", r"must be >= 1"),
    ],
)
def test_engine_options_are_checked_for_the_chosen_engine(engine, item, message):
    with pytest.raises(GraftError, match=message):
        load_config(None, [f"rollout.engine={engine}", f"rollout.engine_options.{item}"])


def test_a_block_size_of_16_is_only_for_a_gpu():
    gpu = load_config(
        None, ["run.device=cuda", "rollout.engine=vllm", "rollout.engine_options.block_size=16"]
    )
    assert gpu.rollout.engine_options["block_size"] == 16
    cpu = load_config(None, ["rollout.engine=vllm", "rollout.engine_options.block_size=32"])
    assert cpu.rollout.engine_options["block_size"] == 32


def test_valid_engine_options_load():
    config = load_config(
        None,
        [
            "rollout.engine=vllm",
            "rollout.engine_options.kv_cache_gib=2",
            "rollout.engine_options.reload='fresh'",
        ],
    )
    assert config.rollout.engine_options == {"kv_cache_gib": 2, "reload": "fresh"}


def test_every_setting_has_a_tier_and_its_values_are_tiered():
    from schemas.config import TIERS, setting_tiers

    def leaves(tree: dict, prefix: str = "") -> set[str]:
        keys: set[str] = set()
        for name, value in tree.items():
            is_table = isinstance(value, dict) and name not in ("options", "engine_options", "env_options")
            keys |= leaves(value, f"{prefix}{name}.") if is_table else {f"{prefix}{name}"}
        return keys

    rows = setting_tiers()
    assert {key for key, *_ in rows} == leaves(Config().to_dict())
    for key, _, tier, others in rows:
        assert tier in TIERS, key
        if isinstance(others, dict):
            assert set(others.values()) <= set(TIERS), key
        elif others is not None:
            assert others in TIERS, key


def test_the_tier_of_a_value():
    from schemas.config import tier_of

    assert tier_of("advantage.gae_horizon", "literal") == "paper"
    assert tier_of("advantage.gae_horizon", "markov") == "experimental"
    assert tier_of("solve.step_rewards", "values") == "legacy"
    assert tier_of("advantage.node_std_floor", 0.0) == "paper"
    assert tier_of("advantage.node_std_floor", 0.1) == "experimental"
    assert tier_of("rollout.mode", "choose") == "default" and tier_of("rollout.mode", "generate") == "paper"
    assert tier_of("rollout.temperature", 0.7) == "paper"  # a tuned value of a paper setting
    assert tier_of("update.clip_high", 0.2) == "default"
    assert tier_of("update.clip_high", 0.28) == "experimental"  # an asymmetric clip (DAPO's clip-higher)
    with pytest.raises(KeyError):
        tier_of("advantage.nope", 1)


def test_docs_list_every_experimental_and_legacy_value():
    """docs/options.md names each experimental or legacy value with the measurement behind it."""
    from pathlib import Path

    from schemas.config import EXPERIMENTAL, LEGACY, setting_tiers

    text = (Path(__file__).resolve().parents[2] / "docs" / "options.md").read_text()
    listed = []
    for key, _, _, others in setting_tiers():
        if isinstance(others, dict):
            listed += [(key, value) for value, tier in others.items() if tier in (EXPERIMENTAL, LEGACY)]
        elif others in (EXPERIMENTAL, LEGACY):
            listed.append((key, None))
    assert len(listed) == 15

    def toml(value: object) -> str:
        return ("true" if value else "false") if isinstance(value, bool) else f'"{value}"'

    for key, value in listed:
        shown = f"`{key} " if value is None else f"`{key} = {toml(value)}`"
        assert shown in text, shown
