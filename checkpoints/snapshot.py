"""Gate snapshots: what a retrofit trained (gates, LoRA, DMS neuron rows) plus how to rebuild the model.

A snapshot folder holds `retrokv.json` (backbone, gate kind and settings, backbone mode, CR, step, the
run config) and `trainable.safetensors`. It is written to a temporary folder and renamed into place, so
a killed run never leaves half a snapshot.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

META = "retrokv.json"
WEIGHTS = "trainable.safetensors"


class SnapshotError(ValueError):
    """A snapshot folder that is missing, incomplete or corrupt."""


def trained_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The trainable parameters as full CPU tensors. Under DeepSpeed ZeRO-3 they are partitioned, so they
    are gathered first: a collective, so every rank must call this, even if only one writes."""
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if any(hasattr(p, "ds_id") for _, p in params):
        import deepspeed

        with deepspeed.zero.GatheredParameters([p for _, p in params], modifier_rank=None):
            return {n: p.detach().to("cpu").clone() for n, p in params}
    return {n: p.detach().to("cpu").contiguous() for n, p in params}


def save_snapshot(tensors: dict[str, torch.Tensor], folder: str | Path, meta: dict) -> Path:
    """Write `tensors` (see trained_tensors) and `meta` as a snapshot folder, atomically."""
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    try:
        save_file(tensors, str(staging / WEIGHTS))
        (staging / META).write_text(json.dumps(meta, indent=2, sort_keys=True, default=str))
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(staging, folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


def read_meta(folder: str | Path) -> dict:
    path = Path(folder) / META
    if not path.is_file():
        raise SnapshotError(f"{folder} is not a RetroKV snapshot: {META} is missing")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise SnapshotError(f"{path} is corrupt: {err}") from None


def load_snapshot(folder: str | Path, dtype: str | None = None, device: str = "cpu"):
    """Rebuild backbone + gates (+ LoRA) and load the trained tensors. Returns (model, tokenizer, meta)."""
    import models
    from models.trainable import configure_backbone

    meta = read_meta(folder)
    model, tokenizer = models.load_backbone(meta["backbone"], dtype=dtype or meta.get("dtype", "float32"), device=device)
    # snapshots written before attention sinks existed were trained (and are served) without them
    models.attach_gates(model, meta["gate_kind"], **{"sinks": 0, **meta["gate_settings"]})
    model = configure_backbone(model, meta["backbone_mode"], lora=meta.get("lora"))
    try:
        tensors = load_file(str(Path(folder) / WEIGHTS), device=device)
    except Exception as err:  # safetensors raises several types for truncated or garbled files
        raise SnapshotError(f"{Path(folder) / WEIGHTS} is corrupt or missing: {err}") from None
    params = dict(model.named_parameters())
    unknown = sorted(set(tensors) - set(params))
    if unknown:
        raise SnapshotError(f"{folder} holds tensors this model does not have, e.g. {unknown[:3]}")
    with torch.no_grad():
        for name, value in tensors.items():
            if params[name].shape != value.shape:
                raise SnapshotError(f"{folder}: {name} has shape {tuple(value.shape)}, model expects {tuple(params[name].shape)}")
            params[name].copy_(value.to(params[name].dtype))
    model.requires_grad_(False)
    return model.eval(), tokenizer, meta


def list_snapshots(run_dir: str | Path) -> list[tuple[Path, dict]]:
    """A run's CR family, sorted by CR."""
    found = [(p.parent, read_meta(p.parent)) for p in sorted(Path(run_dir).glob(f"snapshots/*/{META}"))]
    return sorted(found, key=lambda item: (item[1].get("cr", 0), item[1].get("step", 0)))
