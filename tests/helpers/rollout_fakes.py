"""Test doubles for the rollout tests: a tiny corridor environment, a prompt function, a scripted engine.

The corridor: rooms 0..R-1; the agent starts in room 0 and wins (outcome 10) by going to the goal
room and taking the key there. ``fail_action`` makes the game raise on that action (docs/design.md §11 tests).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from stages.envs.base import Observation, Task, Transition
from stages.policy.engine import Generation


class CorridorGame:
    def __init__(self, fail_action: str | None) -> None:
        self.fail_action = fail_action

    def reset(self, task: Task) -> Observation:
        self.rooms = task.spec["rooms"]
        self.goal = task.spec["goal"]
        self.loc = 0
        self.holding = False
        self.task_text = f"take the key in room {self.goal}."
        return self._obs(f"You are in room 0 of a corridor with {self.rooms} rooms.")

    def admissible(self) -> list[str]:
        acts = [f"go to room {k}" for k in range(self.rooms) if k != self.loc] + ["look"]
        if self.loc == self.goal and not self.holding:
            acts.append(f"take key from room {self.loc}")
        return acts

    def _obs(self, text: str) -> Observation:
        key = f"loc={self.loc};key={self.holding}"
        return Observation(text=text, admissible=self.admissible(), state_key=key, task_text=self.task_text)

    def step(self, action: str) -> Transition:
        if action == self.fail_action:
            raise RuntimeError("corridor engine crashed")
        if action.startswith("go to room "):
            self.loc = int(action.rsplit(" ", 1)[1])
            text = f"You arrive at room {self.loc}. You see a {'key' if self.loc == self.goal else 'wall'}."
        elif action.startswith("take key"):
            self.holding = True
            obs = self._obs("You take the key.")
            return Transition(observation=obs, reward=0.0, terminated=True, won=True, score=1.0, outcome=10.0)
        else:
            text = f"You are in room {self.loc}."
        return Transition(observation=self._obs(text), reward=0.0, terminated=False, won=False)

    def expert_action(self) -> str | None:
        if self.loc != self.goal:
            return f"go to room {self.goal}"
        return None if self.holding else f"take key from room {self.loc}"


@dataclass
class CorridorEnv:
    max_turns: int = 6
    invalid_penalty: float = -0.1
    rooms: int = 4
    fail_action: str | None = None
    name: str = "corridor"
    prompt_style: str = "alfworld"
    success_outcome: float = 10.0

    def tasks(self, split: str, count: int, seed: int) -> list[Task]:
        rng = random.Random(f"{split}-{seed}")
        return [
            Task(
                f"{split}-{i}",
                ("near", "far")[i % 2],
                {"rooms": self.rooms, "goal": rng.randrange(1, self.rooms)},
            )
            for i in range(count)
        ]

    def new_game(self) -> CorridorGame:
        return CorridorGame(self.fail_action)

    def failure_outcome(self, score: float) -> float:
        return 0.0


def corridor_prompt(
    style: str,
    *,
    task_text: str,
    observation: str,
    admissible: list[str],
    history: list[tuple[str, str]],
    step_count: int,
    history_length: int,
) -> str:
    """A small stand-in for the paper's template (same signature as stages.envs.prompts.build_prompt)."""
    recent = (
        history if history_length < 0 else history[len(history) - history_length :] if history_length else []
    )
    past = "\n".join(f"[Observation: {o} Action: {a}]" for o, a in recent)
    acts = "\n".join(f"'{a}'" for a in admissible)
    return (
        f"Your task is to: {task_text}\nYou have taken {step_count} step(s). {past}\n"
        f"Current observation: {observation}\nAdmissible actions:\n{acts}\n"
        "Reason inside <think> </think> and answer inside <action> </action>.\n"
    )


class ScriptedEngine:
    """A policy engine whose generations are scripted texts (cycled per call), for generate-mode tests."""

    name = "scripted"
    prompt_format = "raw"

    def __init__(self, tokenizer, texts: Sequence[str], version: str = "scripted") -> None:
        self.tokenizer = tokenizer
        self.texts = list(texts)
        self.calls = 0
        self.policy_version = version
        self.prompts: list[list[int]] = []
        self.seeds: list[int] = []  # the per-row seed each prompt came with

    def load(self, model_dir: Path, version: str) -> None:
        self.policy_version = version

    def score_choices(self, prompts_ids, choices_ids):  # pragma: no cover - not used in generate tests
        return [[np.full(len(c), -1.0, np.float32) for c in cs] for cs in choices_ids]

    def generate(self, prompts_ids, *, temperature, max_new_tokens, stop=(), seeds):
        assert len(seeds) == len(prompts_ids), "one seed per prompt"
        out = []
        for prompt, seed in zip(prompts_ids, seeds, strict=True):
            self.prompts.append(list(prompt))
            self.seeds.append(int(seed))
            text = self.texts[self.calls % len(self.texts)]
            self.calls += 1
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            out.append(Generation(ids, [-0.5] * len(ids), text, "stop"))
        return out

    def close(self) -> None:
        pass


def make_corridor(
    max_turns: int = 6, invalid_penalty: float = -0.1, data: str = "", **options
) -> CorridorEnv:
    """Registry factory (tests register it as environment 'corridor')."""
    return CorridorEnv(max_turns=max_turns, invalid_penalty=invalid_penalty, **options)
