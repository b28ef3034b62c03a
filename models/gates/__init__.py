"""Learned eviction gates: one module per kind (dms.py, trimkv.py) over a shared base (base.py).

A kind registers here and nowhere else: the recipe schema, the trainer, the quick evaluation and the
engine find its settings, module, losses and statistics through `GATE_KINDS`.
"""

from models.gates.base import GateError, GateKind, GateMode, GateState, KVGate
from models.gates.dms import DMSGate, DMSKind, DMSSettings
from models.gates.trimkv import TrimKVGate, TrimKVKind, TrimKVSettings

GATE_KINDS: dict[str, GateKind] = {kind.name: kind for kind in (DMSKind(), TrimKVKind())}


def gate_kind(name: str) -> GateKind:
    """The kind registered as `name`, or a GateError listing the valid ones."""
    if name not in GATE_KINDS:
        raise GateError(f"unknown gate kind {name!r}; valid: {sorted(GATE_KINDS)}")
    return GATE_KINDS[name]


__all__ = ["GATE_KINDS", "DMSGate", "DMSSettings", "GateError", "GateKind", "GateMode", "GateState", "KVGate",
           "TrimKVGate", "TrimKVSettings", "gate_kind"]
