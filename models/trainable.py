"""A gated model ready to train or serve: which parameters a retrofit trains (gates only on a frozen
backbone, gates + LoRA through peft, or everything), and the one function that builds backbone + gates +
trainable set for training and for loading a snapshot alike."""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from models.backbone import load_backbone
from models.fingerprint import weights_fingerprint
from models.gates import GateError, KVGate
from models.gating import attach_gates, decoder_layers, model_gates, rehook_gates

BackboneMode = Literal["frozen", "lora", "full"]


def configure_backbone(model: nn.Module, mode: BackboneMode = "frozen", lora: dict | None = None) -> nn.Module:
    """Set requires_grad for a retrofit and return the model to train (a peft model for `lora`).

    With `frozen` or `lora`, the teacher is this same model with gates off (and adapters disabled), so no
    second copy of the weights is needed. A DMS `query_neuron` gate lives in q_proj's rows; under a frozen
    backbone or LoRA those rows alone stay trainable (a gradient hook zeroes every other row).
    """
    if mode not in ("frozen", "lora", "full"):
        raise GateError(f"backbone mode {mode!r} is invalid; valid: 'frozen', 'lora', 'full'")
    if not model_gates(model):
        raise GateError("configure_backbone expects a gated model; call models.attach_gates first")
    if mode == "full":
        model.requires_grad_(True)
        return model
    model.requires_grad_(False)
    if mode == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(**(lora or {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]})))
        rehook_gates(model)  # peft replaced q_proj: listen to the wrapper, which includes the adapter
    for gate in model_gates(model):
        gate.requires_grad_(True)
        if gate.neuron_indices:
            _train_neuron_rows(model, gate)
    return model


def _train_neuron_rows(model: nn.Module, gate: KVGate) -> None:
    layer = decoder_layers(model)[gate.layer_idx]
    q_proj = layer.self_attn.q_proj
    q_proj = getattr(q_proj, "base_layer", q_proj)
    rows = torch.zeros(q_proj.weight.shape[0], 1, dtype=torch.bool, device=q_proj.weight.device)
    rows[gate.neuron_indices] = True
    q_proj.weight.requires_grad_(True)
    q_proj.weight.register_hook(lambda grad: grad * rows.to(grad.dtype))
    if q_proj.bias is not None:
        q_proj.bias.requires_grad_(True)
        q_proj.bias.register_hook(lambda grad: grad * rows[:, 0].to(grad.dtype))


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def build_gated_model(backbone: str, gate_kind: str, gate_settings: dict, *, dtype: str = "float32",
                      device: str = "cpu", backbone_mode: BackboneMode = "frozen", lora: dict | None = None,
                      activation_checkpointing: bool = False):
    """Backbone + gates + trainable set: how training builds its model and how a snapshot is rebuilt.
    Returns (model, tokenizer); `model.config.retrokv["backbone_fingerprint"]` identifies the base weights."""
    model, tokenizer = load_backbone(backbone, dtype=dtype, device=device)
    fingerprint = weights_fingerprint(model)  # of the base weights, before anything trains
    attach_gates(model, gate_kind, **gate_settings)
    model.config.retrokv["backbone_fingerprint"] = fingerprint
    model = configure_backbone(model, backbone_mode, lora=lora)
    if activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model, tokenizer
