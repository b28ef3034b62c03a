"""`BoundedCache`: a transformers `Cache` whose memory is fixed by a KV budget, with pluggable eviction.

    with BoundedCache(model, policy="tova", budget=512) as cache:
        out = model.generate(input_ids, attention_mask=mask, cache=cache, max_new_tokens=128)
        print(cache.stats())

The cache routes the model's attention through the engine (an attention function registered with
transformers) and sets the gates to the mode its policy needs; leaving the `with` block (or `close()`)
restores both. The one channel between the cache and the attention function: `update` hands the new
keys/values to the layer's slots and marks the attention module with that layer (`_BOUND`); the engine's
attention takes the mark, reads the slots plus the new tokens, then lets the policy evict. Without a mark
the same attention function falls back to the model's usual (gated) attention.
"""

from __future__ import annotations

import dataclasses

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache
from transformers.masking_utils import AttentionMaskInterface

from eval.engine.layer import BoundedLayer, QuestLayer, slot_positions
from eval.engine.policies import EngineError, Policy, Quest, make_policy
from eval.engine.positions import rotary_frequencies
from models.attention import boolean_causal_mask, gated_attention
from models.gates import GateError
from models.gating import check_architecture, decoder_layers, gate_state, model_gates, set_gate_mode

ENGINE_ATTENTION = "retrokv_engine"
_BOUND = "_retrokv_engine_layer"  # set on an attention module by `update`, consumed by its attention call


@dataclasses.dataclass
class CacheStats:
    """What a run through the cache cost. Reads and tokens are summed over sequences of the batch."""

    policy: str
    budget: int
    slots: int  # per (sequence, KV head)
    tokens_seen: int  # real (non-padding) tokens, over the batch
    decode_steps: int
    kv_reads: int  # keys read by decode steps, over layers, KV heads and sequences
    full_cache_reads: int  # what a full cache would have read in the same steps
    peak_tokens: torch.Tensor  # [layers, KV heads] most tokens any sequence held
    kept_tokens: torch.Tensor  # [layers, KV heads] tokens held at the end, mean over the batch
    bytes_allocated: int
    capacity_evictions: int  # evictions because the slots were full (for DMS: forced past its own decisions)
    compression: float  # tokens seen per token kept, per sequence, averaged over layers and KV heads
    query_reads: int = 0  # keys read by every real query (prefill chunks included), over layers, KV heads, sequences
    query_full_reads: int = 0  # what a full cache would have read for the same queries
    mean_tokens: torch.Tensor | None = None  # [layers, KV heads] tokens held, averaged over the real tokens seen

    @property
    def reads_per_query(self) -> float:
        """Keys one real query reads, on average per (layer, KV head): the read cost of attention."""
        per_head = self.peak_tokens.numel() * self.tokens_seen
        return self.query_reads / per_head if per_head else float("nan")

    @property
    def read_reduction(self) -> float:
        """Full-cache reads over this cache's reads in the same decode steps."""
        return self.full_cache_reads / self.kv_reads if self.kv_reads else float("nan")

    def summary(self) -> dict:
        return {"policy": self.policy, "budget": self.budget, "slots": self.slots, "tokens_seen": self.tokens_seen,
                "decode_steps": self.decode_steps, "kv_reads": self.kv_reads, "full_cache_reads": self.full_cache_reads,
                "read_reduction": round(self.read_reduction, 3), "compression": round(self.compression, 3),
                "peak_tokens": int(self.peak_tokens.max()), "bytes_allocated": self.bytes_allocated,
                "capacity_evictions": self.capacity_evictions, "query_reads": self.query_reads,
                "query_full_reads": self.query_full_reads,
                "mean_tokens": None if self.mean_tokens is None else round(float(self.mean_tokens.mean()), 2)}


class BoundedCache(Cache):
    """Fixed slots per layer and (sequence, KV head), filled and evicted by `policy`.

    policy: a name from `eval.engine.POLICIES` or a policy instance (e.g. `TOVA(head_wise=True)`).
    budget: tokens kept per (sequence, KV head); DMS adds its window, TRIM-KV an optional burst buffer, and
        Quest keeps every token (its budget is what each query reads).
    chunk_size: new tokens attended per chunk, with eviction between chunks (default: the budget, so a prompt
        that fits is prefilled in one pass).
    gap_compression: TOVA's option for running past the trained length: gaps of more than 10 positions
        between kept tokens shrink to round(ln(ln(gap))), by re-rotating keys and queries.
    The cache switches the model's gates to the mode its policy needs (inference for DMS and TRIM-KV, off,
    the original model, for the training-free baselines) and its attention to the engine's; `close()` or
    leaving a `with` block restores both. One cache serves one `generate` call (one batch of prompts).
    """

    def __init__(self, model, policy: str | Policy = "tova", budget: int = 512, chunk_size: int | None = None,
                 gap_compression: bool = False):
        try:
            check_architecture(model.config)
        except GateError as err:
            raise EngineError(str(err)) from None
        self.policy = make_policy(policy)
        self.policy.bind(model, budget)
        chunk_size = self.policy.budget if chunk_size is None else chunk_size
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise EngineError(f"chunk_size={chunk_size!r} is invalid; it must be an integer >= 1 (or None: the budget)")
        self._attention_modules = [layer.self_attn for layer in decoder_layers(model)]
        self._config = model.config
        inv_freq = rotary_frequencies(model) if gap_compression else None
        layer_type = QuestLayer if isinstance(self.policy, Quest) else BoundedLayer
        super().__init__(layers=[layer_type(self.policy, chunk_size, inv_freq) for _ in self._attention_modules])
        self._new_tokens = NewTokens()
        for layer in self.layers:
            layer.new_tokens = self._new_tokens
        self._model = model
        self._restore = (model.config._attn_implementation, gate_state(model).mode if model_gates(model) else None)
        if model_gates(model):
            set_gate_mode(model, "infer" if self.policy.gate_kind else "off")
        register_engine_attention()
        model.set_attn_implementation(ENGINE_ATTENTION)

    @property
    def _is_user_defined(self) -> bool:
        return True

    @_is_user_defined.setter
    def _is_user_defined(self, value: bool) -> None:
        """transformers' `generate` marks the cache it was given, once per call: a second call on a cache that
        holds tokens would treat them as the new prompt's prefix (evicted tokens cannot serve as one)."""
        layers = getattr(self, "layers", None)  # None while Cache.__init__ runs
        if layers and layers[0].is_initialized and layers[0].length:
            raise EngineError(f"this BoundedCache already holds {layers[0].length} positions from an earlier call; "
                              "use a new BoundedCache for each generate call")

    def close(self) -> None:
        """Give the model back its attention implementation and gate mode (idempotent)."""
        if self._model is None:
            return
        attention, mode = self._restore
        self._model.set_attn_implementation(attention)
        if mode is not None:
            set_gate_mode(self._model, mode)
        for module in self._attention_modules:
            module.__dict__.pop(_BOUND, None)
        self._model = None

    def __enter__(self) -> "BoundedCache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        if self._model is None:
            raise EngineError("this BoundedCache was closed; create a new one for another generate call")
        if layer_idx == 0:  # a forward begins
            # (checked once per forward: reading the config costs microseconds, a decode step has one per layer)
            if self._config._attn_implementation != ENGINE_ATTENTION:
                raise EngineError(f"BoundedCache needs the model's attention set to {ENGINE_ATTENTION!r}, but it is "
                                  f"{self._config._attn_implementation!r}; do not change it while the cache is in use")
            self._new_tokens.forget()
        layer = self.layers[layer_idx]
        out = layer.update(key_states, value_states)
        self._attention_modules[layer_idx].__dict__[_BOUND] = layer  # (past nn.Module.__setattr__'s checks)
        return out

    def crop(self, max_length: int) -> None:
        raise EngineError("a BoundedCache cannot be cropped (evicted tokens are gone); assisted decoding and "
                          "other rollbacks need a DynamicCache")

    def stats(self) -> CacheStats:
        first = self.layers[0]
        if not first.is_initialized:
            raise EngineError("the cache has not been used yet")
        for layer in self.layers:
            layer.settle_counters()
        held = torch.stack([(layer.positions >= 0).sum(-1).float().mean(0) for layer in self.layers])
        seen = int(first.real_tokens.sum())
        return CacheStats(
            policy=self.policy.name, budget=self.policy.budget, slots=first.slots, tokens_seen=seen,
            decode_steps=first.decode_steps, kv_reads=int(sum(layer.decode_reads for layer in self.layers)),
            full_cache_reads=int(sum(layer.full_cache_reads for layer in self.layers)),
            peak_tokens=torch.stack([layer.peak for layer in self.layers]).cpu(), kept_tokens=held.cpu(),
            bytes_allocated=sum(layer.bytes_allocated for layer in self.layers),
            capacity_evictions=int(sum(layer.capacity_evictions for layer in self.layers)),
            compression=seen / first.keys.shape[0] / max(1e-9, float(held.mean())),
            query_reads=int(sum(layer.query_reads for layer in self.layers)),
            query_full_reads=sum(layer.query_full_reads for layer in self.layers),
            mean_tokens=torch.stack([torch.as_tensor(layer.held_integral, dtype=torch.float64).cpu()
                                     .expand(len(layer.peak)) / max(seen, 1) for layer in self.layers]))


def register_engine_attention() -> None:
    AttentionInterface.register(ENGINE_ATTENTION, engine_attention)
    AttentionMaskInterface.register(ENGINE_ATTENTION, boolean_causal_mask)


def engine_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention through the bound cache layer, or the model's own attention when no BoundedCache is in use."""
    layer = module.__dict__.pop(_BOUND, None)
    if layer is None:
        return gated_attention(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    batch, _, q_len, head_dim = query.shape
    gate = getattr(module, "kv_gate", None)
    gate_values = None
    if gate is not None and gate.active:
        query = gate.mask_query(query)
        gate_values = gate.current_values
    real, positions, stored = layer.new_tokens(attention_mask, kwargs.get("position_ids"), layer.length, batch, q_len,
                                               query.device)
    scaling = head_dim**-0.5 if scaling is None else scaling
    out = layer.attend(query, real, positions, scaling, gate_values, stored)
    return out.transpose(1, 2).contiguous(), None


class NewTokens:
    """Which of a forward's new tokens are real, their positions (int32), and the positions their slots will
    hold (-1 for padding): the same for every layer, so the first layer's attention computes them and the
    others reuse them. `BoundedCache.update` forgets them as each forward begins (at layer 0)."""

    def __init__(self):
        self._value: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def forget(self) -> None:
        self._value = None

    def __call__(self, attention_mask, position_ids, length: int, batch: int, q_len: int, device):
        if self._value is None:
            real = _new_token_real(attention_mask, batch, q_len, device)
            positions = position_ids if position_ids is not None else torch.arange(length, length + q_len, device=device)
            positions = positions.expand(batch, q_len).to(device=device, dtype=torch.int32)
            self._value = (real, positions, slot_positions(positions, real))
        return self._value


def _new_token_real(attention_mask, batch: int, q_len: int, device) -> torch.Tensor:
    """[B, q] True for real tokens: the diagonal of the (new tokens x new tokens) boolean mask."""
    if attention_mask is None:
        return torch.ones(batch, q_len, dtype=torch.bool, device=device)
    if attention_mask.dtype != torch.bool:
        attention_mask = attention_mask == 0
    diagonal = attention_mask[:, 0, :, -q_len:].diagonal(dim1=-2, dim2=-1)
    return diagonal.expand(batch, q_len)
