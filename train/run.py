"""`python -m train`: resolve a recipe, then either validate it (--dry-run) or run the retrofit."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from recipes import RecipeError
from train.config import RunConfig, ramp_steps, to_yaml, total_steps

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


def dry_run(cfg: RunConfig) -> dict:
    """Validate a recipe against the architecture without weights: gates are attached to a meta-device model."""
    from transformers import AutoModelForCausalLM

    import models
    from train.strategy import build_strategy

    config = architecture_config(cfg)
    models.gating.check_architecture(config)
    if cfg.data.max_length > getattr(config, "max_position_embeddings", cfg.data.max_length):
        raise RecipeError(f"data.max_length={cfg.data.max_length} exceeds the backbone's "
                          f"max_position_embeddings={config.max_position_embeddings}")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    models.attach_gates(model, cfg.gate.kind, **cfg.gate.settings())
    gate_params = sum(p.numel() for n, p in model.named_parameters() if "kv_gate" in n)
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
        "backbone_parameters": sum(p.numel() for n, p in model.named_parameters() if "kv_gate" not in n),
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
        "tokens_per_step": cfg.data.max_length * cfg.data.batch_size * cfg.trainer.accumulate_grad_batches,
    }
    return report


def _check_output_dir(cfg: RunConfig) -> str | None:
    """The checkpoint to resume from, or None; refuses to overwrite an earlier run silently."""
    out = Path(cfg.output_dir)
    last = out / RESUME_DIR / "last.ckpt"
    # a DeepSpeed checkpoint is a folder named like the file of the other strategies
    if cfg.resume == "auto":
        return str(last) if last.exists() else None
    if cfg.resume != "never":
        if not Path(cfg.resume).exists():
            raise RecipeError(f"resume={cfg.resume!r}: no such checkpoint; valid: never, auto, or a .ckpt path")
        return cfg.resume
    if last.exists():
        raise RecipeError(f"output_dir={str(out)!r} already holds a run ({last}); pass resume=auto to continue it, "
                          "or choose another output_dir")
    return None


def train(cfg: RunConfig) -> dict:
    import lightning as L
    from lightning.pytorch.callbacks import LearningRateMonitor
    from lightning.pytorch.loggers import TensorBoardLogger

    from assets import cache_root
    from data import RetrofitDataModule
    from train.callbacks import AtomicModelCheckpoint, CRFamilySnapshots
    from train.module import RetrofitModule, build_gated_model
    from train.strategy import build_strategy

    ckpt = _check_output_dir(cfg)
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(to_yaml(cfg))
    L.seed_everything(cfg.seed, workers=True)
    model, tokenizer = build_gated_model(cfg)
    teacher = None
    if cfg.model.backbone_mode == "full":
        import models

        teacher = models.load_backbone(cfg.model.backbone, dtype=cfg.model.dtype)[0].requires_grad_(False)
    module = RetrofitModule(cfg, model=model, teacher=teacher)
    datamodule = RetrofitDataModule(cfg.data, tokenizer, cfg.seed, cache_root() / "data")
    t = cfg.trainer
    trainer = L.Trainer(
        max_steps=total_steps(cfg),
        accelerator=t.accelerator,
        devices=t.devices,
        num_nodes=t.num_nodes,
        precision=t.precision,
        strategy=build_strategy(cfg, t.accelerator),
        accumulate_grad_batches=t.accumulate_grad_batches,
        gradient_clip_val=cfg.optim.grad_clip if cfg.strategy.name != "deepspeed" else None,
        log_every_n_steps=t.log_every_n_steps,
        val_check_interval=t.val_check_interval or total_steps(cfg),
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        logger=TensorBoardLogger(save_dir=str(out), name="tensorboard", version=""),
        callbacks=[
            AtomicModelCheckpoint(dirpath=out / RESUME_DIR, every_n_train_steps=t.checkpoint_every_n_steps,
                            save_last=True, save_top_k=-1, filename="step{step:06d}", auto_insert_metric_name=False),
            CRFamilySnapshots(out),
            LearningRateMonitor(logging_interval="step"),
        ],
        enable_progress_bar=t.enable_progress_bar,
        use_distributed_sampler=False,  # data.StepSampler strides ranks itself, deterministically
        default_root_dir=str(out),
    )
    trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    summary = {"recipe": cfg.recipe, "steps": trainer.global_step, "output_dir": str(out), **metrics,
               "gates_last_step": module.last_gate_table}
    if trainer.is_global_zero:
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
