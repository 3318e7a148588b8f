"""The tiny policy: a small random-init Qwen2-style causal LM plus a byte-level BPE tokenizer (one
token per word it saw) trained on an environment's texts (docs/design.md §6), saved as a Hugging Face directory
without any download.

The tokenizer is trained on texts the environment actually produces: observations, task texts and
admissible actions seen while playing the scripted expert and a uniformly random admissible policy
on ``tasks_per_split`` tasks (config ``model.tiny_vocab_tasks``; by default the environment's
``vocab_tasks``, else 8) of each of the ``train`` and ``eval`` splits, plus the prompt template rendered on those states (so every template word is one
token; ``tokenizer.vocabulary_misses`` lists the words of other texts that are not). Vocabulary collection uses fixed seeds: the
tokenizer depends only on the environment and its options, the weights only on ``seed``.

Determinism: the same arguments give byte-identical ``model.safetensors`` (weights are drawn from a
private torch generator state seeded with ``seed``; the global RNG is left untouched).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
from transformers.utils import logging as hf_logging

from schemas.atomic import filled_dir
from schemas.config import DEFAULT_TINY_VOCAB_TASKS, TINY_MAX_HEADS, TINY_MAX_HIDDEN, TINY_MAX_LAYERS
from schemas.errors import GraftError
from stages.envs.base import Environment, Episode, environment_tasks
from stages.envs.prompts import episode_prompt
from stages.observe.progress import terminal_progress
from stages.policy.tokenizer import build_word_tokenizer, portable_tokenizer_files

PromptFn = Callable[..., str]  # build_prompt(style, *, task_text, observation, admissible, history, ...)

VOCAB_SEED = 0  # task seed for vocabulary collection (independent of the model seed)
DEFAULT_VOCAB_TASKS = DEFAULT_TINY_VOCAB_TASKS  # tasks per split (config model.tiny_vocab_tasks)
TaskHook = Callable[[int, int], None]  # (tasks played, tasks to play)
PROMPTED_TURNS = (0, 1, 3)  # turns of each collected episode whose rendered prompt joins the corpus


@dataclass(frozen=True)
class TinySpec:
    """Shape of the tiny model."""

    hidden: int = 64
    layers: int = 2
    heads: int = 2  # head size hidden / heads = 32, the smallest vLLM's CPU attention supports
    intermediate: int = 0  # 0 = 4 x hidden
    max_positions: int = 4096

    def check(self) -> None:
        if self.hidden < 8 or self.layers < 1 or self.heads < 1:
            raise GraftError(
                f"tiny model: hidden {self.hidden}, layers {self.layers}, heads {self.heads} too small"
            )
        if self.hidden > TINY_MAX_HIDDEN or self.layers > TINY_MAX_LAYERS or self.heads > TINY_MAX_HEADS:
            raise GraftError(
                f"tiny model: hidden {self.hidden}, layers {self.layers}, heads {self.heads} too large "
                f"(at most hidden {TINY_MAX_HIDDEN}, layers {TINY_MAX_LAYERS}, heads {TINY_MAX_HEADS}: "
                "a larger model is a model.path)"
            )
        if self.hidden % self.heads or (self.hidden // self.heads) % 2:
            raise GraftError(
                f"tiny model: hidden {self.hidden} must be divisible by heads {self.heads} into an even head size"
            )


def default_prompt_fn() -> PromptFn:
    """The paper's prompt templates (stages/envs/prompts.py)."""
    from stages.envs.prompts import build_prompt

    return build_prompt


def environment_texts(
    env: Environment,
    *,
    tasks_per_split: int = DEFAULT_VOCAB_TASKS,
    history_length: int = 2,
    prompt_fn: PromptFn | None = None,
    seed: int = VOCAB_SEED,
    on_task: TaskHook | None = None,
) -> Iterator[str]:
    """Yield the texts ``env`` shows an agent: observations, task texts, admissible actions, and prompts.

    Per task two episodes are played: the scripted expert (falling back to a random admissible
    action when it has none) and a uniformly random admissible policy. ``seed`` picks the task sets
    (``VOCAB_SEED`` for the tokenizer; another seed gives held-out tasks to check it against);
    ``on_task(done, total)`` is called after each of the 2 x ``tasks_per_split`` tasks. An environment
    with a ``vocabulary_texts()`` method contributes those texts first.
    """
    prompt_fn = prompt_fn or default_prompt_fn()
    rng = random.Random(seed)
    seen: set[str] = set()
    # words an environment can show beyond what a few tasks do (textworld: its text grammars)
    yield from getattr(env, "vocabulary_texts", list)()
    total = 2 * tasks_per_split
    done = 0
    for split in ("train", "eval"):
        for task in environment_tasks(env, split, tasks_per_split, seed):
            done += 1
            if on_task is not None:
                on_task(done, total)
            # Small task pools repeat tasks to fill the count; replaying one adds no words but
            # costs seconds per reset on engine-backed worlds (ALFWorld).
            if task.task_id in seen:
                continue
            seen.add(task.task_id)
            for expert in (True, False):
                try:
                    episode = Episode(env, task)
                except Exception:  # a broken task teaches us no words; rollouts report such errors
                    continue
                yield episode.current.task_text
                while not episode.done:
                    obs = episode.current
                    yield obs.text
                    yield from obs.admissible
                    if episode.turn in PROMPTED_TURNS:
                        yield episode_prompt(env.prompt_style, episode, history_length, prompt_fn)
                    action = episode.game.expert_action() if expert else None
                    if action is None:
                        if not obs.admissible:
                            break
                        action = rng.choice(obs.admissible)
                    episode.act(action)


def vocab_tasks_for(env: Environment, requested: int = 0) -> int:
    """Tasks per split played for the vocabulary: ``requested``, or when 0 the environment's own
    ``vocab_tasks`` (household: 150), else ``DEFAULT_VOCAB_TASKS``."""
    if requested < 0:
        raise GraftError(f"tiny model: tasks per split for the vocabulary must be >= 0, got {requested}")
    return requested if requested > 0 else int(getattr(env, "vocab_tasks", DEFAULT_VOCAB_TASKS))


def vocabulary_progress(label: str) -> tuple[TaskHook, Callable[[], None]]:
    """(hook, closer): a progress bar with ETA on a terminal, else nothing (``stages.observe.progress``)."""
    update, close = terminal_progress(label, None)
    return (lambda done, total: update(done, total=total)), close


def build_tiny_model(
    out: str | Path,
    env: Environment,
    *,
    seed: int = 0,
    spec: TinySpec = TinySpec(),
    tasks_per_split: int = 0,
    prompt_fn: PromptFn | None = None,
    info: dict[str, Any] | None = None,
    on_task: TaskHook | None = None,
    also: Sequence[Environment] = (),
) -> Path:
    """Build the tiny model for ``env`` into directory ``out`` (atomically: complete or absent).

    ``tasks_per_split``: see ``vocab_tasks_for`` (0 = the environment's default). ``on_task``
    follows the vocabulary collection (default: a progress bar on a terminal). ``also``: further
    environments whose texts join the vocabulary (the warm start's rooms, ``sft.env_options``).
    """
    spec.check()
    tasks_per_split = vocab_tasks_for(env, tasks_per_split)
    out = Path(out)
    close: Callable[[], None] = lambda: None  # noqa: E731
    if on_task is None:
        name = getattr(env, "name", "environment")
        on_task, close = vocabulary_progress(f"tiny model: playing {name} tasks for the vocabulary")
    try:
        texts = list(
            dict.fromkeys(
                text
                for source in (env, *also)
                for text in environment_texts(
                    source, tasks_per_split=tasks_per_split, prompt_fn=prompt_fn, on_task=on_task
                )
            )
        )
    finally:
        close()
    if not texts:
        raise GraftError(
            f"environment '{getattr(env, 'name', env)}' produced no text to build a tokenizer from"
        )
    tokenizer = build_word_tokenizer(texts)
    model = random_qwen2(tokenizer, spec=spec, seed=seed, info=info)
    hf_logging.disable_progress_bar()
    with filled_dir(out) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        portable_tokenizer_files(tmp)
    return out


def random_qwen2(
    tokenizer: PreTrainedTokenizerFast,
    *,
    spec: TinySpec = TinySpec(),
    seed: int = 0,
    info: dict[str, Any] | None = None,
) -> Qwen2ForCausalLM:
    """A random-init Qwen2ForCausalLM sized for ``tokenizer``; weights depend only on ``seed`` and shape."""
    eos = tokenizer.eos_token_id
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate or 4 * spec.hidden,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.heads,
        max_position_embeddings=spec.max_positions,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=eos,
        pad_token_id=tokenizer.pad_token_id,
        # Read by the rollout: tiny prompts are the raw template text, not a chat conversation.
        graft_prompt_format="raw",
        graft_tiny={"seed": seed, **(info or {})},
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = eos
    return model.eval()
