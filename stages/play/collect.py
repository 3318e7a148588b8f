"""Lockstep episode collection: ``collect_episodes`` plays groups of episodes with a policy engine and
returns their steps rows (see the package docstring for the modes, naming and random streams)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import polars as pl

from schemas.errors import GraftError
from stages.envs.base import Environment, Episode, StepRecord, Task
from stages.envs.prompts import episode_prompt
from stages.observe.progress import terminal_progress
from stages.play.settings import PlaySettings
from stages.policy.engine import STOP_STRINGS, PolicyEngine
from stages.policy.sampling import choice_log_probs, derive_rng, derive_seed, sample_index

CHOOSE_PREFIX = "<action>"  # choose-mode model input ends with the action tag; the action follows it

ProgressHook = Callable[[int, int, int], None]  # (turn, finished episodes, total episodes)


@dataclass
class _Slot:
    """One episode in flight."""

    group: int  # group index within the iteration
    rollout: int
    task: Task
    episode: Episode
    rng: np.random.Generator
    rows: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class _Turn:
    """What the policy produced for one episode this turn."""

    prompt: str
    prompt_ids: list[int]
    response: str
    response_ids: list[int]
    response_logprobs: list[float]
    action: str | None
    choices: list[str] | None
    well_formed: bool = True  # the parsing rule's format check (stages.envs.parser.ParsedTurn)
    choice_scores: list[float] | None = None  # choose mode: m_j of each choice (the update's pi_old)


def _default_prompt_fn() -> Callable[..., str]:
    from stages.envs.prompts import build_prompt

    return build_prompt


def _progress_hook(progress: bool | ProgressHook | None, total: int, label: str):
    """(hook, closer): a user hook, a bar on a terminal (None or True), or nothing (False)."""
    if callable(progress):
        return progress, lambda: None
    if progress is False:
        return (lambda turn, done, total: None), lambda: None
    update, close = terminal_progress(label, total)
    return (lambda turn, done, total: update(done, f"turn {turn}")), close


def model_inputs(
    tokenizer: Any, chat: bool, prompts: Sequence[str], max_prompt_tokens: int, suffix: str = ""
) -> tuple[list[str], list[list[int]], int]:
    """The model input of each rendered prompt: (texts, token ids, how many were cut).

    A chat model gets its chat template around the prompt (the template writes its own special
    tokens); a raw prompt is tokenized as is. ``suffix`` follows the prompt (choose mode's action
    tag). A prompt longer than ``max_prompt_tokens`` keeps its end: the current state and the
    instructions. The rollout and the warm start (``stages.warmstart.sft``) both build inputs here, so the
    policy is trained on exactly what it later reads.
    """
    texts = []
    for text in prompts:
        if chat:
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
            )
        texts.append(text + suffix)
    ids = [list(x) for x in tokenizer(texts, add_special_tokens=not chat)["input_ids"]]
    truncated = 0
    for i, seq in enumerate(ids):
        if len(seq) > max_prompt_tokens:
            truncated += 1
            ids[i] = seq[len(seq) - max_prompt_tokens :]
            texts[i] = tokenizer.decode(ids[i])
    return texts, ids, truncated


class _Renderer:
    """Builds the model input of a turn and tokenizes it."""

    def __init__(
        self,
        engine: PolicyEngine,
        env: Environment,
        mode: str,
        history_length: int,
        max_prompt_tokens: int,
        prompt_fn: Callable[..., str] | None,
    ) -> None:
        self.engine, self.env, self.mode = engine, env, mode
        self.history_length, self.max_prompt_tokens = history_length, max_prompt_tokens
        self.prompt_fn = prompt_fn or _default_prompt_fn()
        self.tokenizer = engine.tokenizer
        self.chat = engine.prompt_format == "chat"
        self.truncated = 0
        self._choice_ids: dict[str, list[int]] = {}

    def _render(self, slot: _Slot, history_length: int) -> str:
        return episode_prompt(self.env.prompt_style, slot.episode, history_length, self.prompt_fn)

    def prompts(self, slots: Sequence[_Slot]) -> tuple[list[str], list[list[int]]]:
        """Model inputs of the slots' current turns. A prompt over ``max_prompt_tokens`` first drops
        its oldest history pairs (the chat header, the task, the current observation and the
        admissible actions stay); only when no history is left and it is still too long is it cut from
        the left (counted in ``truncated``)."""
        suffix = CHOOSE_PREFIX if self.mode == "choose" else ""
        texts = [self._render(slot, self.history_length) for slot in slots]
        texts, ids, _ = model_inputs(self.tokenizer, self.chat, texts, 1 << 62, suffix)
        for i, slot in enumerate(slots):
            if len(ids[i]) <= self.max_prompt_tokens:
                continue
            shown = len(slot.episode.history) if self.history_length < 0 else self.history_length
            for keep in range(min(shown, len(slot.episode.history)) - 1, -1, -1):
                text, seq, _ = model_inputs(
                    self.tokenizer, self.chat, [self._render(slot, keep)], 1 << 62, suffix
                )
                texts[i], ids[i] = text[0], seq[0]
                if len(ids[i]) <= self.max_prompt_tokens:
                    break
            if len(ids[i]) > self.max_prompt_tokens:  # the last resort: keep the end
                bare = self._render(slot, 0)
                text, seq, _ = model_inputs(self.tokenizer, self.chat, [bare], self.max_prompt_tokens, suffix)
                texts[i], ids[i] = text[0], seq[0]
                self.truncated += 1
        return texts, ids

    def choice_ids(self, choices: Sequence[str]) -> list[list[int]]:
        new = [c for c in dict.fromkeys(choices) if c not in self._choice_ids]
        if new:
            for c, ids in zip(new, self.tokenizer(new, add_special_tokens=False)["input_ids"], strict=True):
                self._choice_ids[c] = list(ids)
        return [self._choice_ids[c] for c in choices]


def collect_episodes(
    engine: PolicyEngine,
    env: Environment,
    tasks: Sequence[Task],
    group_size: int,
    settings: PlaySettings,
    *,
    seed: int,
    iteration: int,
    policy_version: str,
    progress: bool | ProgressHook | None = None,
    group_ids: Sequence[int] | None = None,
    group_count: int | None = None,
    stats: dict[str, float] | None = None,
    prefixes: Sequence[Sequence[tuple[str, bool]]] | None = None,
    stream: str = "rollout",
) -> pl.DataFrame:
    """Play ``group_size`` episodes of each task in lockstep; return their steps rows (docs/design.md §3).

    ``settings`` say how (``stages.play.settings.PlaySettings``: mode, temperature, history, batching,
    token limits, the prompt function, the action-parsing rule; ``PlaySettings.from_config`` reads
    them from a config). ``group_ids[k]`` is the index of ``tasks[k]``'s group in the iteration
    (default 0..len-1; a shard passes its subset so names and random streams match the unsharded
    run); ``group_count`` fixes the digits of group names. ``settings.max_env_errors``: more
    environment exceptions than this abort with a GraftError (None = no limit).
    ``settings.batch_scope``: "all" batches every active episode of a turn, "group" only the episodes
    of one group (see ``turn_batches``). ``stats`` (optional dict) receives counters: env_errors,
    prompt_truncated, scored_tokens, policy_calls, and with an engine that counts its prefix-cache hits
    (vLLM) prompt_tokens_cached. ``settings.action_parsing``: the rule that reads
    generate-mode responses and decides which turns are invalid (``env.action_parsing``,
    ``stages.envs.parser``); choose mode picks an admissible action, valid under both rules.
    ``prefixes[k]`` (continuations, the Monte-Carlo oracle): (action, valid) pairs replayed on every
    episode of ``tasks[k]`` before the policy acts, which restores the state they reached (the
    built-in worlds are deterministic given the task and the actions); the rows returned are the
    policy's turns after the prefix only, numbered from 0. ``stream`` names the random streams
    (``"<stream>-episode"``, ``"<stream>-generate"``), so continuations never reuse the rollout's.
    """
    mode, temperature, batch_size = settings.mode, settings.temperature, settings.batch_size
    batch_scope, max_env_errors = settings.batch_scope, settings.max_env_errors
    max_new_tokens, action_parsing = settings.max_new_tokens, settings.action_parsing
    if mode not in ("choose", "generate"):
        raise GraftError(f"rollout.mode = '{mode}': expected 'choose' or 'generate'")
    if group_size < 1 or batch_size < 1:
        raise GraftError("rollout: group_size and batch_size must be >= 1")
    if batch_scope not in ("all", "group"):
        raise GraftError(f"rollout.batch_scope = '{batch_scope}': expected 'all' or 'group'")
    group_ids = list(range(len(tasks))) if group_ids is None else list(group_ids)
    if len(group_ids) != len(tasks):
        raise ValueError("one group id per task")
    if prefixes is not None and len(prefixes) != len(tasks):
        raise ValueError("one prefix per task")
    group_digits = max(2, len(str(max((group_count or 0) - 1, *group_ids, 0))))
    rollout_digits = len(str(group_size - 1))
    counters = {"env_errors": 0.0, "prompt_truncated": 0.0, "scored_tokens": 0.0, "policy_calls": 0.0}
    cached_before = getattr(engine, "cached_prompt_tokens", None)  # only engines with a prefix cache
    first_error: list[str] = []

    def env_error(message: str, task: Task) -> None:
        counters["env_errors"] += 1
        if not first_error:
            first_error.append(f"{message} (task {task.task_id})")
        if max_env_errors is not None and counters["env_errors"] > max_env_errors:
            raise GraftError(
                f"rollout aborted: {int(counters['env_errors'])} environment errors (more than "
                f"rollout.max_env_errors = {max_env_errors}); first: {first_error[0]}"
            )

    slots: list[_Slot] = []
    for k, (g, task) in enumerate(zip(group_ids, tasks, strict=True)):
        for r in range(group_size):
            try:
                episode = Episode(env, task, action_parsing)
            except Exception as exc:  # a task that cannot even reset yields no trajectory
                env_error(f"reset failed: {type(exc).__name__}: {exc}", task)
                continue
            if prefixes is not None:
                for action, valid in prefixes[k]:
                    episode.act(action or None, valid)  # "" = an unparseable turn
                if episode.done:
                    raise ValueError(f"prefix of task {task.task_id} ends its episode: nothing to continue")
            slots.append(_Slot(g, r, task, episode, derive_rng(seed, iteration, f"{stream}-episode", g, r)))

    renderer = _Renderer(
        engine, env, mode, settings.history_length, settings.max_prompt_tokens, settings.prompt_fn
    )
    style = env.prompt_style
    hook, close = _progress_hook(progress, len(slots), f"rollout i{iteration:04d}")
    turn = 0
    try:
        while active := [s for s in slots if not s.episode.done]:
            texts, prompt_ids = renderer.prompts(active)
            scopes = [s.group for s in active] if batch_scope == "group" else [0] * len(active)
            for picked in turn_batches(scopes, [len(ids) for ids in prompt_ids], batch_size):
                batch = [active[i] for i in picked]
                prompts = ([texts[i] for i in picked], [prompt_ids[i] for i in picked])
                if mode == "choose":
                    outs = _choose_turn(engine, renderer, batch, prompts, temperature, counters)
                else:
                    # one stream per (episode, step), like choose mode's per-episode stream: the
                    # sampled text depends neither on rollout.batch_size nor on --shard
                    gen_seeds = [
                        derive_seed(seed, iteration, f"{stream}-generate", s.group, s.rollout, len(s.rows))
                        for s in batch
                    ]
                    outs = _generate_turn(
                        engine, prompts, style, temperature, max_new_tokens, gen_seeds, action_parsing
                    )
                counters["policy_calls"] += 1
                for slot, out in zip(batch, outs, strict=True):
                    record = slot.episode.act(out.action, out.well_formed)
                    slot.rows.append(_row(slot, record, out))
                    if record.error is not None:
                        env_error(record.error, slot.task)
            turn += 1
            hook(turn, sum(s.episode.done for s in slots), len(slots))
    finally:
        close()
    counters["prompt_truncated"] = float(renderer.truncated)
    if cached_before is not None:
        counters["prompt_tokens_cached"] = float(engine.cached_prompt_tokens - cached_before)  # type: ignore[attr-defined]
    if stats is not None:
        stats.update(counters)
    return _steps_frame(slots, iteration, policy_version, group_digits, rollout_digits)


def turn_batches(scopes: Sequence[int], prompt_lengths: Sequence[int], batch_size: int) -> list[list[int]]:
    """The batched policy calls of one turn: lists of indices into the turn's active episodes.

    Episodes share a call only when their ``scopes`` are equal (one scope per episode: its group under
    ``batch_scope = "group"``, else all the same). Within a scope they are sorted by prompt length
    (then by position), because batches of similar length waste less on padding, and cut into calls
    of at most ``batch_size``. Sampling decisions never depend on batching (per-episode random
    streams); the float bits of log-probs do, through padding widths and batch shapes, which is why
    a scope that holds one group makes them independent of the other groups in the process."""
    order = sorted(range(len(scopes)), key=lambda i: (scopes[i], prompt_lengths[i], i))
    batches: list[list[int]] = []
    for i in order:
        if batches and len(batches[-1]) < batch_size and scopes[batches[-1][0]] == scopes[i]:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


def _choose_turn(
    engine: PolicyEngine,
    renderer: _Renderer,
    batch: Sequence[_Slot],
    prompts: tuple[list[str], list[list[int]]],
    temperature: float,
    counters: dict,
) -> list[_Turn]:
    texts, prompt_ids = prompts
    choices = [list(s.episode.current.admissible) for s in batch]
    for slot, options in zip(batch, choices, strict=True):
        if not options:
            raise GraftError(
                f"rollout.mode = 'choose' needs admissible actions, but task {slot.task.task_id} offers none "
                "(use rollout.mode = 'generate' for this environment)"
            )
    choice_ids = [renderer.choice_ids(c) for c in choices]
    # episodes in the same state (a group's first turn, paths that met) are scored once
    keys = [(tuple(pids), tuple(options)) for pids, options in zip(prompt_ids, choices, strict=True)]
    distinct = {key: i for i, key in enumerate(dict.fromkeys(keys))}
    scored_distinct = engine.score_choices(
        [list(key[0]) for key in distinct], [renderer.choice_ids(list(key[1])) for key in distinct]
    )
    scored = [scored_distinct[distinct[key]] for key in keys]
    counters["scored_tokens"] += float(sum(len(x) for ids in choice_ids for x in ids))
    outs = []
    for slot, text, pids, options, cids, lps in zip(
        batch, texts, prompt_ids, choices, choice_ids, scored, strict=True
    ):
        means = np.array([float(np.mean(lp, dtype=np.float64)) for lp in lps])
        j = sample_index(choice_log_probs(means, temperature), slot.rng)
        outs.append(
            _Turn(
                text,
                pids,
                options[j],
                list(cids[j]),
                [float(x) for x in lps[j]],
                options[j],
                options,
                choice_scores=[float(m) for m in means],
            )
        )
    return outs


def _generate_turn(
    engine: PolicyEngine,
    prompts: tuple[list[str], list[list[int]]],
    style: str,
    temperature: float,
    max_new_tokens: int,
    seeds: list[int],
    action_parsing: str = "graft",
) -> list[_Turn]:
    from stages.envs.parser import parse_turn

    texts, prompt_ids = prompts
    gens = engine.generate(
        prompt_ids, temperature=temperature, max_new_tokens=max_new_tokens, stop=STOP_STRINGS, seeds=seeds
    )
    turns = []
    for text, pids, g in zip(texts, prompt_ids, gens, strict=True):
        parsed = parse_turn(style, g.text, action_parsing)
        logprobs = [float(x) for x in g.response_logprobs]
        turns.append(
            _Turn(text, pids, g.text, list(g.response_ids), logprobs, parsed.action, None, parsed.well_formed)
        )
    return turns


def _row(slot: _Slot, rec: StepRecord, out: _Turn) -> dict[str, Any]:
    return {
        "step": len(slot.rows),
        "state": rec.state,
        "next_state": rec.next_state,
        "observation": rec.observation,
        "action": rec.action,
        "valid": rec.valid,
        "reward": float(rec.reward),
        "done": rec.done,
        "terminated": rec.terminated,
        "truncated": rec.truncated,
        "prompt": out.prompt,
        "response": out.response,
        "prompt_ids": out.prompt_ids,
        "response_ids": out.response_ids,
        "response_logprobs": out.response_logprobs,
        "choices": out.choices,
        "choice_scores": out.choice_scores,
        "error": rec.error,
    }


# the steps columns a rollout (and `graft demos`) writes, with their polars types
STEPS_FRAME_SCHEMA = {
    "iter": pl.Int32,
    "group_id": pl.String,
    "task_id": pl.String,
    "task_type": pl.String,
    "traj_id": pl.String,
    "step": pl.Int32,
    "state": pl.String,
    "next_state": pl.String,
    "observation": pl.String,
    "action": pl.String,
    "valid": pl.Boolean,
    "reward": pl.Float64,
    "outcome": pl.Float64,
    "done": pl.Boolean,
    "terminated": pl.Boolean,
    "truncated": pl.Boolean,
    "prompt": pl.String,
    "response": pl.String,
    "prompt_ids": pl.List(pl.Int32),
    "response_ids": pl.List(pl.Int32),
    "response_logprobs": pl.List(pl.Float32),
    "choices": pl.List(pl.String),
    "choice_scores": pl.List(pl.Float64),
    "policy_version": pl.String,
    "error": pl.String,
    "score": pl.Float64,
}


def _steps_frame(
    slots: Sequence[_Slot], iteration: int, policy_version: str, group_digits: int, rollout_digits: int
) -> pl.DataFrame:
    """Rows of all episodes, ordered by (group, rollout, step)."""
    columns: dict[str, list[Any]] = {name: [] for name in STEPS_FRAME_SCHEMA}
    for slot in sorted(slots, key=lambda s: (s.group, s.rollout)):
        group_id = f"i{iteration:04d}-g{slot.group:0{group_digits}d}"
        traj_id = f"{group_id}-r{slot.rollout:0{rollout_digits}d}"
        for row in slot.rows:
            columns["iter"].append(iteration)
            columns["group_id"].append(group_id)
            columns["task_id"].append(slot.task.task_id)
            columns["task_type"].append(slot.task.task_type)
            columns["traj_id"].append(traj_id)
            columns["outcome"].append(float(slot.episode.outcome))
            columns["score"].append(float(slot.episode.score))  # the episode's final task score
            columns["policy_version"].append(policy_version)
            for name, value in row.items():
                columns[name].append(value)
    return pl.DataFrame(columns, schema=STEPS_FRAME_SCHEMA)
