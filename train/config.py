"""Recipes: typed run configuration, loaded from recipes/NAME.yaml and `key=value` overrides.

The schema is a tree of dataclasses (OmegaConf structured config), so an unknown key or a wrongly
typed value is caught at load time; `validate` then rejects impossible values. Every error names the
bad key or value and what would be valid.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException, ValidationError

from models.gates import DMSSettings, TrimKVSettings

RECIPES_DIR = Path(__file__).resolve().parent.parent / "recipes"
DEFAULT_RECIPE = "dms_smollm2_cr4"


class RecipeError(ValueError):
    """A recipe or override that cannot run, naming the bad key or value and the valid choices."""


@dataclass
class LoraConfig:
    r: int = 8
    lora_alpha: int = 16
    lora_dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])


@dataclass
class ArchitectureConfig:
    """The backbone's shape, for `--dry-run` checks of scale recipes without downloading the model."""

    model_type: str = MISSING
    hidden_size: int = MISSING
    intermediate_size: int = MISSING
    num_hidden_layers: int = MISSING
    num_attention_heads: int = MISSING
    num_key_value_heads: int = MISSING
    head_dim: int = MISSING
    vocab_size: int = MISSING
    max_position_embeddings: int = MISSING


@dataclass
class ModelConfig:
    backbone: str = "smollm2-135m"  # "smollm2-135m" (embedded), a Hub id, or a local folder
    dtype: str = "float32"  # weights: float32 | bfloat16 | float16
    backbone_mode: str = "frozen"  # frozen | lora | full
    lora: LoraConfig = field(default_factory=LoraConfig)
    activation_checkpointing: bool = False
    architecture: Optional[ArchitectureConfig] = None


@dataclass
class GateConfig:
    kind: str = "dms"  # dms | trimkv
    dms: DMSSettings = field(default_factory=DMSSettings)
    trimkv: TrimKVSettings = field(default_factory=TrimKVSettings)

    def settings(self) -> dict[str, Any]:
        return dataclasses.asdict(self.dms if self.kind == "dms" else self.trimkv)


@dataclass
class DataConfig:
    source: str = "gsm_symbolic"  # gsm_symbolic | essays | openr1 | hf | files | traces
    path: Optional[str] = None  # dataset name or local path (openr1, hf, files, traces)
    split: str = "train"
    text_column: str = "text"
    train_samples: int = 256  # rows drawn from the source before packing (-1: all)
    eval_samples: int = 16
    max_length: int = 256
    packing: bool = True
    chat_template: bool = True
    mask_prompt: bool = False
    too_long: str = "truncate"  # truncate | drop
    streaming: bool = False
    batch_size: int = 1  # micro-batch per device
    num_workers: int = 0


@dataclass
class LossConfig:
    kl_direction: str = "reverse"  # forward = KL(teacher || student), reverse = KL(student || teacher)
    temperature: float = 1.0
    kl_weight: float = 1.0
    ntp_weight: float = 0.0
    capacity_weight: float = 1.0
    head_cap: float = 1.0  # DMS: most keys one (layer, KV head) may evict before head_cap_weight penalises it (1: off)
    head_cap_weight: float = 0.0
    chunk_tokens: int = 1024  # logits rows per chunk of the distillation loss


@dataclass
class ScheduleConfig:
    cr_final: float = 4.0
    steps_per_cr: int = 100  # CR rises linearly by one unit every steps_per_cr steps
    hold_steps: int = 0  # steps at cr_final after the ramp
    neuron_warmup_steps: int = 0  # DMS query-neuron fade-out before the ramp starts
    tau_final: Optional[float] = None  # anneal DMS tau linearly to this over the ramp


@dataclass
class OptimConfig:
    lr: float = 3e-5
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    weight_decay: float = 0.0
    warmup_steps: int = 0
    grad_clip: float = 1.0


@dataclass
class TrainerConfig:
    """Lightning Trainer arguments."""

    max_steps: int = -1  # -1: warm-up + ramp + hold
    accelerator: str = "auto"
    devices: Any = 1
    num_nodes: int = 1
    precision: str = "32-true"
    accumulate_grad_batches: int = 1
    log_every_n_steps: int = 1
    val_check_interval: Optional[int] = None
    checkpoint_every_n_steps: int = 50
    enable_progress_bar: bool = True


@dataclass
class StrategyConfig:
    name: str = "auto"  # auto | single | ddp | deepspeed
    zero_stage: int = 2
    offload_optimizer: bool = False
    offload_parameters: bool = False


@dataclass
class RunConfig:
    recipe: str = DEFAULT_RECIPE
    seed: int = 0
    output_dir: str = "outputs/${recipe}"
    resume: str = "never"  # never | auto | a checkpoint path
    model: ModelConfig = field(default_factory=ModelConfig)
    gate: GateConfig = field(default_factory=GateConfig)
    data: DataConfig = field(default_factory=DataConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)


def available_recipes(folder: Path = RECIPES_DIR) -> list[str]:
    """The recipe names in `folder` (training recipes by default; evaluation recipes live in recipes/eval)."""
    return sorted(p.stem for p in folder.glob("*.yaml"))


def load_recipe(name: str = DEFAULT_RECIPE, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Schema <- recipes/NAME.yaml <- overrides, then validated; returns a typed RunConfig."""
    config = load_structured(RunConfig, RECIPES_DIR, name, overrides)
    validate(config)
    return config


def load_structured(schema: type, folder: Path, name: str, overrides: list[str] | tuple[str, ...] = ()):
    """A dataclass `schema` <- folder/NAME.yaml <- `key=value` overrides (the recipe system of training and
    evaluation alike). The schema's `recipe` field is set to NAME."""
    recipes = available_recipes(folder)
    if name not in recipes:
        raise RecipeError(f"unknown recipe {name!r}; available recipes: {', '.join(recipes)}")
    merged = _merge(OmegaConf.structured(schema), OmegaConf.load(folder / f"{name}.yaml"), f"recipe {name}")
    merged.recipe = name
    for item in overrides:
        if "=" not in item:
            raise RecipeError(f"override {item!r} is not key=value (e.g. trainer.max_steps=10)")
        key = item.split("=", 1)[0]
        if key == "recipe":
            raise RecipeError("recipe= must come before the overrides and appear once")
        merged = _merge(merged, OmegaConf.from_dotlist([item]), f"override {item!r}")
    try:
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        raise RecipeError(f"recipe {name}: {_describe(err)}") from None


def _merge(base: DictConfig, update: DictConfig, origin: str) -> DictConfig:
    try:
        return OmegaConf.merge(base, update)
    except (ConfigKeyError, ConfigAttributeError) as err:
        key = err.full_key or getattr(err, "key", "?")
        raise RecipeError(f"{origin}: unknown key {key!r}; {_valid_keys_hint(base, str(key))}") from None
    except ValidationError as err:
        raise RecipeError(f"{origin}: {_describe(err)}") from None


def _valid_keys_hint(config: DictConfig, key: str) -> str:
    parts = key.split(".")
    node = config
    for part in parts[:-1]:
        if isinstance(node, DictConfig) and part in node and isinstance(node[part], DictConfig):
            node = node[part]
        else:
            break
    valid = sorted(node.keys()) if isinstance(node, DictConfig) else []
    close = difflib.get_close_matches(parts[-1], valid, n=1)
    return (f"did you mean {close[0]!r}? " if close else "") + f"valid keys here: {', '.join(valid)}"


def _describe(err: OmegaConfBaseException) -> str:
    text = str(err).splitlines()[0]
    key = getattr(err, "full_key", None)
    return f"key {key!r}: {text}" if key else text


def choice(value: Any, valid: tuple, what: str) -> None:
    if value not in valid:
        raise RecipeError(f"{what}={value!r} is invalid; valid: {', '.join(map(repr, valid))}")


def validate(config: RunConfig) -> None:
    """Reject values that parse but cannot work."""
    choice(config.model.backbone_mode, ("frozen", "lora", "full"), "model.backbone_mode")
    choice(config.model.dtype, ("float32", "bfloat16", "float16"), "model.dtype")
    choice(config.gate.kind, ("dms", "trimkv"), "gate.kind")
    choice(config.data.source, ("gsm_symbolic", "essays", "openr1", "hf", "files", "traces"), "data.source")
    choice(config.data.too_long, ("truncate", "drop"), "data.too_long")
    choice(config.loss.kl_direction, ("forward", "reverse"), "loss.kl_direction")
    choice(config.strategy.name, ("auto", "single", "ddp", "deepspeed"), "strategy.name")
    choice(config.strategy.zero_stage, (1, 2, 3), "strategy.zero_stage")
    choice(config.resume if config.resume in ("never", "auto") else "path", ("never", "auto", "path"), "resume")
    if config.schedule.cr_final < 1:
        raise RecipeError(f"schedule.cr_final={config.schedule.cr_final} is invalid; a compression ratio is >= 1")
    if config.schedule.steps_per_cr < 1:
        raise RecipeError(f"schedule.steps_per_cr={config.schedule.steps_per_cr} is invalid; it must be >= 1")
    if config.data.max_length < 2:
        raise RecipeError(f"data.max_length={config.data.max_length} is invalid; it must be >= 2")
    for key in ("batch_size",):
        if getattr(config.data, key) < 1:
            raise RecipeError(f"data.{key}={getattr(config.data, key)} is invalid; it must be >= 1")
    if not 0 < config.loss.head_cap <= 1 or config.loss.head_cap_weight < 0:
        raise RecipeError(f"loss.head_cap={config.loss.head_cap} must be within (0, 1] and loss.head_cap_weight="
                          f"{config.loss.head_cap_weight} >= 0")
    if config.optim.lr <= 0:
        raise RecipeError(f"optim.lr={config.optim.lr} is invalid; it must be > 0")
    if len(config.optim.betas) != 2 or not all(0 <= b < 1 for b in config.optim.betas):
        raise RecipeError(f"optim.betas={config.optim.betas} is invalid; two values in [0, 1)")
    if config.gate.kind == "dms":
        dms = config.gate.dms
        if dms.window < 0:
            raise RecipeError(f"gate.dms.window={dms.window} is invalid; it must be >= 0")
        if dms.window + 1 >= config.data.max_length:
            raise RecipeError(f"gate.dms.window={dms.window} leaves nothing to evict in sequences of "
                              f"data.max_length={config.data.max_length}; valid: window <= {config.data.max_length - 2}")
        choice(dms.source, ("query_neuron", "adapter"), "gate.dms.source")
        if dms.sinks < 0:
            raise RecipeError(f"gate.dms.sinks={dms.sinks} is invalid; it must be >= 0")
        if dms.tau <= 0:
            raise RecipeError(f"gate.dms.tau={dms.tau} is invalid; it must be > 0")
    else:
        trim = config.gate.trimkv
        choice(trim.decay, ("additive", "multiplicative"), "gate.trimkv.decay")
        if trim.budget < 1:
            raise RecipeError(f"gate.trimkv.budget={trim.budget} is invalid; the memory budget M must be >= 1")
        if not 0 <= trim.sinks < trim.budget:
            raise RecipeError(f"gate.trimkv.sinks={trim.sinks} is invalid; valid: 0 .. gate.trimkv.budget - 1 = {trim.budget - 1}")
        if trim.hidden < 1:
            raise RecipeError(f"gate.trimkv.hidden={trim.hidden} is invalid; it must be >= 1")


def total_steps(config: RunConfig) -> int:
    if config.trainer.max_steps > 0:
        return config.trainer.max_steps
    s = config.schedule
    return s.neuron_warmup_steps + ramp_steps(config) + s.hold_steps


def ramp_steps(config: RunConfig) -> int:
    return round((config.schedule.cr_final - 1) * config.schedule.steps_per_cr)


def to_yaml(config: RunConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(config))
