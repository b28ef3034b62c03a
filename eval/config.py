"""Evaluation recipes: typed settings of `python -m eval SUITE`, loaded from recipes/eval/NAME.yaml plus
`key=value` overrides through the same recipe system as training (unknown keys and wrong types are
caught at load time, impossible values by `validate`).

A suite is a sweep: every method (a baseline policy at a budget, or a learned snapshot) x task x W x L
is one cell with one JSONL record. `python -m eval perplexity` is the sweep recipe `perplexity`, and so on.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from recipes import RECIPES_DIR, RecipeError, available_recipes, choice, load_structured

EVAL_RECIPES_DIR = RECIPES_DIR / "eval"
BASELINES = ("full", "window", "sink", "h2o", "tova", "quest")
TASKS = ("perplexity", "niah", "variable_tracking", "math")


@dataclass
class PerplexityTask:
    """Streaming perplexity and KL to the full cache over long held-out documents, through the engine."""

    source: str = "essays"
    """essays (the haystack's held-out tenth) | files | hf | run (a training run's held-out rows)."""
    path: Optional[str] = None
    """files: a .txt/.jsonl/.json/.parquet/.csv file or folder; hf: a datasets name; run: its folder."""
    split: str = "train"
    """The datasets split (hf)."""
    text_column: str = "text"
    """Column holding the text (files, hf)."""
    documents: int = 2
    """Documents scored."""
    tokens: int = 2048
    """Tokens per document (longer texts are cut, shorter ones skipped)."""
    score_from: int = 256
    """Positions before this are context only (the cache is still filling)."""
    chunk_size: int = 32
    """Tokens per forward through the engine; 1 is token by token (exact decode)."""


@dataclass
class NeedleTask:
    """RULER-style needle in a haystack: magic numbers hidden in held-out essays, retrieved by generation."""

    context_lengths: list[int] = field(default_factory=lambda: [1024, 2048])
    """Prompt tokens."""
    depths: list[float] = field(default_factory=lambda: [0.1, 0.5, 0.9])
    """Where the (first) needle sits."""
    needles: list[int] = field(default_factory=lambda: [1])
    """Needles hidden; one is asked for."""
    samples: int = 1
    """Prompts per (length, depth, needle count)."""
    max_new_tokens: int = 16
    """Most tokens generated per answer."""


@dataclass
class VariableTrackingTask:
    """RULER-style variable tracking: a chain VAR A = 12345, VAR B = VAR A, ... in repeated noise."""

    context_lengths: list[int] = field(default_factory=lambda: [1024, 2048])
    """Prompt tokens."""
    hops: int = 4
    """Assignments in a chain between the value and the asked name."""
    chains: int = 1
    """Independent chains hidden in the noise."""
    samples: int = 3
    """Prompts per context length."""
    max_new_tokens: int = 24
    """Most tokens generated per answer."""


@dataclass
class MathTask:
    """Math word problems answered by generation (chat template), graded with math-verify."""

    source: str = "gsm_symbolic"
    """gsm_symbolic (reasoning-gym, offline) | gsm8k | math500 | aime | files | hf."""
    path: Optional[str] = None
    """A datasets name or local file/folder for gsm8k/math500/aime/files/hf."""
    split: str = "test"
    """The datasets split."""
    samples: int = 8
    """Problems evaluated."""
    temperature: float = 0.7
    """Sampling temperature when W > 1 (W = 1 is greedy)."""


@dataclass
class EvalConfig:
    """One evaluation: `python -m eval SUITE [key=value ...]` (a recipe in recipes/eval)."""

    recipe: str = "perplexity"
    """The evaluation recipe the run started from (set by the loader)."""
    output_dir: str = "outputs/eval/${recipe}"
    """Where records (JSONL), the report and plots go."""
    seed: int = 1234
    """Task generation and sampling; training draws gsm_symbolic with its own seed (0 by default)."""
    device: str = "auto"
    """auto (CUDA when present) | cpu | cuda | cuda:N."""
    dtype: str = "float32"
    """float32 | bfloat16 | float16."""
    backbone: str = "smollm2-135m"
    """The model the baselines run on (the snapshots' base model)."""
    snapshots: list[str] = field(default_factory=list)
    """Snapshot folders, or run folders (their final snapshot)."""
    family: bool = False
    """A run folder stands for its whole CR family instead of its final snapshot."""
    policies: list[str] = field(default_factory=lambda: ["full", "window", "sink", "h2o", "tova"])
    """Training-free baselines: full | window | sink | h2o | tova | quest."""
    budgets: list[int] = field(default_factory=lambda: [128, 256, 512])
    """KV tokens per (sequence, KV head)."""
    learned_budget: Optional[int] = None
    """The learned policies' slot cap (default: the largest context)."""
    match_memory: bool = True
    """Add each baseline at every learned cell's realised mean and peak KV tokens."""
    tasks: list[str] = field(default_factory=lambda: ["perplexity"])
    """Tasks run for every method: perplexity | niah | variable_tracking | math."""
    samples_w: list[int] = field(default_factory=lambda: [1])
    """W: parallel samples, majority vote (math)."""
    max_length_l: list[int] = field(default_factory=lambda: [256])
    """L: most tokens generated (math)."""
    batch_size: int = 4
    """Prompts generated together (left-padded)."""
    perplexity: PerplexityTask = field(default_factory=PerplexityTask)
    """Streaming perplexity settings."""
    niah: NeedleTask = field(default_factory=NeedleTask)
    """Needle-in-a-haystack settings."""
    variable_tracking: VariableTrackingTask = field(default_factory=VariableTrackingTask)
    """Variable-tracking settings."""
    math: MathTask = field(default_factory=MathTask)
    """Math word-problem settings."""


def available_eval_recipes() -> list[str]:
    return available_recipes(EVAL_RECIPES_DIR)


def load_eval_recipe(name: str, overrides: list[str] | tuple[str, ...] = ()) -> EvalConfig:
    config = load_structured(EvalConfig, EVAL_RECIPES_DIR, name, overrides)
    validate(config)
    return config


def validate(cfg: EvalConfig) -> None:
    choice(cfg.dtype, ("float32", "bfloat16", "float16"), "dtype")
    if not (cfg.device in ("auto", "cpu", "cuda") or cfg.device.startswith("cuda:")):
        raise RecipeError(f"device={cfg.device!r} is invalid; valid: 'auto', 'cpu', 'cuda', 'cuda:N'")
    for task in cfg.tasks:
        choice(task, TASKS, "tasks item")
    if not cfg.tasks:
        raise RecipeError(f"tasks is empty; give one or more of {', '.join(TASKS)}")
    for policy in cfg.policies:
        if policy not in BASELINES:
            raise RecipeError(f"policies item {policy!r} is invalid; valid baselines: {', '.join(BASELINES)} "
                              "(learned policies come from snapshots=[...])")
    if not cfg.policies and not cfg.snapshots:
        raise RecipeError("nothing to evaluate: give policies=[...] and/or snapshots=[...]")
    for budget in cfg.budgets:
        if budget < 1:
            raise RecipeError(f"budgets item {budget} is invalid; a KV budget is >= 1 token")
    if cfg.learned_budget is not None and cfg.learned_budget < 1:
        raise RecipeError(f"learned_budget={cfg.learned_budget} is invalid; it must be >= 1")
    for name, values in (("samples_w", cfg.samples_w), ("max_length_l", cfg.max_length_l)):
        if not values or any(v < 1 for v in values):
            raise RecipeError(f"{name}={values} is invalid; one or more values >= 1")
    if cfg.batch_size < 1:
        raise RecipeError(f"batch_size={cfg.batch_size} is invalid; it must be >= 1")
    ppl = cfg.perplexity
    choice(ppl.source, ("essays", "files", "hf", "run"), "perplexity.source")
    if ppl.source != "essays" and not ppl.path:
        raise RecipeError(f"perplexity.source={ppl.source} needs perplexity.path (a file, folder, datasets name or run)")
    if ppl.documents < 1 or ppl.chunk_size < 1:
        raise RecipeError(f"perplexity.documents={ppl.documents} and perplexity.chunk_size={ppl.chunk_size} "
                          "must be >= 1")
    if not 0 <= ppl.score_from < ppl.tokens - 1:
        raise RecipeError(f"perplexity.score_from={ppl.score_from} must be >= 0 and below perplexity.tokens - 1 "
                          f"= {ppl.tokens - 1}, so that some positions are scored")
    for name, task in (("niah", cfg.niah), ("variable_tracking", cfg.variable_tracking)):
        if not task.context_lengths or any(n < 64 for n in task.context_lengths):
            raise RecipeError(f"{name}.context_lengths={task.context_lengths} is invalid; lengths >= 64 tokens")
        if task.samples < 1 or task.max_new_tokens < 1:
            raise RecipeError(f"{name}.samples and {name}.max_new_tokens must be >= 1")
    if any(not 0.0 <= d <= 1.0 for d in cfg.niah.depths) or not cfg.niah.depths:
        raise RecipeError(f"niah.depths={cfg.niah.depths} is invalid; fractions within [0, 1]")
    if any(n < 1 for n in cfg.niah.needles) or not cfg.niah.needles:
        raise RecipeError(f"niah.needles={cfg.niah.needles} is invalid; counts >= 1")
    if cfg.variable_tracking.hops < 1 or cfg.variable_tracking.chains < 1:
        raise RecipeError("variable_tracking.hops and variable_tracking.chains must be >= 1")
    choice(cfg.math.source, ("gsm_symbolic", "gsm8k", "math500", "aime", "files", "hf"), "math.source")
    if cfg.math.samples < 1:
        raise RecipeError(f"math.samples={cfg.math.samples} is invalid; it must be >= 1")
