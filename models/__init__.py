"""Backbones and the learned eviction gates retrofitted onto them."""

from models.backbone import (
    EMBEDDED_NAME,
    BackboneError,
    load_backbone,
    load_backbone_config,
)
from models.gates import (
    SUPPORTED_FAMILIES,
    DMSSettings,
    GateError,
    GateMode,
    TrimKVSettings,
    attach_gates,
    gate_mode,
    gate_outputs,
    gate_state,
    gate_statistics,
    model_gates,
    set_gate_mode,
    uncertain_decision_share,
)
from models.trainable import configure_backbone

__all__ = [
    "EMBEDDED_NAME", "BackboneError", "load_backbone", "load_backbone_config", "SUPPORTED_FAMILIES",
    "DMSSettings", "GateError", "GateMode", "TrimKVSettings", "attach_gates", "gate_mode", "gate_outputs",
    "gate_state", "gate_statistics", "model_gates", "set_gate_mode", "configure_backbone",
    "uncertain_decision_share",
]
