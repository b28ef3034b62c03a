"""`python -m train`: resolve a recipe, then either validate it (--dry-run) or run the retrofit."""

from __future__ import annotations

import json
import logging
import pickle
from pathlib import Path

import torch

from recipes import RecipeError
from train.config import RunConfig, accumulation, devices_per_node, ramp_steps, to_yaml, total_steps

log = logging.getLogger("retrokv.train")
RESUME_DIR = "resume_state"  # a run's Lightning checkpoints (what resume=auto reads); snapshots/ holds the gates


def architecture_config(cfg: RunConfig):
    """The backbone's transformers config: from the recipe's `model.architecture` when given (no download)."""
    from transformers import AutoConfig

    from models import load_backbone_config

    arch = cfg.model.architecture
    if arch is not None:
        fields = {k: v for k, v in vars(arch).items() if k != "model_type"}
        return AutoConfig.for_model(arch.model_type, **fields)
    return load_backbone_config(cfg.model.backbone)


def check_against_backbone(cfg: RunConfig):
    """What the recipe asks of the backbone's architecture, checked before a dry run and before every real run
    (no weights are loaded). Returns the backbone's config."""
    from models import GateError
    from models.gating import check_architecture

    config = architecture_config(cfg)
    try:
        check_architecture(config)
    except GateError as err:
        raise RecipeError(f"model.backbone={cfg.model.backbone!r}: {err}") from None
    if cfg.data.max_length > getattr(config, "max_position_embeddings", cfg.data.max_length):
        raise RecipeError(f"data.max_length={cfg.data.max_length} exceeds the backbone's "
                          f"max_position_embeddings={config.max_position_embeddings}")
    return config


def dry_run(cfg: RunConfig) -> dict:
    """Validate a recipe against the architecture without weights: gates are attached to a meta-device model."""
    from transformers import AutoModelForCausalLM

    import models
    from models.attention import GATE_ATTRIBUTE
    from train.strategy import build_strategy

    config = check_against_backbone(cfg)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    models.attach_gates(model, cfg.gate.kind, **cfg.gate.settings())
    gate_params = sum(p.numel() for n, p in model.named_parameters() if GATE_ATTRIBUTE in n)
    backbone_params = sum(p.numel() for n, p in model.named_parameters() if GATE_ATTRIBUTE not in n)
    # what gets gradients and optimizer state: the gates, and the backbone when fully fine-tuned (LoRA
    # adapters are small and left out of the estimate)
    trained_params = gate_params + (backbone_params if cfg.model.backbone_mode == "full" else 0)
    devices = devices_per_node(cfg)
    neurons = sum(len(gate.neuron_indices) for gate in models.model_gates(model))
    anneals = models.gate_kind(cfg.gate.kind).anneals_cr
    strategy = build_strategy(cfg, cfg.trainer.accelerator)
    report = {
        "recipe": cfg.recipe,
        "backbone": cfg.model.backbone,
        "family": config.model_type,
        "layers": config.num_hidden_layers,
        "query_heads": config.num_attention_heads,
        "kv_heads": config.num_key_value_heads,
        "backbone_parameters": backbone_params,
        "gate": cfg.gate.kind,
        "gate_parameters": gate_params,
        "repurposed_query_neurons": neurons,
        "gate_settings": cfg.gate.settings(),
        "backbone_mode": cfg.model.backbone_mode,
        "strategy": strategy if isinstance(strategy, str) else type(strategy).__name__,
        "zero_stage": cfg.strategy.zero_stage if cfg.strategy.name == "deepspeed" else None,
        "devices_per_node": cfg.trainer.devices,
        "num_nodes": cfg.trainer.num_nodes,
        "precision": cfg.trainer.precision,
        "steps": total_steps(cfg),
        "cr_ramp_steps": ramp_steps(cfg) if anneals else None,
        "cr_family": list(range(2, int(cfg.schedule.cr_final) + 1)) if anneals else None,
        **batch_figures(cfg, devices),
        "memory_per_rank": memory_per_rank(cfg, params_total=backbone_params, params_trained=trained_params,
                                           ranks=devices * cfg.trainer.num_nodes),
    }
    return report


def batch_figures(cfg: RunConfig, devices: int) -> dict:
    """What one optimizer step processes, over all devices and nodes."""
    ranks = devices * cfg.trainer.num_nodes
    accumulate = accumulation(cfg, devices)
    sequences = ranks * cfg.data.batch_size * accumulate
    return {"ranks": ranks, "micro_batch_per_rank": cfg.data.batch_size, "accumulate_grad_batches": accumulate,
            "global_batch_sequences": sequences, "tokens_per_step": sequences * cfg.data.max_length}


def memory_per_rank(cfg: RunConfig, params_total: int, params_trained: int, ranks: int) -> dict:
    """Model-state memory of one rank in GB (activations excluded), by the ZeRO paper's accounting.

    Weights take the backbone dtype's bytes (b); a trained parameter adds a gradient (b) and AdamW state:
    two float32 moments, plus a float32 master copy when b < 4. ZeRO-1 partitions the optimizer state over
    the ranks, ZeRO-2 also the gradients, ZeRO-3 also the weights; DDP partitions nothing. A full
    fine-tune's teacher is a separate frozen copy (b per parameter), partitioned like the weights under ZeRO-3.
    """
    b = {"float32": 4, "bfloat16": 2, "float16": 2}[cfg.model.dtype]
    optimizer_bytes = 8 + (4 if b < 4 else 0)
    stage = cfg.strategy.zero_stage if cfg.strategy.name == "deepspeed" else 0
    split = lambda level: ranks if stage >= level else 1  # noqa: E731
    weights = params_total * b / split(3)
    gradients = params_trained * b / split(2)
    optimizer = 0 if cfg.strategy.offload_optimizer and stage else params_trained * optimizer_bytes / split(1)
    teacher = params_total * b / split(3) if cfg.model.backbone_mode == "full" else 0
    gb = lambda n: round(n / 1e9, 2)  # noqa: E731
    return {"weights_gb": gb(weights), "gradients_gb": gb(gradients), "optimizer_gb": gb(optimizer),
            "teacher_gb": gb(teacher), "total_gb": gb(weights + gradients + optimizer + teacher),
            "note": "model states only; activations, buffers and fragmentation come on top"}


def retrofit_data(cfg: RunConfig, tokenizer):
    """The run's data module over the shared RetroKV cache (training and --prepare-data alike)."""
    from assets import cache_root
    from data import RetrofitDataModule

    return RetrofitDataModule(cfg.data, tokenizer, cfg.seed, cache_root() / "data")


def prepare_data(cfg: RunConfig) -> dict:
    """Prepare the recipe's data into the shared cache, as a run's first process would, and say where."""
    from models import load_tokenizer

    module = retrofit_data(cfg, load_tokenizer(cfg.model.backbone))
    prepared = module.prepare_once()
    module.setup()
    return {"folder": str(module.cache_dir / module.cache_key()), "prepared_now": prepared,
            "train_sequences": len(module.train_set), "eval_sequences": len(module.eval_set or [])}


# what a resumed run may change: how long it runs and how it reports, never what it computes
RESUMABLE_CHANGES = ("resume", "output_dir", "trainer.max_steps", "trainer.log_every_n_steps", "trainer.enable_progress_bar",
                     "trainer.val_check_interval", "trainer.checkpoint_every_n_steps", "trainer.keep_checkpoints",
                     "trainer.snapshot_every_n_steps", "data.num_workers", "data.num_proc")


def _check_output_dir(cfg: RunConfig) -> str | None:
    """The checkpoint to resume from, or None; refuses to overwrite an earlier run silently."""
    out = Path(cfg.output_dir)
    last = out / RESUME_DIR / "last.ckpt"
    # a DeepSpeed checkpoint is a folder named like the file of the other strategies
    if cfg.resume == "auto":
        if not last.exists():
            return None
        _check_resumed_config(cfg, out / "config.yaml")
        return _intact_checkpoint(last)
    if cfg.resume != "never":
        if not Path(cfg.resume).exists():
            raise RecipeError(f"resume={cfg.resume!r}: no such checkpoint; valid: never, auto, or a .ckpt path")
        return cfg.resume
    if last.exists():
        raise RecipeError(f"output_dir={str(out)!r} already holds a run ({last}); pass resume=auto to continue it, "
                          "or choose another output_dir")
    return None


def _check_resumed_config(cfg: RunConfig, saved: Path) -> None:
    """A resumed run continues the run it resumes: only RESUMABLE_CHANGES may differ from its config."""
    from omegaconf import OmegaConf

    if not saved.is_file():
        return
    before = _flatten(OmegaConf.to_container(OmegaConf.load(saved)))
    now = _flatten(OmegaConf.to_container(OmegaConf.create(to_yaml(cfg))))
    changed = sorted(k for k in before.keys() | now.keys()
                     if before.get(k) != now.get(k) and k not in RESUMABLE_CHANGES)
    if changed:
        shown = "; ".join(f"{k}: {before.get(k)!r} -> {now.get(k)!r}" for k in changed[:8])
        raise RecipeError(f"resume=auto would continue {saved.parent} with a different config ({shown}); only "
                          f"{', '.join(RESUMABLE_CHANGES[2:])} may change. Use the run's own settings, or a new output_dir")


def _flatten(tree, prefix: str = "") -> dict:
    if not isinstance(tree, dict):
        return {prefix[:-1]: tree}
    flat = {}
    for key, value in tree.items():
        flat.update(_flatten(value, f"{prefix}{key}."))
    return flat


def _intact_checkpoint(last: Path) -> str:
    """`last` when it is a readable checkpoint, else the newest intact step checkpoint beside it (named in
    the log); a corrupt file is never loaded. DeepSpeed checkpoints are folders, checked by DeepSpeed."""
    if last.is_dir() or _readable(last):
        return str(last)
    for candidate in sorted(last.parent.glob("step*.ckpt"), reverse=True):
        if candidate.is_file() and _readable(candidate):
            log.warning("%s is corrupt (truncated, empty or not a checkpoint); resuming from %s instead", last, candidate)
            return str(candidate)
    raise RecipeError(f"{last} is corrupt (truncated, empty or not a checkpoint) and no intact step*.ckpt is left in "
                      f"{last.parent}; delete the folder to start over, or pass resume=PATH to another checkpoint")


def _readable(path: Path) -> bool:
    """A torch checkpoint is a zip archive whose directory sits at its end: truncation or garbage breaks it."""
    import zipfile

    try:
        with zipfile.ZipFile(path) as archive:
            return bool(archive.namelist())
    except (zipfile.BadZipFile, OSError):
        return False


def train(cfg: RunConfig) -> dict:
    import lightning as L
    from lightning.pytorch.callbacks import LearningRateMonitor
    from lightning.pytorch.loggers import TensorBoardLogger

    from models import load_tokenizer
    from train.callbacks import AtomicModelCheckpoint, CRFamilySnapshots
    from train.launch import adopt_launcher_environment
    from train.module import RetrofitModule
    from train.strategy import build_strategy

    devices = devices_per_node(cfg)
    adopt_launcher_environment(devices, cfg.trainer.num_nodes)  # before Lightning reads the environment
    accumulate = accumulation(cfg, devices)
    ckpt = _check_output_dir(cfg)
    check_against_backbone(cfg)
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    if not (out / "config.yaml").is_file() or ckpt is None:
        (out / "config.yaml").write_text(to_yaml(cfg))  # a resumed run keeps the config it started with
    L.seed_everything(cfg.seed, workers=True)
    tokenizer = load_tokenizer(cfg.model.backbone)
    module = RetrofitModule(cfg)  # the models are built on each rank's device (RetrofitModule.configure_model)
    datamodule = retrofit_data(cfg, tokenizer)
    t = cfg.trainer
    trainer = L.Trainer(
        max_steps=total_steps(cfg),
        accelerator=t.accelerator,
        devices=t.devices,
        num_nodes=t.num_nodes,
        precision=t.precision,
        strategy=build_strategy(cfg, t.accelerator),
        accumulate_grad_batches=accumulate,
        gradient_clip_val=cfg.optim.grad_clip if cfg.strategy.name != "deepspeed" else None,
        log_every_n_steps=t.log_every_n_steps,
        val_check_interval=t.val_check_interval or total_steps(cfg),
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        logger=TensorBoardLogger(save_dir=str(out), name="tensorboard", version=""),
        callbacks=[
            # the newest `keep_checkpoints` by step (Lightning's way to keep the last K), plus last.ckpt
            AtomicModelCheckpoint(dirpath=out / RESUME_DIR, every_n_train_steps=t.checkpoint_every_n_steps,
                                  save_last=True, save_top_k=t.keep_checkpoints, monitor="step", mode="max",
                                  filename="step{step:06d}", auto_insert_metric_name=False),
            CRFamilySnapshots(out, every=t.snapshot_every_n_steps),
            LearningRateMonitor(logging_interval="step"),
        ],
        enable_progress_bar=t.enable_progress_bar,
        use_distributed_sampler=False,  # data.StepSampler strides ranks itself, deterministically
        default_root_dir=str(out),
    )
    try:
        # explicit weights_only: safety must not depend on torch's default or TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD
        trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt, weights_only=True)
    except pickle.UnpicklingError:
        raise RecipeError(f"{ckpt} holds objects other than tensors and plain data, which RetroKV never writes; it was "
                          "not loaded (loading it could run code). Resume from a checkpoint this run wrote") from None
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    summary = {"recipe": cfg.recipe, "steps": trainer.global_step, "output_dir": str(out), **metrics,
               "gates_last_step": module.last_gate_table}
    if trainer.is_global_zero:
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
