"""DMS (Dynamic Memory Sparsification, arXiv 2506.05345): everything this gate kind is, in one place.

A binary eviction decision per (token, KV head) comes from a repurposed query neuron or a small adapter,
as a logistic-noised sigmoid in training and a hard threshold at inference. The decision made at token
t + 1 marks key t (the one-token shift), and an evicted key stays readable until it falls out of a sliding
window (delayed eviction). The first `sinks` tokens are never evicted. Method notes: docs/methods.md.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from models.gates.base import (
    GateError,
    GateKind,
    GateMode,
    GateState,
    KVGate,
    ScoreMod,
    at_least_float32,
    visible_to_bias,
)
from models.masks import masked_value, query_key_distance


@dataclasses.dataclass
class DMSSettings:
    """DMS gate settings (the `gate.dms` section of a recipe)."""

    window: int = 256
    """Tokens an evicted key stays readable after its eviction is decided (the sliding window)."""
    source: str = "query_neuron"
    """Where decisions come from: 'query_neuron' (a repurposed q_proj channel) or 'adapter' (a small linear gate)."""
    neuron_channel: int = -1
    """query_neuron: the head-dim channel repurposed in the first query head of each KV group."""
    alpha_scale: float = 100.0
    """Decision logit = alpha_scale * raw value - offset."""
    offset: float = 5.0
    """Decision logit offset: a fresh gate starts at sigmoid(-offset), nearly no eviction."""
    tau: float = 0.1
    """Temperature of the logistic-noised sigmoid in training."""
    per_layer: bool = False
    """One decision per layer shared by all KV heads, instead of one per KV head."""
    sinks: int = 4
    """The first tokens of each sequence, never evicted (docs/experiments/2026-11-30-dms-quality.md)."""

    def validate(self, head_dim: int | None = None, prefix: str = "dms ") -> None:
        """Reject impossible values; `prefix` names the settings in the message (e.g. 'gate.dms.')."""
        if self.window < 0:
            raise GateError(f"{prefix}window={self.window} is invalid; it must be an integer >= 0")
        if self.sinks < 0:
            raise GateError(f"{prefix}sinks={self.sinks} is invalid; it must be an integer >= 0")
        if self.source not in ("query_neuron", "adapter"):
            raise GateError(f"{prefix}source={self.source!r} is invalid; valid: 'query_neuron', 'adapter'")
        if head_dim is not None and not -head_dim <= self.neuron_channel < head_dim:
            raise GateError(f"{prefix}neuron_channel={self.neuron_channel} is outside the head dim {head_dim}; "
                            f"valid: {-head_dim} .. {head_dim - 1}")
        if self.tau <= 0:
            raise GateError(f"{prefix}tau={self.tau} is invalid; it must be > 0")


# --- the rules, shared by training, the quick evaluation and the engine -----------------------------------
def shift(x: torch.Tensor, fill) -> torch.Tensor:
    """The one-token shift: the decision made at position i+1 marks key i; the newest key has none yet."""
    return torch.cat([x[..., 1:], torch.full_like(x[..., :1], fill)], dim=-1)


def evicts(logit: torch.Tensor) -> torch.Tensor:
    """The hard inference decision: evict where the logit is positive."""
    return logit > 0


def decided_keys(attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, T] keys that carry a real decision: the key and the next token (which decides for it) are real."""
    decided = torch.zeros_like(attention_mask, dtype=torch.bool)
    decided[:, :-1] = attention_mask[:, :-1].bool() & attention_mask[:, 1:].bool()
    return decided


def soft_bias(key_log_keep: torch.Tensor, distance: torch.Tensor, window: int) -> torch.Tensor:
    """Training mask [B, n, Tq, Tk]: 0 inside the window, log(1 - alpha_i) outside it (alpha_i = eviction
    probability of key i). key_log_keep: [B, n, Tk], already aligned to keys (shifted)."""
    outside = (distance > window).to(key_log_keep.dtype)
    return key_log_keep[:, :, None, :] * outside


def hard_visible(key_evicted: torch.Tensor, distance: torch.Tensor, window: int) -> torch.Tensor:
    """Inference visibility: an evicted key stays visible while t - i <= window and disappears after.
    key_evicted [B, n, Tk] against distance [..., Tq, Tk] gives [B, n, Tq, Tk]."""
    return ~(key_evicted[:, :, None, :] & (distance > window))


def logistic_noise(shape, generator: torch.Generator | None, device, dtype=torch.float32) -> torch.Tensor:
    """Difference of two Gumbel(0, 1) samples, i.e. standard logistic noise."""
    u = torch.rand(shape, generator=generator, device=device, dtype=dtype).clamp_(1e-6, 1 - 1e-6)
    return torch.log(u) - torch.log1p(-u)


def log_keep_from_logit(noisy_logit: torch.Tensor) -> torch.Tensor:
    """log(1 - sigmoid(x)) computed stably."""
    return F.logsigmoid(-noisy_logit)


def read_keys(key_evicted: torch.Tensor, attention_mask: torch.Tensor, window: int) -> torch.Tensor:
    """Keys each real query reads under hard decisions (the attention mask's own rule): [B, n, T]."""
    length = attention_mask.shape[1]
    distance = query_key_distance(length, length, attention_mask.device)
    real = attention_mask.bool()
    valid = (distance >= 0) & real[:, None, None, :] & real[:, None, :, None]
    return (valid & hard_visible(key_evicted.bool(), distance, window)).sum(-1)


# --- the gate module ---------------------------------------------------------------------------------------
class DMSGate(KVGate):
    """DMS eviction decisions from a repurposed query neuron or a small adapter, with delayed eviction."""

    settings: DMSSettings

    def __init__(self, config, layer_idx: int, state: GateState, settings: DMSSettings):
        super().__init__(config, layer_idx, state, settings)
        self.num_decisions = 1 if settings.per_layer else self.num_kv_heads
        self.channel = settings.neuron_channel % self.head_dim
        if settings.source == "adapter":
            self.norm = nn.RMSNorm(config.hidden_size, eps=getattr(config, "rms_norm_eps", 1e-6))
            # zero-initialised: every logit starts at -offset; the bias moves the eviction rate directly
            self.proj = nn.Linear(config.hidden_size, self.num_decisions, bias=True)
            self._fold: tuple[tuple, tuple[torch.Tensor, torch.Tensor] | None] = ((), None)  # see _adapter_on_normed
        # query heads whose `channel` carries a decision: the first head of each KV group
        step = self.group * self.num_kv_heads if settings.per_layer else self.group
        self.decision_heads = list(range(0, config.num_attention_heads, step))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.settings.source == "adapter":
            nn.init.ones_(self.norm.weight)
            nn.init.zeros_(self.proj.weight)
            nn.init.zeros_(self.proj.bias)

    @property
    def num_outputs(self) -> int:
        return self.num_decisions

    @property
    def neuron_indices(self) -> list[int]:
        if self.settings.source != "query_neuron":
            return []
        return [h * self.head_dim + self.channel for h in self.decision_heads]

    def install_hooks(self, layer: nn.Module) -> None:
        super().install_hooks(layer)
        if self.settings.source == "query_neuron":
            self._hooks.append(layer.self_attn.q_proj.register_forward_hook(self._on_q_proj))

    def compute(self, residual, normed, layer_norm=None):
        if self.settings.source != "adapter":
            return None
        if self.state.mode is GateMode.INFER and layer_norm is not None:
            folded = self._adapter_on_normed(layer_norm, normed.dtype)
            if folded is not None:
                return F.linear(normed, *folded).transpose(1, 2)
        x = self.proj(self.norm(at_least_float32(residual)))  # [B, T, n]
        return self._logit(x)

    def _adapter_on_normed(self, layer_norm: nn.Module, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Inference shortcut: the adapter's RMSNorm and the layer's input RMSNorm normalise the same residual
        with the same eps, so the adapter's logit is one affine map of the layer's normed input, with that norm's
        weight divided out and alpha_scale and offset folded in: one matmul instead of a second normalisation
        (which dispatches six small ops per layer and token). (weight, bias), rebuilt when a parameter changes; None
        where the shortcut would lose precision or does not apply: a half-precision input (the full path reads
        the float32 residual), another eps, a zero in the norm's weight, parameters partitioned by ZeRO-3."""
        if torch.compiler.is_compiling() and self._fold[0]:
            return self._fold[1]  # (the eager prefill built it; a rebuild inside a graph would read weights back)
        tensors = (layer_norm.weight, self.norm.weight, self.proj.weight, self.proj.bias)
        key = tuple((id(t), t._version) for t in tensors) + (dtype, self.settings.alpha_scale, self.settings.offset)
        if self._fold[0] != key:
            self._fold = (key, self._fold_adapter(layer_norm, dtype))
        return self._fold[1]

    def _fold_adapter(self, layer_norm: nn.Module, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
        norm_weight = layer_norm.weight
        if (dtype not in (torch.float32, torch.float64) or getattr(layer_norm, "variance_epsilon", None) != self.norm.eps
                or any(hasattr(t, "ds_id") for t in (norm_weight, self.proj.weight))
                or norm_weight.shape != self.norm.weight.shape or not bool((norm_weight != 0).all())):
            return None
        alpha = self.settings.alpha_scale
        with torch.no_grad():
            weight = self.proj.weight.double() * (alpha * self.norm.weight.double() / norm_weight.double())
            bias = alpha * self.proj.bias.double() - self.settings.offset
        return weight.to(dtype), bias.to(dtype)

    def _on_q_proj(self, q_proj, args, out):
        if not self.active:
            return None
        idx = self.neuron_indices
        self._current = self._logit(out[..., idx])
        keep = torch.ones(out.shape[-1], dtype=out.dtype, device=out.device)
        keep[idx] = self.state.neuron_keep
        return out * keep  # zeroed before RoPE (and again after it, in mask_query)

    def _logit(self, x: torch.Tensor) -> torch.Tensor:
        return (self.settings.alpha_scale * at_least_float32(x) - self.settings.offset).transpose(1, 2)

    def mask_query(self, query):
        if self.settings.source != "query_neuron":
            return query
        keep = torch.ones(query.shape[1], 1, query.shape[-1], dtype=query.dtype, device=query.device)
        keep[self.decision_heads, :, self.channel] = self.state.neuron_keep
        return query * keep

    def _decide(self, valid, q_len, k_len) -> torch.Tensor:
        """Sets `outputs`; returns per-key log(1 - alpha) in training, per-key hard evictions at inference."""
        logit = self._sequence_values(q_len, k_len)  # [B, n, Tk], position-aligned
        sink = self.sink_keys(valid)
        if self.state.mode is GateMode.TRAIN:
            tau = self.state.tau or self.settings.tau
            noise = torch.stack([logistic_noise(logit.shape[1:], self._noise_generator(logit.device, row),
                                                logit.device, logit.dtype) for row in range(logit.shape[0])])
            noisy = (logit + noise) / tau
            soft = torch.sigmoid(noisy)
            hard = (soft > 0.5).to(soft.dtype) - soft.detach() + soft
            # sinks are kept whatever their gate says: no eviction, no gradient, counted as kept by the capacity loss
            self.outputs = {"evict_hard": shift(hard, 0.0).masked_fill(sink, 0.0),
                            "evict_prob": shift(soft, 0.0).masked_fill(sink, 0.0),
                            "logit": shift(logit, -1e4), "sink": sink}
            return shift(log_keep_from_logit(noisy), 0.0).masked_fill(sink, 0.0)
        evicted = shift(evicts(logit), False) & ~sink
        self.outputs = {"evict_hard": evicted.float(), "logit": shift(logit, -1e4), "sink": sink}
        return evicted

    def attention_bias(self, valid, q_len, k_len, dtype):
        per_key = self._decide(valid, q_len, k_len)
        distance = query_key_distance(q_len, k_len, per_key.device)
        if self.state.mode is GateMode.TRAIN:
            return soft_bias(per_key, distance, self.settings.window).to(dtype).masked_fill(~valid, masked_value(dtype))
        return visible_to_bias(valid & hard_visible(per_key, distance, self.settings.window), dtype)

    def attention_score_mod(self, valid, q_len, k_len, dtype) -> ScoreMod:
        per_key = self._decide(valid, q_len, k_len)
        w, past, low, group = self.settings.window, k_len - q_len, masked_value(dtype), self.query_group()
        if self.state.mode is GateMode.TRAIN:
            def soft_mod(score, b, h, q, kv):
                decayed = score + torch.where(q + past - kv > w, per_key[b, h // group, kv], 0.0)
                return torch.where(valid[b, 0, q, kv], decayed, low)

            return soft_mod

        def hard_mod(score, b, h, q, kv):
            gone = per_key[b, h // group, kv] & (q + past - kv > w)
            return torch.where(valid[b, 0, q, kv] & ~gone, score, low)

        return hard_mod

    def _noise_generator(self, device, row: int) -> torch.Generator:
        """Noise keyed by (seed, step, layer, global row): a row draws the same noise whatever the batch
        size, rank count or accumulation that delivers it, and a resumed run draws it again."""
        key = (((self.state.noise_seed * 1_000_003 + self.state.step) * 1009 + self.layer_idx) * 100_003
               + self.state.row_offset + row)
        return torch.Generator(device=device).manual_seed(key % (2**63 - 1))


# --- losses and statistics -----------------------------------------------------------------------------------
def capacity_loss(evict_hard: list[torch.Tensor], attention_mask: torch.Tensor, target: float):
    """One-sided L1: relu(target - eviction fraction) per sequence, averaged; over-compression is free.

    evict_hard: per layer [B, n, T] (straight-through). Returns (loss, achieved fraction without gradient).
    """
    valid = decided_keys(attention_mask)[:, None, None, :]  # [B, 1, 1, T]
    decisions = torch.stack(evict_hard, dim=1)  # [B, L, n, T]
    count = (valid.sum((-1,)) * decisions.shape[1] * decisions.shape[2]).squeeze(-1).squeeze(-1).clamp(min=1)
    per_sequence = (decisions * valid).sum((1, 2, 3)) / count
    return torch.relu(target - per_sequence).mean(), per_sequence.detach().mean()


def head_cap_loss(evict_hard: list[torch.Tensor], attention_mask: torch.Tensor, cap: float) -> torch.Tensor:
    """Per-(layer, KV head) guard: mean over gates of relu(eviction fraction - cap).

    The capacity loss constrains only the average, so single heads may drift to evicting everything (a
    bare window), where their decisions saturate and no loss pulls them back; this term does.
    """
    valid = decided_keys(attention_mask)[:, None, :].to(evict_hard[0].dtype)  # [B, 1, T]
    per_head = torch.stack([(e * valid).sum((0, 2)) / valid.sum((0, 2)).clamp(min=1) for e in evict_hard])
    return torch.relu(per_head - cap).mean()


def uncertain_share(outputs: list[dict[str, torch.Tensor]], attention_mask: torch.Tensor,
                    margin: float = 3.0) -> torch.Tensor:
    """Share of a forward's decisions with |logit| < margin, where logistic noise can still flip them.

    A saturated gate (|logit| far above the noise) gets no gradient from either loss; this is the early
    warning. Counts real keys that have a decision (the next token is real) and are not sinks.
    """
    near, total = 0.0, 0.0
    decided = decided_keys(attention_mask)
    for out in outputs:
        keys = decided[:, None, -out["logit"].shape[-1]:] & ~out["sink"]
        near = near + ((out["logit"].detach().abs() < margin) & keys).sum()
        total = total + keys.expand_as(out["logit"]).sum()
    return torch.as_tensor(near / max(total, 1), dtype=torch.float32)


SATURATED_EVICTION = 0.98  # a (layer, KV head) evicting more than this share of keys has collapsed


class DMSKind(GateKind):
    name = "dms"
    settings_type = DMSSettings
    gate_type = DMSGate
    anneals_cr = True

    def capacity_terms(self, outputs, attention_mask, settings, eviction_target, loss):
        evict_hard = [o["evict_hard"] for o in outputs]
        capacity, achieved = capacity_loss(evict_hard, attention_mask, eviction_target)
        terms = {"capacity": capacity, "evict_fraction": achieved, "evict_target": torch.tensor(eviction_target),
                 "uncertain": uncertain_share(outputs, attention_mask)}
        if loss.head_cap_weight:
            terms["head_cap"] = head_cap_loss(evict_hard, attention_mask, loss.head_cap)
        return terms

    def statistics(self, out):
        return {"evict_fraction": out["evict_hard"].float()}

    def table_statistics(self, table):
        return {"saturated_heads": (table["evict_fraction"] > SATURATED_EVICTION).sum().float()}

    def kv_reads(self, outputs, attention_mask, settings):
        return sum(int(read_keys(out["evict_hard"], attention_mask, settings.window).sum()) for out in outputs)
