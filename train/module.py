"""The retrofit LightningModule: teacher pass (same weights, gates off), student pass (gates training),
distillation + capacity loss under an annealed compression ratio."""

from __future__ import annotations

import contextlib
import functools
import math
import time

import lightning as L
import torch

import models
from models.gates import GateMode, gate_kind
from models.trainable import trainable_parameters
from train.config import RunConfig
from train.errors import NonFiniteLossError
from train.losses import chunked_distillation
from train.schedule import schedule_at
from train.strategy import zero3_inference_engine, zero3_loading


def build_gated_model(cfg: RunConfig, device: torch.device | str = "cpu"):
    """Backbone + gates + trainable set, as the recipe says, on `device`. Returns (model, tokenizer)."""
    return models.build_gated_model(cfg.model.backbone, cfg.gate.kind, cfg.gate.settings(), dtype=cfg.model.dtype,
                                    device=device,
                                    backbone_mode=cfg.model.backbone_mode, lora=cfg.model.lora_settings(),
                                    activation_checkpointing=cfg.model.activation_checkpointing)


def causal_lm_parts(model):
    """(decoder, lm_head) of a causal LM, also under a peft wrapper."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.get_decoder(), base.get_output_embeddings()


class RetrofitModule(L.LightningModule):
    def __init__(self, cfg: RunConfig):
        super().__init__()
        self.cfg = cfg
        self.model = None  # built by configure_model, once this rank's device is known
        # a full fine-tune changes the backbone, so the teacher is a separate frozen copy kept outside the
        # module's parameters (and so outside the student's DeepSpeed engine)
        self._teacher: list = []  # (a list: not a submodule, so no engine or checkpoint of the student owns it)
        self._teacher_engine: list = []  # under ZeRO-3: the DeepSpeed engine that gathers the teacher's partitions
        self.kind = gate_kind(cfg.gate.kind)
        self._base_tau = getattr(cfg.gate.selected(), "tau", None)  # a kind with a temperature anneals it
        self._tokens_seen = 0
        self._clock = None
        self.last_gate_table: dict[str, list] = {}  # per (layer, KV head) statistics of the last step, for summary.json

    def configure_model(self) -> None:
        """Build the student (and a full fine-tune's teacher) on this rank's device.

        Lightning calls this on every rank once the device and process group exist, so the weights are read
        straight onto the rank's device (a GPU rank holds no host copy), and under DeepSpeed ZeRO-3, where
        Lightning's zero.Init context is active here, they are partitioned as they load: each rank holds its
        share of the student and of the teacher. It builds once (Lightning may call it again).
        """
        if self.model is not None:
            return
        strategy = self._trainer.strategy if self._trainer is not None else None
        zero3 = getattr(strategy, "zero_stage_3", False)
        device = None if zero3 else (strategy.root_device if strategy is not None else torch.device("cpu"))
        torch.manual_seed(self.cfg.seed)  # gate initialisation does not depend on what ran before this hook
        with zero3_loading(strategy.config if zero3 else None):
            self.model = build_gated_model(self.cfg, device)[0]
            if self.cfg.model.backbone_mode == "full":
                teacher = models.load_backbone(self.cfg.model.backbone, dtype=self.cfg.model.dtype, device=device)[0]
                teacher.requires_grad_(False)
                if zero3:
                    self._teacher_engine = [zero3_inference_engine(teacher, strategy.config)]
                self._teacher = [teacher]
        self.model.train()  # backbones load in eval mode; dropout settings are the model config's
        self.gate_state = models.gate_state(self.model)

    # ---- forward passes -------------------------------------------------------------------------
    def _hidden(self, model, batch):
        decoder, _ = causal_lm_parts(model)
        return decoder(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).last_hidden_state

    def teacher_hidden(self, batch) -> torch.Tensor:
        with torch.no_grad():
            if self._teacher:
                return self._hidden(self._teacher[0], batch)
            with models.gate_mode(self.model, GateMode.OFF), self._adapters_off():
                return self._hidden(self.model, batch)

    def _adapters_off(self):
        return self.model.disable_adapter() if hasattr(self.model, "disable_adapter") else contextlib.nullcontext()

    def losses(self, batch, step: int, micro_batch: int = 0, mode: GateMode = GateMode.TRAIN) -> dict[str, torch.Tensor]:
        cfg = self.cfg
        sched = schedule_at(step, cfg.schedule, self._base_tau)
        state = self.gate_state
        state.step, state.neuron_keep, state.tau = step, sched.neuron_keep, sched.tau
        state.noise_seed = cfg.seed
        rows = batch["input_ids"].shape[0]
        state.row_offset = (micro_batch * self.trainer_world_size + self.global_rank) * rows
        teacher = self.teacher_hidden(batch)
        with models.gate_mode(self.model, mode):
            student = self._hidden(self.model, batch)
            outputs = models.gate_outputs(self.model)
            per_layer = models.gate_statistics(self.model, batch["attention_mask"])
        _, head = causal_lm_parts(self.model)
        teacher_head = causal_lm_parts(self._teacher[0])[1] if self._teacher else None
        mask = batch["loss_mask"] * batch["attention_mask"]
        kl, nll = chunked_distillation(head, student, teacher, mask, batch["input_ids"], cfg.loss.kl_direction,
                                       cfg.loss.temperature, cfg.loss.chunk_tokens, teacher_head=teacher_head)
        out = {"kl": kl, "nll": nll, "cr_target": torch.tensor(sched.cr)}
        out.update(self.kind.capacity_terms(outputs, batch["attention_mask"], cfg.gate.selected(),
                                            sched.eviction_target, cfg.loss))
        out["loss"] = cfg.loss.kl_weight * kl + cfg.loss.ntp_weight * nll + cfg.loss.capacity_weight * out["capacity"]
        if "head_cap" in out:
            out["loss"] = out["loss"] + cfg.loss.head_cap_weight * out["head_cap"]
        out.update(self.kind.table_statistics(per_layer))
        out["per_layer"] = per_layer
        return out

    # ---- Lightning hooks ------------------------------------------------------------------------
    def training_step(self, batch, batch_idx):
        if self._clock is None:
            self._clock = time.perf_counter()
        micro = batch_idx % self.trainer.accumulate_grad_batches
        out = self.losses(batch, self.global_step, micro)
        self._stop_if_not_finite(out)
        self._tokens_seen += int(batch["attention_mask"].sum())
        elapsed = max(time.perf_counter() - self._clock, 1e-9)
        bar = {"loss": out["loss"], "kl": out["kl"], "cr": out["cr_target"]}
        if "evict_fraction" in out:
            bar["evict"] = out["evict_fraction"]
        # averaged over ranks, so a DDP run logs the loss of its global batch, as one process would
        self.log_dict({f"train/{k}": v for k, v in bar.items()}, prog_bar=True, on_step=True,
                      batch_size=batch["input_ids"].shape[0], sync_dist=self.trainer_world_size > 1)
        extra = {"train/capacity": out["capacity"], "train/nll": out["nll"], "train/tokens_per_s": self._tokens_seen / elapsed}
        for key in ("evict_target", "occupancy", "uncertain", "saturated_heads", "head_cap"):
            if key in out:
                extra[f"train/{key}"] = out[key]
        for name, table in out["per_layer"].items():
            for layer, value in enumerate(table.mean(-1)):
                extra[f"layers/{name}_{layer:02d}"] = value
        self.log_dict(extra, on_step=True, batch_size=batch["input_ids"].shape[0])
        self._log_histograms(out["per_layer"])
        self.last_gate_table = {name: table.tolist() for name, table in out["per_layer"].items()}
        return out["loss"]

    def _stop_if_not_finite(self, out: dict) -> None:
        """A non-finite loss stops the run before it reaches the weights (every rank agrees first)."""
        finite = bool(torch.isfinite(out["loss"]))
        if self._trainer is not None:
            finite = self.trainer.strategy.reduce_boolean_decision(finite, all=True)
        if finite:
            return
        terms = {k: float(out[k].detach()) for k in ("kl", "nll", "capacity", "head_cap") if k in out}
        bad = [k for k, v in terms.items() if not math.isfinite(v)] or ["loss (on another rank)"]
        raise NonFiniteLossError(f"step {self.global_step}: the loss is not finite ({', '.join(bad)}; "
                                 f"{', '.join(f'{k}={v:.4g}' for k, v in terms.items())}); the run stops before the "
                                 "weights change, and no snapshot is written from this step. Check loss.temperature, "
                                 "optim.lr and the data")

    def _log_histograms(self, per_layer):
        logger = self.logger
        every = max(self.trainer.log_every_n_steps * 10, 1)
        if logger is None or not hasattr(logger.experiment, "add_histogram") or self.global_step % every:
            return
        for name, table in per_layer.items():
            logger.experiment.add_histogram(f"gates/{name}", table.float().flatten(), self.global_step)

    def validation_step(self, batch, batch_idx):
        """Held-out KL with hard decisions: what inference will do."""
        out = self.losses(batch, self.global_step, mode=GateMode.INFER)
        size = batch["input_ids"].shape[0]
        self.log("val/kl", out["kl"], batch_size=size, sync_dist=True)
        self.log("val/loss", out["loss"], batch_size=size, sync_dist=True)

    def configure_optimizers(self):
        opt = self.cfg.optim
        params = trainable_parameters(self.model)
        optimizer_cls = torch.optim.AdamW
        if self.cfg.strategy.name == "deepspeed" and self.cfg.strategy.offload_optimizer:
            # ZeRO-Offload steps on the host; DeepSpeed refuses a client torch optimizer (compiled on first use)
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            optimizer_cls = functools.partial(DeepSpeedCPUAdam, adamw_mode=True)
        optimizer = optimizer_cls(params, lr=opt.lr, betas=tuple(opt.betas), weight_decay=opt.weight_decay)
        warmup = opt.warmup_steps
        lam = (lambda s: min(1.0, (s + 1) / warmup)) if warmup > 0 else (lambda s: 1.0)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lam)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def state_dict(self, *args, **kwargs):
        """Checkpoints hold only what trains: gates (+ LoRA / neuron rows), not a frozen backbone copy."""
        full = super().state_dict(*args, **kwargs)
        if self.cfg.model.backbone_mode == "full":
            return full
        trainable = {f"model.{n}" for n, p in self.model.named_parameters() if p.requires_grad}
        return {k: v for k, v in full.items() if k in trainable}

    def load_state_dict(self, state_dict, strict: bool = True, **kwargs):
        return super().load_state_dict(state_dict, strict=self.cfg.model.backbone_mode == "full" and strict, **kwargs)

    @property
    def trainer_world_size(self) -> int:
        return self.trainer.world_size if self._trainer is not None else 1

