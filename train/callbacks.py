"""Training callbacks: atomic Lightning checkpoints, and gate snapshots: at every integer CR reached (the
CR family), every `trainer.snapshot_every_n_steps` steps if set, and at the end."""

from __future__ import annotations

import math
import os
from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DeepSpeedStrategy
from omegaconf import OmegaConf

from checkpoints import SnapshotMeta, recover_snapshots, save_snapshot, trained_tensors
from models import gate_kind
from train.schedule import schedule_at


def snapshot_meta(cfg, step: int, cr: float, fingerprint: str | None = None) -> SnapshotMeta:
    return SnapshotMeta(
        backbone=cfg.model.backbone, gate_kind=cfg.gate.kind, gate_settings=cfg.gate.settings(),
        backbone_mode=cfg.model.backbone_mode, dtype=cfg.model.dtype,
        lora=cfg.model.lora_settings(),
        cr=cr, step=step, recipe=cfg.recipe, config=OmegaConf.to_container(OmegaConf.structured(cfg)),
        backbone_fingerprint=fingerprint)


class CRFamilySnapshots(L.Callback):
    """Writes snapshots/cr{k} when the CR schedule first reaches integer k, snapshots/step{n} every `every`
    steps (0: never; kinds without a CR schedule, such as TRIM-KV, use it), and snapshots/final at the end."""

    def __init__(self, output_dir: str | Path, every: int = 0):
        self.root = Path(output_dir) / "snapshots"
        self.every = every

    def on_fit_start(self, trainer, module):
        if trainer.is_global_zero and self.root.is_dir():
            recover_snapshots(self.root)  # a run killed while replacing a snapshot left it aside

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step == 0 or (batch_idx + 1) % trainer.accumulate_grad_batches:
            return
        cfg = module.cfg
        done = trainer.global_step  # optimizer steps completed; the last one trained against CR(done - 1)
        previous = schedule_at(done - 2, cfg.schedule).cr if done >= 2 else 1.0
        current = schedule_at(done - 1, cfg.schedule).cr
        crossed = [k for k in range(2, math.floor(current + 1e-9) + 1) if previous + 1e-9 < k <= current + 1e-9]
        if gate_kind(cfg.gate.kind).anneals_cr:
            for k in crossed:
                self._save(trainer, module, f"cr{k}", float(k))
        if self.every and done % self.every == 0:
            self._save(trainer, module, f"step{done:06d}", current)

    def on_train_end(self, trainer, module):
        self._save(trainer, module, "final", schedule_at(max(trainer.global_step - 1, 0), module.cfg.schedule).cr)

    def _save(self, trainer, module, name: str, cr: float) -> None:
        # every rank takes part in gathering ZeRO-3 partitions; only the writing rank keeps a copy
        tensors = trained_tensors(module.model, keep=trainer.is_global_zero)
        if trainer.is_global_zero:
            fingerprint = module.model.config.retrokv.get("backbone_fingerprint")
            save_snapshot(tensors, self.root / name, snapshot_meta(module.cfg, trainer.global_step, cr, fingerprint))


class AtomicModelCheckpoint(ModelCheckpoint):
    """Writes each checkpoint under a temporary name and renames it into place, so a run killed while
    writing leaves the previous `last.ckpt` intact for `resume=auto`. DeepSpeed checkpoints are folders
    that DeepSpeed commits itself (its `latest` tag is written last), so they go through unchanged."""

    def _save_checkpoint(self, trainer, filepath: str) -> None:
        if isinstance(trainer.strategy, DeepSpeedStrategy):
            return super()._save_checkpoint(trainer, filepath)
        partial = f"{filepath}.partial"
        super()._save_checkpoint(trainer, partial)
        if trainer.is_global_zero:
            os.replace(partial, filepath)
        self._last_checkpoint_saved = filepath
        trainer.strategy.barrier("atomic-checkpoint")
