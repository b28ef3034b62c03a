"""Which parameters a retrofit trains: gates only (frozen backbone), gates + LoRA (peft), or everything."""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from models.gates import DMSGate, GateError, decoder_layers, model_gates

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
        for layer, gate in zip(decoder_layers(model), model_gates(model)):
            gate.install_hooks(layer)  # peft replaced q_proj: listen to the wrapper, which includes the adapter
    for gate in model_gates(model):
        gate.requires_grad_(True)
        if isinstance(gate, DMSGate) and gate.settings.source == "query_neuron":
            _train_neuron_rows(model, gate)
    return model


def _train_neuron_rows(model: nn.Module, gate: DMSGate) -> None:
    layer = decoder_layers(model)[gate.layer_idx]
    q_proj = layer.self_attn.q_proj
    q_proj = getattr(q_proj, "base_layer", q_proj)
    rows = torch.zeros(q_proj.weight.shape[0], 1, dtype=torch.bool, device=q_proj.weight.device)
    rows[gate._neuron_flat_index()] = True
    q_proj.weight.requires_grad_(True)
    q_proj.weight.register_hook(lambda grad: grad * rows.to(grad.dtype))
    if q_proj.bias is not None:
        q_proj.bias.requires_grad_(True)
        q_proj.bias.register_hook(lambda grad: grad * rows[:, 0].to(grad.dtype))


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]
