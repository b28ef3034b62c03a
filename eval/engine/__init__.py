"""The bundled bounded-memory inference engine: a KV budget per (sequence, KV head) and an eviction policy."""

from eval.engine.cache import ENGINE_ATTENTION, BoundedCache, CacheStats
from eval.engine.policies import (
           DMS,
           H2O,
           POLICIES,
           TOVA,
           EngineError,
           Full,
           Policy,
           Quest,
           Sink,
           TrimKV,
           Window,
)

__all__ = [
           "DMS",
           "ENGINE_ATTENTION",
           "H2O",
           "POLICIES",
           "TOVA",
           "BoundedCache",
           "CacheStats",
           "EngineError",
           "Full",
           "Policy",
           "Quest",
           "Sink",
           "TrimKV",
           "Window",
]
