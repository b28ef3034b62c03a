"""Training recipes: the typed run configuration, loaded from recipes/NAME.yaml and `key=value` overrides.

The schema is a tree of dataclasses (OmegaConf structured config), so an unknown key or a wrongly typed
value is caught at load time; `validate` then rejects impossible values. Every error names the bad key or
value and what would be valid. The gate section has one field per registered gate kind
(models.gates.GATE_KINDS), each with the kind's own settings and validation.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import MISSING, OmegaConf

from data.config import DataConfig
from models.gates import GATE_KINDS, GateError
from recipes import RECIPES_DIR, RecipeError, choice, load_structured

DEFAULT_RECIPE = "dms_smollm2_cr4"


@dataclass
class LoraConfig:
    """peft LoRA adapters (model.backbone_mode=lora)."""

    r: int = 8
    """Adapter rank."""
    lora_alpha: int = 16
    """Adapter scale numerator (scale = lora_alpha / r)."""
    lora_dropout: float = 0.0
    """Dropout on the adapter input."""
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    """Linear layers that get adapters."""


@dataclass
class ArchitectureConfig:
    """The backbone's shape, for `--dry-run` checks of scale recipes without downloading the model."""

    model_type: str = MISSING
    """transformers model type: llama | qwen2 | qwen3 | mistral."""
    hidden_size: int = MISSING
    """Residual stream width."""
    intermediate_size: int = MISSING
    """MLP width."""
    num_hidden_layers: int = MISSING
    """Decoder layers."""
    num_attention_heads: int = MISSING
    """Query heads."""
    num_key_value_heads: int = MISSING
    """KV heads (GQA groups)."""
    head_dim: int = MISSING
    """Channels per head."""
    vocab_size: int = MISSING
    """Tokenizer vocabulary."""
    max_position_embeddings: int = MISSING
    """Longest trained context."""


@dataclass
class ModelConfig:
    """The backbone and what of it trains."""

    backbone: str = "smollm2-135m"
    """'smollm2-135m' (embedded), a Hub id, or a local folder."""
    dtype: str = "float32"
    """Backbone weights: float32 | bfloat16 | float16 (gates always train in float32)."""
    backbone_mode: str = "frozen"
    """frozen (gates only) | lora (gates + LoRA) | full (every weight; the teacher is a frozen copy)."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA settings, used when backbone_mode=lora."""
    activation_checkpointing: bool = False
    """Recompute decoder layers in backward to save activation memory."""
    architecture: Optional[ArchitectureConfig] = None
    """The backbone's shape for dry runs without a download; None reads the backbone's config."""

    def lora_settings(self) -> dict | None:
        """peft LoRA settings when the backbone trains through LoRA, else None."""
        return dataclasses.asdict(self.lora) if self.backbone_mode == "lora" else None


def _gate_config() -> type:
    """The gate section: `kind` plus one settings field per registered gate kind."""
    fields: list[Any] = [("kind", str, field(default="dms"))]
    fields += [(name, kind.settings_type, field(default_factory=kind.settings_type)) for name, kind in GATE_KINDS.items()]

    def selected(self) -> Any:
        """The settings of the selected kind."""
        return getattr(self, self.kind)

    def settings(self) -> dict[str, Any]:
        """The selected kind's settings as a dict (what attach_gates takes)."""
        return dataclasses.asdict(self.selected())

    doc = f"Eviction gates: `kind` ({' | '.join(GATE_KINDS)}) selects which of the settings below apply."
    return dataclasses.make_dataclass("GateConfig", fields, namespace={"selected": selected, "settings": settings, "__doc__": doc})


GateConfig = _gate_config()


@dataclass
class LossConfig:
    """The retrofit loss: distillation from the original model plus the gate kind's capacity loss."""

    kl_direction: str = "reverse"
    """forward = KL(teacher || student), reverse = KL(student || teacher)."""
    temperature: float = 1.0
    """Softens both distributions before the KL (the KL is scaled by temperature**2)."""
    kl_weight: float = 1.0
    """Weight of the distillation KL."""
    ntp_weight: float = 0.0
    """Weight of the next-token cross-entropy on the training text."""
    capacity_weight: float = 1.0
    """Weight of the capacity loss that pushes eviction up to the scheduled target."""
    head_cap: float = 1.0
    """DMS: most keys one (layer, KV head) may evict before head_cap_weight penalises it (1: off)."""
    head_cap_weight: float = 0.0
    """DMS: weight of the per-head cap penalty."""
    chunk_tokens: int = 1024
    """Logit rows per chunk of the distillation loss (bounds full-vocabulary memory)."""


@dataclass
class ScheduleConfig:
    """Step-indexed schedules: the compression ratio ramp, DMS temperature and neuron fade-out."""

    cr_final: float = 4.0
    """Compression ratio the ramp ends at (DMS: eviction target 1 - 1/CR)."""
    steps_per_cr: int = 100
    """CR rises linearly by one unit every steps_per_cr steps."""
    hold_steps: int = 0
    """Steps at cr_final after the ramp."""
    neuron_warmup_steps: int = 0
    """DMS query-neuron fade-out before the ramp starts."""
    tau_final: Optional[float] = None
    """Anneal the DMS temperature linearly to this over the ramp (None: constant)."""


@dataclass
class OptimConfig:
    """AdamW over the trainable parameters."""

    lr: float = 3e-5
    """Peak learning rate."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    """AdamW betas."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    warmup_steps: int = 0
    """Linear learning-rate warm-up steps."""
    grad_clip: float = 1.0
    """Gradient norm clip (DeepSpeed clips through its own config)."""


@dataclass
class TrainerConfig:
    """Lightning Trainer arguments."""

    max_steps: int = -1
    """Optimizer steps; -1: neuron warm-up + CR ramp + hold."""
    accelerator: str = "auto"
    """cpu | gpu | auto."""
    devices: Any = 1
    """Devices per node (an int or a list of indices)."""
    num_nodes: int = 1
    """Nodes of a multi-node run."""
    precision: str = "32-true"
    """Lightning precision: 32-true | bf16-mixed | bf16-true | 16-mixed."""
    global_batch_size: Optional[int] = None
    """Sequences per optimizer step over all devices and nodes (None: one micro-batch per device). Gradient
    accumulation is derived: global_batch_size / (devices x num_nodes x data.batch_size), which must divide."""
    log_every_n_steps: int = 1
    """TensorBoard logging interval."""
    val_check_interval: Optional[int] = None
    """Steps between held-out validations (None: once, at the end)."""
    checkpoint_every_n_steps: int = 50
    """Steps between Lightning checkpoints (for resume=auto)."""
    keep_checkpoints: int = 3
    """Lightning checkpoints kept besides last.ckpt, newest first (-1: all); a 7B full fine-tune's are ~100 GB each."""
    snapshot_every_n_steps: int = 0
    """Steps between extra gate snapshots snapshots/step{n} (0: only the CR family and final)."""
    enable_progress_bar: bool = True
    """Show Lightning's progress bar."""


@dataclass
class StrategyConfig:
    """Distribution: one device, DDP, or DeepSpeed ZeRO."""

    name: str = "auto"
    """auto | single | ddp | deepspeed."""
    zero_stage: int = 2
    """DeepSpeed ZeRO stage: 1 | 2 | 3."""
    offload_optimizer: bool = False
    """DeepSpeed: optimizer state on the host."""
    offload_parameters: bool = False
    """DeepSpeed ZeRO-3: parameters on the host."""


@dataclass
class RunConfig:
    """One retrofit run: `python -m train recipe=NAME key=value ...`."""

    recipe: str = DEFAULT_RECIPE
    """The recipe file the run started from (set by the loader)."""
    seed: int = 0
    """Seeds data order, gate noise and initialisation."""
    output_dir: str = "outputs/${recipe}"
    """Run folder: config, TensorBoard logs, resume_state/ (Lightning checkpoints), snapshots/."""
    resume: str = "never"
    """never | auto (continue the run in output_dir) | a checkpoint path."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The backbone and what of it trains."""
    gate: GateConfig = field(default_factory=GateConfig)
    """The gate kind and its settings."""
    data: DataConfig = field(default_factory=DataConfig)
    """Training text and its held-out split."""
    loss: LossConfig = field(default_factory=LossConfig)
    """Distillation and capacity loss weights."""
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    """The compression-ratio ramp."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """AdamW settings."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Lightning Trainer arguments."""
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    """Distribution strategy."""


def load_recipe(name: str = DEFAULT_RECIPE, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Schema <- recipes/NAME.yaml <- overrides, then validated; returns a typed RunConfig."""
    config = load_structured(RunConfig, RECIPES_DIR, name, overrides)
    validate(config)
    return config


def validate(config: RunConfig) -> None:
    """Reject values that parse but cannot work."""
    choice(config.model.backbone_mode, ("frozen", "lora", "full"), "model.backbone_mode")
    choice(config.model.dtype, ("float32", "bfloat16", "float16"), "model.dtype")
    choice(config.gate.kind, tuple(GATE_KINDS), "gate.kind")
    choice(config.data.source, ("gsm_symbolic", "essays", "openr1", "hf", "files", "traces"), "data.source")
    choice(config.data.too_long, ("truncate", "drop"), "data.too_long")
    choice(config.loss.kl_direction, ("forward", "reverse"), "loss.kl_direction")
    choice(config.strategy.name, ("auto", "single", "ddp", "deepspeed"), "strategy.name")
    choice(config.strategy.zero_stage, (1, 2, 3), "strategy.zero_stage")
    choice(config.resume if config.resume in ("never", "auto") else "path", ("never", "auto", "path"), "resume")
    if config.schedule.cr_final < 1:
        raise RecipeError(f"schedule.cr_final={config.schedule.cr_final} is invalid; a compression ratio is >= 1")
    if config.data.max_length < 2:
        raise RecipeError(f"data.max_length={config.data.max_length} is invalid; it must be >= 2")
    if config.trainer.max_steps == 0 or config.trainer.max_steps < -1:
        raise RecipeError(f"trainer.max_steps={config.trainer.max_steps} is invalid; valid: -1 (warm-up + ramp + hold) "
                          "or a step count >= 1")
    if config.data.train_samples == 0 or config.data.train_samples < -1:
        raise RecipeError(f"data.train_samples={config.data.train_samples} is invalid; valid: -1 (all) or >= 1")
    if not isinstance(config.trainer.devices, (int, list, str)) or isinstance(config.trainer.devices, bool) or \
            config.trainer.devices in (0, [], "") or (isinstance(config.trainer.devices, int) and config.trainer.devices < -1):
        raise RecipeError(f"trainer.devices={config.trainer.devices!r} is invalid; valid: a count >= 1, -1 (all), "
                          "a list of device indices, or 'auto'")
    tree = OmegaConf.structured(config)
    _at_least(tree, 1, "data.batch_size", "loss.chunk_tokens", "schedule.steps_per_cr", "trainer.num_nodes",
              "trainer.log_every_n_steps", "trainer.checkpoint_every_n_steps", "data.num_proc")
    _at_least(tree, 0, "data.eval_samples", "data.num_workers", "schedule.hold_steps", "schedule.neuron_warmup_steps",
              "optim.warmup_steps", "optim.weight_decay", "optim.grad_clip", "loss.kl_weight", "loss.ntp_weight",
              "loss.capacity_weight", "trainer.snapshot_every_n_steps")
    if config.trainer.val_check_interval is not None:
        _at_least(tree, 1, "trainer.val_check_interval")
    if config.trainer.global_batch_size is not None:
        _at_least(tree, 1, "trainer.global_batch_size")
        if isinstance(config.trainer.devices, int) and config.trainer.devices >= 1:
            accumulation(config, config.trainer.devices)  # known now; "auto" / -1 are checked when the run starts
    if config.trainer.keep_checkpoints < -1:
        raise RecipeError(f"trainer.keep_checkpoints={config.trainer.keep_checkpoints} is invalid; valid: -1 (keep all), "
                          "0 (only last.ckpt) or a count >= 1")
    if config.loss.temperature <= 0:
        raise RecipeError(f"loss.temperature={config.loss.temperature} is invalid; it must be > 0 (1 leaves the logits as "
                          "they are)")
    if not 0 < config.loss.head_cap <= 1 or config.loss.head_cap_weight < 0:
        raise RecipeError(f"loss.head_cap={config.loss.head_cap} must be within (0, 1] and loss.head_cap_weight="
                          f"{config.loss.head_cap_weight} >= 0")
    if config.optim.lr <= 0:
        raise RecipeError(f"optim.lr={config.optim.lr} is invalid; it must be > 0")
    if len(config.optim.betas) != 2 or not all(0 <= b < 1 for b in config.optim.betas):
        raise RecipeError(f"optim.betas={config.optim.betas} is invalid; two values in [0, 1)")
    try:
        config.gate.selected().validate(prefix=f"gate.{config.gate.kind}.")
    except GateError as err:
        raise RecipeError(str(err)) from None
    if config.gate.kind == "dms" and config.gate.dms.window + 1 >= config.data.max_length:
        raise RecipeError(f"gate.dms.window={config.gate.dms.window} leaves nothing to evict in sequences of "
                          f"data.max_length={config.data.max_length}; valid: window <= {config.data.max_length - 2}")
    if config.gate.kind == "trimkv" and config.gate.trimkv.budget >= config.data.max_length:
        raise RecipeError(f"gate.trimkv.budget={config.gate.trimkv.budget} leaves nothing to evict in sequences of "
                          f"data.max_length={config.data.max_length}; valid: budget <= {config.data.max_length - 1}")


def _at_least(tree, low: int, *keys: str) -> None:
    """Each of the dotted `keys` of the config `tree` must be >= low."""
    for key in keys:
        value = OmegaConf.select(tree, key)
        if value < low:
            raise RecipeError(f"{key}={value} is invalid; it must be >= {low}")


def total_steps(config: RunConfig) -> int:
    if config.trainer.max_steps > 0:
        return config.trainer.max_steps
    s = config.schedule
    return s.neuron_warmup_steps + ramp_steps(config) + s.hold_steps


def ramp_steps(config: RunConfig) -> int:
    return round((config.schedule.cr_final - 1) * config.schedule.steps_per_cr)


def devices_per_node(config: RunConfig) -> int:
    """How many processes `trainer.devices` starts on each node: a count, a list of indices, or what the
    accelerator sees for "auto" / -1 (Lightning's own count)."""
    devices = config.trainer.devices
    if isinstance(devices, str) and devices.strip() not in ("auto", "-1"):
        parts = [p for p in devices.split(",") if p.strip()]
        return int(parts[0]) if len(parts) == 1 and not devices.strip().endswith(",") else len(parts)
    if isinstance(devices, list):
        return len(devices)
    if isinstance(devices, int) and devices >= 1:
        return devices
    from lightning.pytorch.accelerators import CUDAAccelerator

    accelerator = config.trainer.accelerator
    gpu = accelerator == "gpu" or (accelerator == "auto" and CUDAAccelerator.is_available())
    return CUDAAccelerator.auto_device_count() if gpu else 1


def accumulation(config: RunConfig, devices: int) -> int:
    """Micro-batches per optimizer step, so that every optimizer step sees `trainer.global_batch_size`
    sequences whatever the number of devices and nodes."""
    per_pass = devices * config.trainer.num_nodes * config.data.batch_size
    wanted = config.trainer.global_batch_size
    if wanted is None:
        return 1
    if wanted % per_pass:
        low, high = max(per_pass, wanted - wanted % per_pass), wanted - wanted % per_pass + per_pass
        raise RecipeError(f"trainer.global_batch_size={wanted} is not a multiple of devices ({devices}) x "
                          f"trainer.num_nodes ({config.trainer.num_nodes}) x data.batch_size ({config.data.batch_size}) "
                          f"= {per_pass}; valid nearby: {low} or {high}")
    return wanted // per_pass


def to_yaml(config: RunConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(config))
