"""Gates on a whole model: attach and detach them, switch their mode, read what they produced.

`attach_gates` adds one gate per decoder layer in place and routes attention through models.attention;
`detach_gates` undoes exactly that. The model stays a `PreTrainedModel` throughout.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import torch
from torch import nn

from models.attention import ATTENTION_NAME, GATE_ATTRIBUTE, register_attention
from models.gates import GateError, GateMode, GateState, KVGate, gate_kind
from models.masks import mean_over_real

SUPPORTED_FAMILIES = ("llama", "qwen2", "qwen3", "mistral")
_ORIGINAL_ATTENTION = "_retrokv_original_attention"  # the attention implementation attach_gates replaced


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers of any supported family, also under a peft wrapper."""
    return [m for m in model.modules() if hasattr(m, "self_attn") and hasattr(m, "input_layernorm")]


def model_gates(model: nn.Module) -> list[KVGate]:
    return [m for m in model.modules() if isinstance(m, KVGate)]


def check_architecture(config) -> None:
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_FAMILIES:
        raise GateError(f"architecture {model_type!r} is not supported; supported families: {list(SUPPORTED_FAMILIES)}")
    if config.num_attention_heads % config.num_key_value_heads:
        raise GateError(f"{config.num_attention_heads} query heads do not divide into {config.num_key_value_heads} KV heads")


def make_settings(kind: str, **settings: Any):
    """The kind's settings dataclass from keyword values, naming any unknown key."""
    cls = gate_kind(kind).settings_type
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(settings) - names)
    if unknown:
        raise GateError(f"unknown {kind} gate setting(s) {unknown}; valid: {sorted(names)}")
    return cls(**settings)


def attach_gates(model: nn.Module, kind: str = "dms", **settings: Any) -> nn.Module:
    """Add eviction gates to every attention layer of `model`, in place, and route attention through them.

    The model stays a `PreTrainedModel`; gates start in `GateMode.OFF`, where it computes exactly what it
    did before. Settings are the fields of the kind's settings (e.g. `DMSSettings`, `TrimKVSettings`).
    """
    config = model.config
    check_architecture(config)
    if model_gates(model):
        raise GateError("the model already has gates; load a fresh backbone to attach another kind")
    parsed = make_settings(kind, **settings)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    parsed.validate(head_dim)
    state = GateState()
    ref = next(model.parameters())
    gate_type = gate_kind(kind).gate_type
    for idx, layer in enumerate(decoder_layers(model)):
        gate = gate_type(config, idx, state, parsed)
        if hasattr(ref, "ds_id"):  # built under ZeRO-3's zero.Init: already placed, cast and partitioned
            _initialize_partitioned(gate)
        else:
            # gates train in float32 whatever the backbone's dtype: they are tiny and AdamW needs the precision
            gate = gate.to(device=ref.device, dtype=torch.float32)
        setattr(layer.self_attn, GATE_ATTRIBUTE, gate)
        gate.install_hooks(layer)
    model.retrokv_state = state
    config.retrokv = {"kind": kind, **dataclasses.asdict(parsed)}
    setattr(model, _ORIGINAL_ATTENTION, config._attn_implementation)
    register_attention()
    model.set_attn_implementation(ATTENTION_NAME)
    return model


def _initialize_partitioned(gate: KVGate) -> None:
    """zero.Init partitions each submodule's parameters as its constructor returns, so the gate's own
    initialisation after that (zeros, constants) wrote nothing: run it again on the gathered parameters."""
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(gate.parameters()), modifier_rank=0):
        gate.reset_parameters()


def rehook_gates(model: nn.Module) -> nn.Module:
    """Attach every gate's hooks to its layer's current submodules again: after peft wraps them (LoRA
    training, a loaded adapter) or merges them back, the gates must listen to what now runs."""
    for layer, gate in zip(decoder_layers(model), model_gates(model)):
        gate.install_hooks(layer)
    return model


def detach_gates(model: nn.Module) -> nn.Module:
    """Remove the gates `attach_gates` added (hooks, modules, config section) and restore the attention
    implementation it replaced; the model is the original one again."""
    gates = model_gates(model)
    if not gates:
        raise GateError("the model has no gates to detach")
    for gate in gates:
        gate.remove_hooks()
    for layer in decoder_layers(model):
        delattr(layer.self_attn, GATE_ATTRIBUTE)
    del model.retrokv_state
    del model.config.retrokv
    model.set_attn_implementation(model.__dict__.pop(_ORIGINAL_ATTENTION))
    return model


def _first_gate(model: nn.Module) -> KVGate:
    found = model_gates(model)
    if not found:
        raise GateError("the model has no gates; call models.attach_gates first")
    return found[0]


def gate_state(model: nn.Module) -> GateState:
    return _first_gate(model).state


def gate_settings(model: nn.Module) -> tuple[str, Any]:
    """(kind, settings) of the model's gates."""
    settings = _first_gate(model).settings
    return model.config.retrokv["kind"], settings


def set_gate_mode(model: nn.Module, mode: GateMode | str) -> None:
    try:
        mode = GateMode(mode)
    except ValueError:
        raise GateError(f"unknown gate mode {mode!r}; valid: {[m.value for m in GateMode]}") from None
    state = gate_state(model)
    state.mode = mode
    for gate in model_gates(model):
        gate.reset()


@contextlib.contextmanager
def gate_mode(model: nn.Module, mode: GateMode | str):
    """Temporarily switch every gate, e.g. `with gate_mode(model, "off"): teacher_logits = model(...)`."""
    previous = gate_state(model).mode
    set_gate_mode(model, mode)
    try:
        yield model
    finally:
        set_gate_mode(model, previous)


def gate_outputs(model: nn.Module) -> list[dict[str, torch.Tensor]]:
    """Per layer, what the gates produced in the last forward (with gradients in training mode)."""
    return [gate.outputs for gate in model_gates(model)]


def gate_statistics(model: nn.Module, attention_mask: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Per layer and KV head, the kind's statistics (DMS eviction fraction; TRIM-KV mean retention and
    occupancy), averaged over positions; `attention_mask` ([B, T], 1 = real token) keeps padding out."""
    stats: dict[str, list[torch.Tensor]] = {}
    gates = model_gates(model)
    kind = gate_kind(model.config.retrokv["kind"]) if gates else None
    for gate in gates:
        if not gate.outputs:
            continue
        for name, value in kind.statistics(gate.outputs).items():
            value = value.detach()
            mean = mean_over_real(value, attention_mask) if attention_mask is not None else value.mean((0, 2))
            stats.setdefault(name, []).append(mean)
    return {name: torch.stack(rows) for name, rows in stats.items()}
