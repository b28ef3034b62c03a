"""Gate snapshots: what a retrofit trained (gates, LoRA, DMS neuron rows) plus how to rebuild the model.

A snapshot folder holds `retrokv.json` (backbone, gate kind and settings, backbone mode, CR, step, the
run config) and `trainable.safetensors`, or, past `max_shard_size` (a full fine-tune), shards
`trainable-0000K-of-0000N.safetensors` with `trainable.safetensors.index.json`. It is written to a temporary
folder and renamed into place, so a killed run never leaves half a snapshot.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Optional

import torch
from huggingface_hub import save_torch_state_dict
from safetensors.torch import load_file

META = "retrokv.json"
WEIGHTS = "trainable.safetensors"  # one file; shards follow huggingface_hub's pattern with an index beside it
WEIGHTS_INDEX = f"{WEIGHTS}.index.json"
SHARD_SIZE = "5GB"


class SnapshotError(ValueError):
    """A snapshot folder that is missing, incomplete or corrupt."""


@dataclasses.dataclass
class SnapshotMeta:
    """What `retrokv.json` holds: how to rebuild the gated model, and where it came from."""

    backbone: str
    """The backbone the gates were trained on (the embedded name, a Hub id or a folder)."""
    gate_kind: str
    """A registered gate kind (models.GATE_KINDS)."""
    gate_settings: dict
    """The kind's settings, as attach_gates takes them."""
    backbone_mode: str = "frozen"
    """frozen | lora | full: which backbone tensors the snapshot holds besides the gates."""
    dtype: str = "float32"
    """The backbone dtype the run trained in (the default when loading)."""
    lora: Optional[dict] = None
    """peft LoRA settings when backbone_mode is lora."""
    cr: float = 1.0
    """The compression ratio the schedule had reached when the snapshot was written."""
    step: int = 0
    """Optimizer steps completed."""
    recipe: str = ""
    """The training recipe's name."""
    config: dict = dataclasses.field(default_factory=dict)
    """The whole resolved run config (provenance; its data section names the held-out split)."""
    backbone_fingerprint: Optional[str] = None
    """models.fingerprint.weights_fingerprint of the base weights; loading checks it when present."""

    @classmethod
    def from_json(cls, values: Any, source: str | Path) -> "SnapshotMeta":
        """Typed metadata from a parsed retrokv.json, naming `source` and the bad key when it does not fit."""
        from models import GateError
        from models.gating import make_settings

        if not isinstance(values, dict):
            raise SnapshotError(f"{source} holds a JSON {type(values).__name__}, not the snapshot metadata object")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        required = [n for n, f in fields.items() if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        missing = [n for n in required if n not in values]
        if missing:
            raise SnapshotError(f"{source} lacks {missing}; a snapshot records {sorted(fields)}")
        known = {k: v for k, v in values.items() if k in fields}
        for name, value in known.items():
            expected = _JSON_TYPES[name]
            if value is not None and not isinstance(value, expected) or (value is None and name not in _OPTIONAL):
                raise SnapshotError(f"{source}: {name}={value!r} is invalid; expected {_type_names(expected)}")
        settings = {"sinks": 0, **known["gate_settings"]}  # written before attention sinks existed: none
        try:
            make_settings(known["gate_kind"], **settings).validate(prefix=f"{known['gate_kind']} ")
        except GateError as err:
            raise SnapshotError(f"{source}: {err}") from None
        return cls(**{**known, "gate_settings": settings})

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


_JSON_TYPES = {"backbone": str, "gate_kind": str, "gate_settings": dict, "backbone_mode": str, "dtype": str,
               "lora": dict, "cr": (int, float), "step": int, "recipe": str, "config": dict,
               "backbone_fingerprint": str}


_OPTIONAL = ("lora", "backbone_fingerprint")


def _type_names(expected) -> str:
    types = expected if isinstance(expected, tuple) else (expected,)
    return " or ".join({"str": "a string", "dict": "an object", "int": "an integer", "float": "a number"}[t.__name__]
                       for t in types)


def trained_tensors(model: torch.nn.Module, keep: bool = True) -> dict[str, torch.Tensor]:
    """The trainable parameters as full CPU tensors (empty where `keep` is False). Under DeepSpeed ZeRO-3 they
    are partitioned and gathered one at a time: a collective, so every rank must call this, but only the
    writing rank (`keep`) holds the copy, and no rank holds more than one gathered parameter at once."""
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not any(hasattr(p, "ds_id") for _, p in params):
        # copies: on CPU a parameter may be a view into a strategy's flat buffer, which safetensors refuses
        return {n: p.detach().to("cpu", copy=True).contiguous() for n, p in params} if keep else {}
    import deepspeed

    tensors = {}
    for name, param in params:
        with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
            if keep:
                tensors[name] = param.detach().to("cpu", copy=True).contiguous()
    return tensors


def save_snapshot(tensors: dict[str, torch.Tensor], folder: str | Path, meta: SnapshotMeta,
                  max_shard_size: int | str = SHARD_SIZE) -> Path:
    """Write `tensors` (see trained_tensors) and `meta` as a snapshot folder, atomically: written to a staging
    folder, the old snapshot renamed aside, the new one renamed in, the old one removed. A kill at any point
    leaves the old or the new snapshot (see recover_snapshots). Non-finite tensors are refused; tensors past
    `max_shard_size` are split into shards."""
    folder = Path(folder)
    bad = _non_finite(tensors)
    if bad:
        raise SnapshotError(f"refusing to write {folder}: {len(bad)} tensor(s) hold NaN or infinite values, e.g. {bad[:3]}")
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    aside = _aside(folder)
    try:
        save_torch_state_dict(tensors, staging, filename_pattern=WEIGHTS.replace(".safetensors", "{suffix}.safetensors"),
                              max_shard_size=max_shard_size)
        (staging / META).write_text(json.dumps(meta.to_json(), indent=2, sort_keys=True, default=str))
        apply_umask(staging)
        shutil.rmtree(aside, ignore_errors=True)
        if folder.exists():
            os.replace(folder, aside)
        os.replace(staging, folder)
        shutil.rmtree(aside, ignore_errors=True)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


def recover_snapshots(root: str | Path) -> None:
    """Finish what a killed save_snapshot left in `root`: a snapshot renamed aside whose replacement never
    arrived goes back in place; staging folders and replaced snapshots are removed."""
    root = Path(root)
    for aside in root.glob(f".*{_ASIDE}"):
        target = root / aside.name[1:-len(_ASIDE)]
        if target.exists():
            shutil.rmtree(aside, ignore_errors=True)
        else:
            os.replace(aside, target)
    for staging in root.glob(".*-*"):
        if staging.is_dir():
            shutil.rmtree(staging, ignore_errors=True)


def _non_finite(tensors: dict[str, torch.Tensor]) -> list[str]:
    """Names of the floating-point tensors holding NaN or infinite values."""
    return [name for name, t in tensors.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]


_ASIDE = ".replaced"


def _aside(folder: Path) -> Path:
    return folder.parent / f".{folder.name}{_ASIDE}"


def apply_umask(folder: Path) -> None:
    """mkdtemp and safetensors create owner-only modes; give the folder and what it holds the user's usual ones."""
    umask = os.umask(0)
    os.umask(umask)
    for path in [folder, *folder.rglob("*")]:
        os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~umask)


def read_meta(folder: str | Path) -> "SnapshotMeta":
    path = Path(folder) / META
    if not path.is_file():
        raise SnapshotError(f"{folder} is not a RetroKV snapshot: {META} is missing")
    try:
        values = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise SnapshotError(f"{path} is corrupt: {err}") from None
    return SnapshotMeta.from_json(values, path)


def load_snapshot(folder: str | Path, dtype: str | None = None, device: str = "cpu"):
    """Rebuild backbone + gates (+ LoRA) and load the trained tensors. Returns (model, tokenizer, meta)."""
    from models import build_gated_model

    meta = read_meta(folder)
    model, tokenizer = build_gated_model(meta.backbone, meta.gate_kind, meta.gate_settings, dtype=dtype or meta.dtype,
                                         device=device, backbone_mode=meta.backbone_mode, lora=meta.lora)
    loaded = model.config.retrokv.get("backbone_fingerprint")
    if meta.backbone_fingerprint and loaded != meta.backbone_fingerprint:
        raise SnapshotError(f"{folder} was trained on backbone {meta.backbone!r} with weights fingerprint "
                            f"{meta.backbone_fingerprint}, but that name now loads weights with fingerprint {loaded}: a "
                            "different model or revision; load the snapshot on the weights it was trained on")
    tensors = read_tensors(Path(folder), device)
    params = dict(model.named_parameters())
    unknown = sorted(set(tensors) - set(params))
    if unknown:
        raise SnapshotError(f"{folder} holds tensors this model does not have, e.g. {unknown[:3]}")
    needed = sorted(name for name, p in params.items() if p.requires_grad)  # what the run trained and saved
    missing = [name for name in needed if name not in tensors]
    if missing:
        raise SnapshotError(f"{Path(folder) / WEIGHTS} lacks {len(missing)} of the {len(needed)} tensors that "
                            f"{meta.gate_kind} gates on a {meta.backbone_mode} backbone need, e.g. {missing[:3]}")
    bad = _non_finite(tensors)
    if bad:
        raise SnapshotError(f"{Path(folder) / WEIGHTS} holds NaN or infinite values in {len(bad)} tensor(s), "
                            f"e.g. {bad[:3]}; the run that wrote it diverged")
    with torch.no_grad():
        for name, value in tensors.items():
            if params[name].shape != value.shape:
                raise SnapshotError(f"{folder}: {name} has shape {tuple(value.shape)}, model expects {tuple(params[name].shape)}")
            params[name].copy_(value.to(params[name].dtype))
    model.requires_grad_(False)
    return model.eval(), tokenizer, meta


def read_tensors(folder: Path, device: str = "cpu") -> dict[str, torch.Tensor]:
    """A snapshot's tensors, from one file or from the shards its index lists."""
    index = folder / WEIGHTS_INDEX
    if index.is_file():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, AttributeError) as err:
            raise SnapshotError(f"{index} is corrupt: {err!r}") from None
    else:
        files = [WEIGHTS]
    tensors = {}
    for name in files:
        try:
            tensors.update(load_file(str(folder / name), device=device))
        except Exception as err:  # safetensors raises several types for truncated or garbled files
            raise SnapshotError(f"{folder / name} is corrupt or missing: {err}") from None
    return tensors


def list_snapshots(run_dir: str | Path) -> list[tuple[Path, dict]]:
    """A run's CR family, sorted by CR."""
    found = [(p.parent, read_meta(p.parent)) for p in sorted(Path(run_dir).glob(f"snapshots/*/{META}"))]
    return sorted(found, key=lambda item: (item[1].cr, item[1].step))
