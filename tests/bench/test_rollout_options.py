"""bench.speed.rollout_options: what each compared value sets (the bench itself needs vLLM and minutes)."""

from __future__ import annotations

import pytest

from bench.speed.rollout_options import engine_settings
from schemas.config import load_config
from schemas.errors import GraftError


def test_a_value_sets_one_option_or_names_several() -> None:
    assert engine_settings("block_size", "32") == ["rollout.engine_options.block_size=32"]
    both = engine_settings(None, "cpu_cores=all, block_size=64")
    config = load_config(None, ["rollout.engine=vllm", *both])
    assert config.rollout.engine_options == {"cpu_cores": "all", "block_size": 64}
    with pytest.raises(GraftError, match="block_size' = 48 is invalid"):
        load_config(None, ["rollout.engine=vllm", *engine_settings(None, "block_size=48")])
