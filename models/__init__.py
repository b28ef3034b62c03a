"""Backbones and the learned eviction gates retrofitted onto them.

backbone.py loads a causal LM; gates/ holds one module per gate kind; gating.py attaches gates to a model
and switches them; attention.py is the attention function they bias; trainable.py builds a gated model
with its trainable set; pretrained.py holds the transformers classes of exported
folders; masks.py, metrics.py and fingerprint.py are the shared formulas.
"""

from models.backbone import (
    EMBEDDED_NAME,
    BackboneError,
    load_backbone,
    load_backbone_config,
    load_tokenizer,
)
from models.gates import GATE_KINDS, DMSSettings, GateError, GateMode, TrimKVSettings, gate_kind
from models.gating import (
    SUPPORTED_FAMILIES,
    attach_gates,
    detach_gates,
    gate_mode,
    gate_outputs,
    gate_settings,
    gate_state,
    gate_statistics,
    model_gates,
    set_gate_mode,
)
from models.pretrained import from_pretrained
from models.trainable import build_gated_model, configure_backbone

__all__ = [
    "EMBEDDED_NAME", "BackboneError", "load_backbone", "load_backbone_config", "load_tokenizer", "SUPPORTED_FAMILIES", "GATE_KINDS",
    "DMSSettings", "GateError", "GateMode", "TrimKVSettings", "attach_gates", "build_gated_model",
    "configure_backbone", "detach_gates", "from_pretrained", "gate_kind", "gate_mode", "gate_outputs", "gate_settings", "gate_state",
    "gate_statistics", "model_gates", "set_gate_mode",
]
