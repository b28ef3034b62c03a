"""Gated models as transformers classes, for exported folders: `RetroKV<Family>ForCausalLM` is the base
architecture's causal LM with its eviction gates attached at construction, in inference mode.

An exported folder's config.json holds the base architecture plus a `retrokv` section (the gate kind and
settings and where the weights came from), and its `auto_map` names one of these classes. The export
copies this file and the gate code it needs next to the weights, so `AutoModelForCausalLM.from_pretrained(
folder, trust_remote_code=True)` builds the gated model without RetroKV installed; with RetroKV installed,
`models.from_pretrained` builds it from these same classes (the engine then recognises the gates).
Format and loading rules: docs/export.md.
"""

from __future__ import annotations

import os

from safetensors import SafetensorError
from safetensors.torch import load_file
from transformers import (
    AutoConfig,
    LlamaForCausalLM,
    MistralForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
)
from transformers.utils import logging as hf_logging

from models.attention import GATE_ATTRIBUTE
from models.fingerprint import weights_fingerprint
from models.gates import GateError, GateMode, gate_kind
from models.gating import attach_gates, rehook_gates, set_gate_mode

FORMAT_VERSION = 1  # of the config.json `retrokv` section; readers refuse newer versions
GATES_FILE = "retrokv_gates.safetensors"  # the trained tensors of a gates-only export
FULL, GATES_ONLY = "full", "gates_only"  # `retrokv.weights`: the whole gated model, or gates + a base reference
_HUB_KWARGS = ("revision", "token", "cache_dir", "local_files_only", "force_download", "subfolder")


def export_section(config) -> dict:
    """The config's `retrokv` section, checked: present, of a format version this code reads, complete."""
    section = getattr(config, "retrokv", None)
    if not isinstance(section, dict):
        raise GateError("this config has no `retrokv` section: it is not a RetroKV export "
                        "(export one with `python -m checkpoints export`)")
    version = section.get("format_version")
    if not isinstance(version, int) or version < 1:
        raise GateError(f"retrokv.format_version={version!r} is invalid; this code reads versions 1 to {FORMAT_VERSION}")
    if version > FORMAT_VERSION:
        raise GateError(f"retrokv.format_version={version} is newer than this code reads ({FORMAT_VERSION}); "
                        "upgrade RetroKV, or re-export the snapshot with the version you have")
    missing = [key for key in ("kind", "weights", "backbone_fingerprint") if key not in section]
    if missing:
        raise GateError(f"the retrokv section lacks {missing}")
    if section["weights"] not in (FULL, GATES_ONLY):
        raise GateError(f"retrokv.weights={section['weights']!r} is invalid; valid: {FULL!r}, {GATES_ONLY!r}")
    return section


def settings_in(section: dict) -> dict:
    """The gate settings among the section's keys (the rest is provenance)."""
    names = gate_kind(section["kind"]).settings_type.__dataclass_fields__
    return {key: value for key, value in section.items() if key in names}


class GatedCausalLM:
    """Mixin for a family's causal LM: attaches the gates its config describes, in inference mode (hard
    decisions), so plain generation with a DynamicCache gives the gated model's outputs."""

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        section = export_section(config)
        attach_gates(self, section["kind"], **settings_in(section))
        self.config.retrokv = {**section, **self.config.retrokv}  # attach_gates rewrote it with the settings alone
        set_gate_mode(self, GateMode.INFER)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, base_model: str | None = None, **kwargs):
        """transformers' loader; a gates-only export loads its base model first (`base_model` overrides the
        reference it records), checks the base weights' fingerprint, then loads the gate tensors."""
        hub = {key: kwargs[key] for key in _HUB_KWARGS if key in kwargs}
        config = kwargs.pop("config", None) or AutoConfig.from_pretrained(pretrained_model_name_or_path, **hub)
        section = export_section(config)
        wants_info = kwargs.pop("output_loading_info", False)
        if section["weights"] == FULL:
            try:
                model, info = super().from_pretrained(pretrained_model_name_or_path, *args, config=config,
                                                      output_loading_info=True, **kwargs)
            except SafetensorError as err:
                raise GateError(f"a weights file of {pretrained_model_name_or_path} is corrupt or truncated ({err}); "
                                "export or download it again") from None
            missing = sorted(info.get("missing_keys", ()))
            if missing:  # transformers would initialise them at random: a gated model that is not the export
                raise GateError(f"{pretrained_model_name_or_path} lacks {len(missing)} of the model's tensors, "
                                f"e.g. {missing[:3]}; re-export the snapshot")
            return (model, info) if wants_info else model
        base = base_model or section.get("base_model")
        if not base:
            raise GateError(f"{pretrained_model_name_or_path} is a gates-only export without a base model reference; "
                            "pass base_model=<the base model's folder or Hub id>")
        base_kwargs = {k: v for k, v in kwargs.items() if k not in _HUB_KWARGS}
        if base_model is None and section.get("base_revision"):
            base_kwargs["revision"] = section["base_revision"]
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # its load report would call the gates "newly initialized"; they load below
        try:
            model, info = super().from_pretrained(base, *args, config=config, output_loading_info=True, **base_kwargs)
        finally:
            hf_logging.set_verbosity(verbosity)
        absent = sorted(name for name in info.get("missing_keys", ()) if GATE_ATTRIBUTE not in name.split("."))
        if absent:
            raise GateError(f"base model {base!r} lacks {len(absent)} tensors of the architecture, e.g. {absent[:3]}")
        found = weights_fingerprint(model)
        if found != section["backbone_fingerprint"]:
            raise GateError(f"base model {base!r} has weights fingerprint {found}, but the gates in "
                            f"{pretrained_model_name_or_path} were trained on weights with fingerprint "
                            f"{section['backbone_fingerprint']}; pass base_model=<the weights they were trained on>")
        _load_gate_tensors(model, _gates_file(pretrained_model_name_or_path, hub))
        if section.get("lora_adapter"):
            _load_lora(model, pretrained_model_name_or_path, section["lora_adapter"], hub)
        return (model, {}) if wants_info else model


def _gates_file(name_or_path, hub: dict) -> str:
    folder = os.path.join(name_or_path, hub.get("subfolder") or "")
    if os.path.isdir(folder):
        return os.path.join(folder, GATES_FILE)
    from huggingface_hub import hf_hub_download

    return hf_hub_download(name_or_path, GATES_FILE, **hub)


def _load_lora(model, name_or_path, subfolder: str, hub: dict) -> None:
    """A LoRA adapter kept separate (peft's format, in `subfolder`) goes on top of the base weights; the gates
    then listen to the adapted layers, as they did in training."""
    folder = os.path.join(name_or_path, hub.get("subfolder") or "", subfolder)
    if os.path.isdir(folder):
        model.load_adapter(folder)
    else:
        model.load_adapter(name_or_path, adapter_kwargs={**hub, "subfolder": os.path.join(hub.get("subfolder") or "", subfolder)})
    rehook_gates(model)


def _load_gate_tensors(model, path: str) -> None:
    try:
        tensors = load_file(path)
    except Exception as err:  # safetensors raises several types for missing, truncated or garbled files
        raise GateError(f"{path} is missing or corrupt: {err}") from None
    params = dict(model.named_parameters())
    unknown = sorted(set(tensors) - set(params))
    if unknown:
        raise GateError(f"{path} holds tensors this model does not have, e.g. {unknown[:3]}")
    gates = sorted(name for name in params if GATE_ATTRIBUTE in name.split("."))
    missing = [name for name in gates if name not in tensors]
    if missing:
        raise GateError(f"{path} lacks {len(missing)} of the model's {len(gates)} gate tensors, e.g. {missing[:3]}")
    for name, value in tensors.items():
        if params[name].shape != value.shape:
            raise GateError(f"{path}: {name} has shape {tuple(value.shape)}, the model expects {tuple(params[name].shape)}")
        params[name].data.copy_(value.to(params[name].dtype))


class RetroKVLlamaForCausalLM(GatedCausalLM, LlamaForCausalLM):
    _keep_in_fp32_modules = [GATE_ATTRIBUTE]  # gates run in float32 whatever the backbone's dtype


class RetroKVQwen2ForCausalLM(GatedCausalLM, Qwen2ForCausalLM):
    _keep_in_fp32_modules = [GATE_ATTRIBUTE]


class RetroKVQwen3ForCausalLM(GatedCausalLM, Qwen3ForCausalLM):
    _keep_in_fp32_modules = [GATE_ATTRIBUTE]


class RetroKVMistralForCausalLM(GatedCausalLM, MistralForCausalLM):
    _keep_in_fp32_modules = [GATE_ATTRIBUTE]


GATED_CLASSES = {"llama": RetroKVLlamaForCausalLM, "qwen2": RetroKVQwen2ForCausalLM,
                 "qwen3": RetroKVQwen3ForCausalLM, "mistral": RetroKVMistralForCausalLM}


def from_pretrained(name_or_path: str, *, base_model: str | None = None, device: str = "cpu", **kwargs):
    """The gated model of an exported folder or Hub repository, in inference mode, ready for generation with a
    DynamicCache or eval.engine.BoundedCache. kwargs go to transformers' from_pretrained (dtype, revision, ...);
    `base_model` overrides a gates-only export's base reference."""
    hub = {key: kwargs[key] for key in _HUB_KWARGS if key in kwargs}
    config = AutoConfig.from_pretrained(name_or_path, **hub)
    export_section(config)
    if config.model_type not in GATED_CLASSES:
        raise GateError(f"{name_or_path} is a {config.model_type!r} model; supported families: {sorted(GATED_CLASSES)}")
    model = GATED_CLASSES[config.model_type].from_pretrained(name_or_path, config=config, base_model=base_model, **kwargs)
    return model.to(device).eval()
