"""Playing an environment's built-in expert through a game (shared by the environment tests)."""

from __future__ import annotations

from typing import Any


def play_expert(env: Any, task: Any, limit: int) -> tuple[Any, Any]:
    """Reset a new game on ``task`` and follow ``expert_action`` for at most ``limit`` steps, checking
    each action is admissible. Returns (game, the final transition), or (game, None) when the episode
    did not end (the expert gave up or the limit was reached)."""
    game = env.new_game()
    obs = game.reset(task)
    for _ in range(limit):
        action = game.expert_action()
        if action is None:
            break
        assert action in obs.admissible
        result = game.step(action)
        obs = result.observation
        if result.terminated:
            return game, result
    return game, None
