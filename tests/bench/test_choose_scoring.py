"""bench.speed.choose_scoring: the engines it compares are valid configs, the turns it replays are the
recorded ones (the bench itself needs vLLM and minutes)."""

from __future__ import annotations

import numpy as np
import polars as pl

from bench.speed.choose_scoring import ENGINES, largest_gap, recorded_turns
from schemas.config import load_config
from stages.policy.tiny import TinySpec, build_tiny_model
from tests.helpers.rollout_fakes import CorridorEnv, corridor_prompt


def test_each_compared_engine_is_a_valid_config() -> None:
    configs = {name: load_config(None, ["rollout.mode=choose", *items]) for name, items in ENGINES.items()}
    assert configs["hf"].rollout.engine == "hf" and configs["hf"].rollout.engine_options == {}
    assert configs["vllm"].rollout.engine_options == {"choose_prefix_cache": True}
    assert configs["vllm-no-cache"].rollout.engine_options == {"choose_prefix_cache": False}


def test_turns_are_replayed_by_turn_index_from_the_first_groups(tmp_path) -> None:
    model = build_tiny_model(
        tmp_path / "m",
        CorridorEnv(),
        seed=0,
        spec=TinySpec(hidden=32, layers=1, heads=2),
        prompt_fn=corridor_prompt,
    )
    steps = pl.DataFrame(
        {
            "group_id": ["g1", "g0", "g0", "g0", "g1"],
            "traj_id": ["g1-r0", "g0-r1", "g0-r0", "g0-r0", "g1-r0"],
            "step": [0, 0, 0, 1, 1],
            "prompt_ids": [[9], [2, 3], [1], [4, 5, 6], [7]],
            "choices": [["x"], ["left", "right"], ["left"], ["right"], ["y"]],
        }
    )
    turns = recorded_turns(steps, model, groups=1)
    assert [prompts for prompts, _ in turns] == [[[1], [2, 3]], [[4, 5, 6]]]  # g0 only, by trajectory
    assert [len(c) for c in turns[0][1]] == [1, 2] and len(turns[1][1][0]) == 1
    assert all(ids for _, choices in turns for per_prompt in choices for ids in per_prompt)


def test_the_gap_is_the_largest_over_every_token() -> None:
    a = [[[np.array([-1.0, -2.0])], [np.array([-0.5])]]]
    b = [[[np.array([-1.0, -2.25])], [np.array([-0.375])]]]
    assert largest_gap(a, b) == 0.25 and largest_gap(a, a) == 0.0
