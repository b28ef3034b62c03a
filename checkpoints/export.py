"""Export gate snapshots as self-describing Hugging Face folders (docs/export.md).

A folder holds config.json (the base architecture, a `retrokv` section and an `auto_map`), the weights
as sharded safetensors (`save_pretrained`) or, with `gates_only`, just the trained tensors plus a base
model reference, the tokenizer, the generation config, a model card, and the modeling code: the project's
gate files, copied flat next to the weights, so transformers runs them as remote code without RetroKV.
Every folder is written to a staging folder and renamed into place.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path

from safetensors.torch import save_file

from assets import retrokv_version
from checkpoints.snapshot import (
    META,
    SnapshotError,
    SnapshotMeta,
    apply_umask,
    list_snapshots,
    load_snapshot,
    read_meta,
    read_tensors,
)

MODELS_DIR = Path(__file__).resolve().parent.parent / "models"
# the files transformers copies as remote code, and the flat names they get; models/pretrained.py is the entry
REMOTE_MODULES = {
    "models.pretrained": "modeling_retrokv",
    "models.attention": "retrokv_attention",
    "models.masks": "retrokv_masks",
    "models.fingerprint": "retrokv_fingerprint",
    "models.gates": "retrokv_gates",
    "models.gates.base": "retrokv_gates_base",
    "models.gates.dms": "retrokv_gates_dms",
    "models.gates.trimkv": "retrokv_gates_trimkv",
    "models.gating": "retrokv_gating",
}
_PROJECT_IMPORT = re.compile(r"^(\s*)from (models(?:\.\w+)*) import ", re.MULTILINE)


class ExportError(SnapshotError):
    """An export that cannot be written, with what would work instead."""


def module_file(module: str) -> Path:
    parts = module.split(".")[1:]
    package = MODELS_DIR.joinpath(*parts)
    return package / "__init__.py" if package.is_dir() else package.with_suffix(".py")


def flat_source(module: str) -> str:
    """A project module's source with its project imports rewritten to the flat relative names transformers
    copies (`from models.gates.base import X` becomes `from .retrokv_gates_base import X`)."""
    source = module_file(module).read_text()

    def rewrite(match: re.Match) -> str:
        target = match.group(2)
        if target not in REMOTE_MODULES:
            raise ExportError(f"{module} imports {target}, which is not among the exported modules {sorted(REMOTE_MODULES)}")
        return f"{match.group(1)}from .{REMOTE_MODULES[target]} import "

    flat = _PROJECT_IMPORT.sub(rewrite, source)
    leftover = re.search(r"^\s*(import models\b|from models\b)", flat, re.MULTILINE)
    if leftover:
        raise ExportError(f"{module} has an import the export cannot rewrite: {leftover.group(0).strip()!r}")
    origin = module_file(module).relative_to(MODELS_DIR.parent)
    return f"# RetroKV {retrokv_version()}: {origin}, imports made relative for transformers' remote code.\n{flat}"


def write_modeling_code(folder: Path) -> None:
    for module, flat in REMOTE_MODULES.items():
        (folder / f"{flat}.py").write_text(flat_source(module))


LORA_FORMS = ("merged", "separate")
LORA_FOLDER = "lora"  # a separate LoRA adapter's subfolder (peft's format; not the top level, which peft would claim)


def export_snapshot(snapshot: str | Path, out: str | Path, *, gates_only: bool = False, lora: str = "merged",
                    max_shard_size: str = "5GB", family: list[str] | None = None) -> Path:
    """Write `snapshot` as a Hugging Face folder at `out` (which must not exist). A LoRA snapshot's adapters are
    merged into the weights, or (`lora="separate"`) kept as a peft adapter beside the gates and a base
    reference. `family` names the sibling exports of one run, for the model card."""
    from models.backbone import resolve_backbone_path
    from models.pretrained import FORMAT_VERSION, FULL, GATED_CLASSES, GATES_FILE, GATES_ONLY

    snapshot, out = Path(snapshot), Path(out)
    if out.exists():
        raise ExportError(f"{out} already exists; choose another --out or remove it")
    meta = read_meta(snapshot)
    if lora not in LORA_FORMS:
        raise ExportError(f"--lora {lora!r} is invalid; valid: {list(LORA_FORMS)}")
    separate = lora == "separate"
    if separate and meta.backbone_mode != "lora":
        raise ExportError(f"--lora separate applies to LoRA snapshots; {snapshot} trained a {meta.backbone_mode} backbone")
    if gates_only and meta.backbone_mode != "frozen":
        raise ExportError(f"{snapshot} trained a {meta.backbone_mode} backbone, so its weights are not the base model's; "
                          "--gates-only needs a frozen backbone (for LoRA: --lora separate); export without it")
    gates_only = gates_only or separate
    model, tokenizer, meta = load_snapshot(snapshot)
    if separate:
        adapter, model = model, model.get_base_model()
    elif meta.backbone_mode == "lora":
        model = _merge_lora(model)
    config = model.config
    cls = GATED_CLASSES[config.model_type]
    base = resolve_backbone_path(meta.backbone)
    config.retrokv = {**config.retrokv, "format_version": FORMAT_VERSION, "weights": GATES_ONLY if gates_only else FULL,
                      "backbone": meta.backbone, "base_model": str(Path(base).resolve()) if Path(base).is_dir() else base,
                      "base_revision": getattr(config, "_commit_hash", None), "backbone_mode": meta.backbone_mode,
                      "lora": meta.lora, "lora_adapter": LORA_FOLDER if separate else None, "cr": meta.cr,
                      "step": meta.step, "recipe": meta.recipe}
    config.auto_map = {"AutoModelForCausalLM": f"{REMOTE_MODULES['models.pretrained']}.{cls.__name__}"}
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        if gates_only:
            # what the run trained besides LoRA: the gates, and q_proj where a DMS query neuron lives
            save_file(_outside_peft(read_tensors(snapshot)), str(staging / GATES_FILE), metadata={"format": "pt"})
            if separate:
                adapter.save_pretrained(staging / LORA_FOLDER)
        else:
            model.save_pretrained(staging, max_shard_size=max_shard_size)
        config.architectures = [cls.__name__]
        config.save_pretrained(staging)  # after save_pretrained, which names the plain class
        if not (staging / "generation_config.json").is_file() and model.generation_config is not None:
            model.generation_config.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        write_modeling_code(staging)
        (staging / "README.md").write_text(model_card(snapshot, meta, config.retrokv, family))
        apply_umask(staging)
        os.replace(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def _outside_peft(tensors: dict) -> dict:
    """Tensor names as the unwrapped model has them (peft's wrapper prefix and base_layer dropped), LoRA's own
    tensors left out (they go to the adapter folder)."""
    plain = {}
    for name, tensor in tensors.items():
        if ".lora_" in name:
            continue
        plain[name.removeprefix("base_model.model.").replace(".base_layer.", ".")] = tensor
    return plain


def _merge_lora(model):
    """Fold the LoRA adapters into the base weights; the gates listen to the merged layers again."""
    from models.gating import rehook_gates

    return rehook_gates(model.merge_and_unload())


def export_run(source: str | Path, out: str | Path, *, cr: int | None = None, every: bool = False,
               gates_only: bool = False, lora: str = "merged", max_shard_size: str = "5GB") -> list[Path]:
    """Export a snapshot folder, or from a run folder its final snapshot, the one of CR `cr`, or (`every`) its
    whole CR family as out/<snapshot name>/."""
    source = Path(source)
    if (source / META).is_file():
        if cr is not None or every:
            raise ExportError(f"{source} is one snapshot; --cr and --all choose among a run folder's snapshots")
        return [export_snapshot(source, out, gates_only=gates_only, lora=lora, max_shard_size=max_shard_size)]
    if not source.is_dir():
        raise ExportError(f"{source} does not exist; pass a run folder (with snapshots/) or a snapshot folder")
    found = list_snapshots(source)
    if not found:
        raise ExportError(f"{source} holds no snapshots (no {source}/snapshots/*/{META}); pass a run folder that "
                          "trained at least one step, or a snapshot folder")
    names = [folder.name for folder, _ in found]
    if every:
        Path(out).mkdir(parents=True, exist_ok=True)
        return [export_snapshot(folder, Path(out) / folder.name, gates_only=gates_only, lora=lora,
                                max_shard_size=max_shard_size, family=names) for folder, _ in found]
    wanted = "final" if cr is None else f"cr{cr}"
    if wanted not in names:
        raise ExportError(f"{source} has no snapshot {wanted!r}; it has {names}")
    return [export_snapshot(source / "snapshots" / wanted, out, gates_only=gates_only, lora=lora,
                            max_shard_size=max_shard_size)]


def model_card(snapshot: Path, meta: SnapshotMeta, section: dict, family: list[str] | None) -> str:
    """README.md with the Hub's metadata header: what the model is, how to load it, how it was trained, the
    per-layer eviction it reached and any evaluation found in the run."""
    from huggingface_hub import ModelCard, ModelCardData

    data = ModelCardData(library_name="transformers", pipeline_tag="text-generation",
                         tags=["retrokv", "kv-cache-eviction", meta.gate_kind],
                         base_model=meta.backbone if "/" in meta.backbone and not Path(meta.backbone).exists() else None)
    lines = [f"# {meta.gate_kind.upper()} gates for `{meta.backbone}` (CR {meta.cr:g}, step {meta.step})", "",
             "A causal LM retrofitted with learned KV-cache eviction by RetroKV. "
             "Greedy or sampled generation with a plain `DynamicCache` applies the gates' decisions as attention masks; "
             "RetroKV's `eval.engine.BoundedCache` evicts for real and keeps the KV memory bounded.", "",
             "## Loading", "", "```python",
             "from transformers import AutoModelForCausalLM, AutoTokenizer",
             "model = AutoModelForCausalLM.from_pretrained(REPO_OR_FOLDER, trust_remote_code=True)",
             "tokenizer = AutoTokenizer.from_pretrained(REPO_OR_FOLDER)",
             "# with RetroKV installed, for the bounded-memory engine:",
             "import models; model = models.from_pretrained(REPO_OR_FOLDER)", "```", ""]
    if section["weights"] == "gates_only":
        lines += [f"This is a gates-only export: the base weights load from `{section['base_model']}` (pass "
                  "`base_model=` to point elsewhere) and must have weights fingerprint "
                  f"`{section['backbone_fingerprint']}`.", ""]
    if family:
        lines += ["## CR family", "", f"This run exported {len(family)} snapshots: {', '.join(family)}. Pushed with "
                  "`python -m checkpoints push`, the final snapshot is the repository's `main` branch and each `crK` "
                  "snapshot its own branch `crK` (`revision=\"cr2\"` in `from_pretrained`).", ""]
    lines += ["## Training", "", "| | |", "|---|---|",
              f"| recipe | `{meta.recipe}` |", f"| backbone | `{meta.backbone}` ({meta.backbone_mode}, {meta.dtype}) |",
              f"| gate | `{meta.gate_kind}` `{json.dumps(meta.gate_settings, sort_keys=True)}` |",
              f"| compression ratio reached | {meta.cr:g} |", f"| optimizer steps | {meta.step} |"]
    data_cfg = meta.config.get("data", {})
    if data_cfg:
        lines.append(f"| data | `{data_cfg.get('source')}`, {data_cfg.get('train_samples')} samples, rows of "
                     f"{data_cfg.get('max_length')} tokens |")
    if meta.lora:
        where = f"separate, peft adapter in `{LORA_FOLDER}/`" if section.get("lora_adapter") else "merged into the weights"
        lines.append(f"| LoRA ({where}) | `{json.dumps(meta.lora, sort_keys=True)}` |")
    lines.append("")
    per_layer = _layer_statistics(snapshot, meta.step)
    if per_layer:
        lines += [f"## Per layer at step {per_layer['step']} (training batch)", "",
                  "| layer | " + " | ".join(per_layer["names"]) + " |", "|---" * (len(per_layer["names"]) + 1) + "|"]
        for layer, row in enumerate(per_layer["rows"]):
            lines.append(f"| {layer} | " + " | ".join(f"{v:.3f}" for v in row) + " |")
        lines.append("")
    summary = snapshot.parent.parent / "summary.json"
    if summary.is_file():
        values = json.loads(summary.read_text())
        held_out = {k: v for k, v in values.items() if k.startswith("val/")}
        if values.get("steps") == meta.step and held_out:
            lines += ["## Held-out validation at the end of training", "", "| metric | value |", "|---|---|",
                      *(f"| `{k}` | {v:.4g} |" for k, v in sorted(held_out.items())), ""]
    for path in sorted((snapshot / "eval").glob("*.json")):
        lines += [f"## Evaluation: `{path.stem}`", "", "```json", path.read_text().strip(), "```", ""]
    return str(ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(lines)))


def _layer_statistics(snapshot: Path, step: int) -> dict | None:
    """The trainer's `layers/<statistic>_<layer>` TensorBoard scalars at the last logged step <= `step`."""
    run = snapshot.parent.parent
    events = sorted((run / "tensorboard").glob("events*"))
    if not events:
        return None
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    values: dict[str, dict[int, float]] = {}
    for path in events:
        acc = EventAccumulator(str(path), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            if tag.startswith("layers/"):
                values.setdefault(tag, {}).update({e.step: e.value for e in acc.Scalars(tag)})
    steps = sorted({s for series in values.values() for s in series if s <= step})
    if not steps:
        return None
    at = steps[-1]
    table: dict[str, dict[int, float]] = {}
    for tag, series in values.items():
        name, layer = tag.removeprefix("layers/").rsplit("_", 1)
        if at in series:
            table.setdefault(name, {})[int(layer)] = series[at]
    names = sorted(table)
    layers = sorted({layer for column in table.values() for layer in column})
    return {"step": at, "names": names,
            "rows": [[table[name].get(layer, float("nan")) for name in names] for layer in layers]}


def folder_size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
