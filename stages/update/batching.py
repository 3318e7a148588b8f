"""The update stage's input: steps joined with advantages, tokenized rows, minibatches, micro-batches.

Pure functions over polars tables and numpy arrays; nothing here touches a model.

* ``join_steps_advantages``: the advantages table is row-aligned with the steps table (docs/design.md §3);
  the join checks that the (group_id, traj_id, step) keys agree row by row.
* ``build_update_rows``: token ids per row; ``choose`` rows (non-null ``choices``) get each choice's
  ids (``tokenizer.encode(choice, add_special_tokens=False)``, the convention of the rollout stage)
  and the index of the chosen one (the choice whose ids equal ``response_ids``).
* ``minibatch_schedule``: a seeded permutation per epoch, cut into minibatches of
  ``minibatch_size`` rows (the last one may be smaller); one optimizer step per minibatch.
* ``pack_microbatches``: rows of one kind (token / choice) sorted by padded length and cut into
  consecutive micro-batches with ``rows x longest sequence <= max_tokens_per_batch`` (a single longer
  row gets a micro-batch of its own), choosing the cut with the least padding plus a per-pass cost.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import polars as pl

from schemas.errors import GraftError

KEYS = ("group_id", "traj_id", "step")


def join_steps_advantages(
    steps: pl.DataFrame, advantages: pl.DataFrame, steps_source: str = "steps", adv_source: str = "advantages"
) -> pl.DataFrame:
    """Steps with an ``advantage`` column, checking that both tables list the same rows in order."""
    if steps.height != advantages.height:
        raise GraftError(
            f"{adv_source}: {advantages.height} rows but {steps_source} has {steps.height}; "
            "the advantages table must have one row per steps row, in the same order"
        )
    left, right = steps.select(KEYS), advantages.select(KEYS)
    same = (
        (left["group_id"] == right["group_id"])
        & (left["traj_id"] == right["traj_id"])
        & (left["step"] == right["step"])
    )
    if not bool(same.all()):
        i = int(np.flatnonzero(~same.to_numpy())[0])
        a, b = left.row(i), right.row(i)
        raise GraftError(
            f"{adv_source}: row {i} is (group_id={b[0]!r}, traj_id={b[1]!r}, step={b[2]}) but "
            f"{steps_source} row {i} is (group_id={a[0]!r}, traj_id={a[1]!r}, step={a[2]}); "
            "advantages must follow the steps row order"
        )
    adv = advantages["advantage"].to_numpy()
    if not np.all(np.isfinite(adv)):
        i = int(np.flatnonzero(~np.isfinite(adv))[0])
        raise GraftError(
            f"{adv_source}: row {i} (traj_id={right['traj_id'][i]!r}) has a non-finite advantage"
        )
    return steps.with_columns(advantages["advantage"].cast(pl.Float64))


@dataclass
class UpdateRows:
    """Tokenized training rows (n of them), in steps-table order.

    prompt_ids / response_ids: n int arrays. advantage: (n,) float64.
    behaviour_logprobs: n float32 arrays or None (stored ``response_logprobs`` where present).
    choices: per row None (token row) or the list of each admissible choice's ids; chosen: (n,) index
    of the response among the choices (-1 for token rows). choice_scores: per row None or the stored
    behaviour m_j of each choice (``choice_scores`` of a choose-mode rollout, aligned with ``choices``).
    """

    keys: pl.DataFrame
    prompt_ids: list[np.ndarray]
    response_ids: list[np.ndarray]
    advantage: np.ndarray
    behaviour_logprobs: list[np.ndarray | None]
    choices: list[list[np.ndarray] | None]
    chosen: np.ndarray
    choice_scores: list[np.ndarray | None] | None = None

    @property
    def n(self) -> int:
        return len(self.prompt_ids)

    @property
    def is_choice(self) -> np.ndarray:
        return self.chosen >= 0

    @property
    def response_lengths(self) -> np.ndarray:
        return np.array([len(r) for r in self.response_ids], dtype=np.int64)

    @property
    def sequence_lengths(self) -> np.ndarray:
        """Padded length each row needs: prompt + response, or prompt + all choices (choose rows)."""
        out = np.empty(self.n, dtype=np.int64)
        for i in range(self.n):
            extra = (
                len(self.response_ids[i]) if self.choices[i] is None else sum(len(c) for c in self.choices[i])
            )
            out[i] = len(self.prompt_ids[i]) + extra
        return out

    def describe(self, i: int) -> str:
        g, t, s = self.keys.row(i)
        return f"row {i} (group_id={g!r}, traj_id={t!r}, step={s})"


def drop_flat_groups(joined: pl.DataFrame) -> pl.DataFrame:
    """The rows of the groups with at least one non-zero advantage (``update.skip_flat_groups``).

    A group whose every row has A = 0 adds nothing to the policy-gradient term, only to the row count
    that divides it (and to the KL term): dropping it is DAPO's dynamic sampling without the resampling.
    The test is on the credit stage's output, so for graft it is "every step's credit is zero", not
    "every outcome is equal". When every group is flat nothing is dropped (the step is then the KL
    term alone, as without the option).
    """
    keep = joined.filter((pl.col("advantage") != 0).any().over("group_id"))
    return keep if keep.height else joined


def build_update_rows(
    joined: pl.DataFrame,
    encode_choices: Callable[[list[str]], list[list[int]]] | None = None,
    source: str = "steps",
) -> UpdateRows:
    """Tokenized rows from a joined steps+advantages table.

    ``encode_choices`` maps choice strings to ids (needed when any row has ``choices``). Rows without
    ``prompt_ids``/``response_ids`` are an error: the update trains on tokens (external rollouts must
    carry them).
    """
    n = joined.height
    keys = joined.select(KEYS)

    def where(i: int) -> str:
        g, t, s = keys.row(i)
        return f"{source}: row {i} (traj_id={t!r}, step={s})"

    prompts_col = joined["prompt_ids"].to_list()
    responses_col = joined["response_ids"].to_list()
    logprobs_col = (
        joined["response_logprobs"].to_list() if "response_logprobs" in joined.columns else [None] * n
    )
    choices_col = joined["choices"].to_list() if "choices" in joined.columns else [None] * n
    scores_col = joined["choice_scores"].to_list() if "choice_scores" in joined.columns else [None] * n
    prompts: list[np.ndarray] = []
    responses: list[np.ndarray] = []
    behaviour: list[np.ndarray | None] = []
    for i in range(n):
        p, r = prompts_col[i], responses_col[i]
        if p is None or r is None:
            missing = "prompt_ids" if p is None else "response_ids"
            raise GraftError(f"{where(i)} has no {missing}; graft update trains on token ids")
        if len(p) == 0 or len(r) == 0:
            empty = "prompt_ids" if len(p) == 0 else "response_ids"
            raise GraftError(f"{where(i)} has an empty {empty}")
        prompts.append(np.asarray(p, dtype=np.int64))
        responses.append(np.asarray(r, dtype=np.int64))
        lp = logprobs_col[i]
        if lp is not None:
            if len(lp) != len(r):
                raise GraftError(f"{where(i)}: {len(lp)} response_logprobs for {len(r)} response_ids")
            behaviour.append(np.asarray(lp, dtype=np.float32))
        else:
            behaviour.append(None)

    choices: list[list[np.ndarray] | None] = [None] * n
    choice_scores: list[np.ndarray | None] = [None] * n
    chosen = np.full(n, -1, dtype=np.int64)
    choice_rows = [i for i in range(n) if choices_col[i] is not None]
    if choice_rows:
        if encode_choices is None:
            raise GraftError(f"{source}: choose-mode rows need a tokenizer to encode their choices")
        unique = sorted({c for i in choice_rows for c in choices_col[i]})
        ids = dict(zip(unique, encode_choices(unique), strict=True))
        for i in choice_rows:
            row_choices = [np.asarray(ids[c], dtype=np.int64) for c in choices_col[i]]
            if not row_choices:
                raise GraftError(f"{where(i)} has an empty choices list")
            for c, arr in zip(choices_col[i], row_choices, strict=True):
                if arr.size == 0:
                    raise GraftError(f"{where(i)}: choice {c!r} encodes to zero tokens")
            match = [j for j, arr in enumerate(row_choices) if np.array_equal(arr, responses[i])]
            if not match:
                raise GraftError(
                    f"{where(i)}: response_ids are none of the encoded choices "
                    "(choose mode expects the chosen choice's ids as the response)"
                )
            choices[i] = row_choices
            chosen[i] = match[0]
            if scores_col[i] is not None:
                scores = np.asarray(scores_col[i], dtype=np.float64)
                if scores.size != len(row_choices) or not np.all(np.isfinite(scores)):
                    raise GraftError(
                        f"{where(i)}: choice_scores must be one finite number per choice "
                        f"({scores.size} for {len(row_choices)} choices)"
                    )
                choice_scores[i] = scores
    return UpdateRows(
        keys=keys,
        prompt_ids=prompts,
        response_ids=responses,
        advantage=joined["advantage"].to_numpy().astype(np.float64),
        behaviour_logprobs=behaviour,
        choices=choices,
        chosen=chosen,
        choice_scores=choice_scores,
    )


def minibatch_schedule(
    n: int, minibatch_size: int, epochs: int, rng: np.random.Generator
) -> list[np.ndarray]:
    """Row indices of each optimizer step: per epoch a fresh permutation cut into minibatches."""
    if minibatch_size < 1:
        raise GraftError(f"update.minibatch_size must be >= 1 (got {minibatch_size})")
    out = []
    for _ in range(epochs):
        perm = rng.permutation(n)
        out.extend(perm[s : s + minibatch_size] for s in range(0, n, minibatch_size))
    return out


@dataclass(frozen=True)
class MicroBatch:
    """Rows scored in one forward pass; ``choice`` tells which layout (all rows share it)."""

    rows: np.ndarray
    choice: bool


def split_sorted(lengths: np.ndarray, max_tokens: int, overhead: int) -> list[int]:
    """Cut points of the cheapest split of rows sorted by length (descending) into consecutive chunks.

    A chunk ``[i, j)`` costs its padded size plus a fixed per-forward cost, ``(j - i) * lengths[i] +
    overhead``, and must satisfy ``(j - i) * lengths[i] <= max_tokens`` (a single longer row is
    allowed). Dynamic programming over the end of the first chunk: ``best[i] = min_j cost(i, j) +
    best[j]``, ``best[n] = 0``. Returns the chunk starts followed by n.
    """
    n = lengths.size
    lengths = np.maximum(lengths.astype(np.int64), 1)
    best = np.zeros(n + 1, dtype=np.float64)
    cut = np.zeros(n + 1, dtype=np.int64)
    for i in range(n - 1, -1, -1):
        fit = max(1, max_tokens // int(lengths[i]))
        ends = np.arange(i + 1, min(n, i + fit) + 1)
        costs = (ends - i) * float(lengths[i]) + overhead + best[ends]
        k = int(np.argmin(costs))
        best[i], cut[i] = costs[k], ends[k]
    starts = [0]
    while starts[-1] < n:
        starts.append(int(cut[starts[-1]]))
    return starts


# A forward + backward pass costs about this many padded tokens of work beyond its tokens (call
# overhead, small-batch kernels): measured on the tiny model, CPU, one thread (docs/results/speed.md
# "Update throughput (CPU)"). It keeps the padding-minimal split from cutting a minibatch into many tiny passes.
MICROBATCH_OVERHEAD_TOKENS = 512


def pack_microbatches(
    rows: Sequence[int] | np.ndarray,
    lengths: np.ndarray,
    is_choice: np.ndarray,
    max_tokens: int,
    overhead: int = MICROBATCH_OVERHEAD_TOKENS,
) -> list[MicroBatch]:
    """Pack ``rows`` into micro-batches of one kind each, longest first, each with padded size
    ``len(batch) * longest <= max_tokens`` (a row longer than ``max_tokens`` goes alone).

    Among such splits of the length-sorted rows, the one with the least padded tokens plus
    ``overhead`` per micro-batch (:func:`split_sorted`): a greedy fill to the budget would pad the
    shorter rows of a full micro-batch to its longest (~17% of the tokens for prompts of 180-340
    tokens).
    """
    rows = np.asarray(rows, dtype=np.int64)
    out: list[MicroBatch] = []
    for kind in (False, True):
        sel = rows[is_choice[rows] == kind]
        if sel.size == 0:
            continue
        order = sel[np.argsort(-lengths[sel], kind="stable")]
        starts = split_sorted(lengths[order], max_tokens, overhead)
        out.extend(MicroBatch(order[a:b], kind) for a, b in zip(starts[:-1], starts[1:], strict=True))
    return out


def shard(rows: np.ndarray, rank: int, world_size: int) -> np.ndarray:
    """The rows of a minibatch that rank ``rank`` of ``world_size`` processes (strided split)."""
    return rows[rank::world_size]
