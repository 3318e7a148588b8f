"""Your own graft environment: walk along a corridor to the exit room (docs/environments.md).

Use it with ``PYTHONPATH=examples graft loop --config configs/quickstart.toml --set
env.name=corridor_env:Corridor --set env.options={length=4}``.
"""

import random

from schemas.errors import GraftError
from stages.envs.base import Observation, Task, Transition


class CorridorGame:
    """One episode: the agent starts in room 0 and wins on reaching room ``goal``."""

    def __init__(self, length: int) -> None:
        self.length, self.pos, self.goal = length, 0, 0

    def _observe(self, text: str) -> Observation:
        task = f"go to room {self.goal} of the corridor"
        return Observation(text, ["go east", "go west"], state_key=f"room {self.pos}", task_text=task)

    def reset(self, task: Task) -> Observation:
        self.pos, self.goal = 0, task.spec["goal"]
        return self._observe(f"you are in room 0. the exit is somewhere east, rooms 1 to {self.length}.")

    def step(self, action: str) -> Transition:
        self.pos = min(self.length, max(0, self.pos + (1 if action == "go east" else -1)))
        won = self.pos == self.goal
        text = "you found the exit!" if won else f"you are in room {self.pos}. no exit here."
        return Transition(
            self._observe(text), reward=0.0, terminated=won, won=won, score=float(won), outcome=10.0 * won
        )

    def expert_action(self) -> str | None:  # used to build the tiny model's vocabulary
        return "go east" if self.pos < self.goal else "go west"


class Corridor:
    """The environment: deterministic task sets and one game per episode."""

    name, prompt_style, success_outcome = "corridor", "alfworld", 10.0

    def __init__(self, max_turns: int = 10, invalid_penalty: float = -0.1, data: str = "", length: int = 4):
        if not isinstance(length, int) or length < 1:
            raise GraftError(f"environment 'corridor': option 'length' = {length!r} must be an int >= 1")
        self.max_turns, self.invalid_penalty, self.length = max_turns, invalid_penalty, length

    def tasks(self, split: str, count: int, seed: int) -> list[Task]:
        rng = random.Random(f"{split}/{seed}")  # same arguments, same tasks
        goals = [rng.randint(1, self.length) for _ in range(count)]
        return [Task(f"corridor-{split}-{i}", f"goal_{g}", {"goal": g}) for i, g in enumerate(goals)]

    def new_game(self) -> CorridorGame:
        return CorridorGame(self.length)

    def failure_outcome(self, score: float) -> float:
        return 0.0
