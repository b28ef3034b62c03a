"""TRIM-KV (arXiv 2512.03324): everything this gate kind is, in one place.

A small retention MLP gives each (token, KV head) a retention beta_i in (0, 1); at query t, key i weighs
beta_i ** (t - i), so its score log(beta_i) * (t - i) decays with age. Training applies that decay softly
(added to the attention logits, or multiplying them); inference keeps, per head, the `budget` keys with
the highest score. The first `sinks` tokens never decay and count inside the budget. Method notes:
docs/methods.md.
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
class TrimKVSettings:
    """TRIM-KV gate settings (the `gate.trimkv` section of a recipe)."""

    hidden: int = 512
    """Width of the retention MLP's hidden layer."""
    bias_init: float = 8.0
    """Initial per-head bias: sigmoid(8) keeps nearly everything at the start."""
    decay: str = "additive"
    """'additive' (log beta * age added to attention logits) or 'multiplicative' (logits scaled by beta ** age)."""
    budget: int = 512
    """M: the capacity-loss target and the per-head budget of the hard inference mask."""
    sinks: int = 0
    """The first tokens of each sequence, never evicted; they count inside the budget."""

    def validate(self, head_dim: int | None = None, prefix: str = "trimkv ") -> None:
        """Reject impossible values; `prefix` names the settings in the message (e.g. 'gate.trimkv.')."""
        if self.budget < 1:
            raise GateError(f"{prefix}budget={self.budget} is invalid; the memory budget M must be >= 1")
        if not 0 <= self.sinks < self.budget:
            raise GateError(f"{prefix}sinks={self.sinks} is invalid; valid: 0 .. budget - 1 = {self.budget - 1}")
        if self.hidden < 1:
            raise GateError(f"{prefix}hidden={self.hidden} is invalid; it must be >= 1")
        if self.decay not in ("additive", "multiplicative"):
            raise GateError(f"{prefix}decay={self.decay!r} is invalid; valid: 'additive', 'multiplicative'")


# --- the rules, shared by training, the quick evaluation and the engine -----------------------------------
def retention_score(log_beta: torch.Tensor, distance: torch.Tensor) -> torch.Tensor:
    """(t - i) * log beta_i, the eviction score and (added to logits) the soft decay. log_beta [B, n, Tk],
    distance [..., Tq, Tk] -> [B, n, Tq, Tk]."""
    return distance.clamp(min=0) * log_beta[:, :, None, :]  # (an integer distance promotes to log_beta's dtype)


def occupancy_from_decay(decay: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Expected kept tokens at each query: sum over visible keys of beta_i ** (t - i) = exp(decay). [B, n, Tq]."""
    return torch.exp(decay.masked_fill(~valid, float("-inf"))).sum(-1)


def topk_visible(log_beta: torch.Tensor, valid: torch.Tensor, distance: torch.Tensor, budget: int,
                 pinned: torch.Tensor | None = None) -> torch.Tensor:
    """Hard inference visibility: at each query, only the `budget` visible keys with the highest retention
    score. `pinned` ([B, 1 or n, Tk]) keys (sinks) always stay and count inside the budget."""
    score = retention_score(log_beta, distance)
    if pinned is not None:
        score = score.masked_fill(pinned[:, :, None, :], float("inf"))
    score = score.masked_fill(~valid, float("-inf"))
    k = min(budget, score.shape[-1])
    top = score.topk(k, dim=-1).indices
    keep = torch.zeros_like(score, dtype=torch.bool).scatter_(-1, top, True)
    return keep & valid


# --- the gate module ---------------------------------------------------------------------------------------
class TrimKVGate(KVGate):
    """TRIM-KV retention MLP: log beta per (token, KV head); a key's weight decays as beta ** age."""

    settings: TrimKVSettings

    def __init__(self, config, layer_idx: int, state: GateState, settings: TrimKVSettings):
        super().__init__(config, layer_idx, state, settings)
        self.up = nn.Linear(config.hidden_size, settings.hidden, bias=True)  # then SiLU
        self.down = nn.Linear(settings.hidden, self.num_kv_heads, bias=False)
        self.head_bias = nn.Parameter(torch.empty(self.num_kv_heads))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for linear in (self.up, self.down):
            nn.init.normal_(linear.weight, std=0.02)
        nn.init.zeros_(self.up.bias)
        nn.init.constant_(self.head_bias, float(self.settings.bias_init))

    def compute(self, residual, normed, layer_norm=None):
        # functional calls: a decode step runs this once per layer, where module-call overhead is a visible share
        hidden = F.silu(F.linear(at_least_float32(normed), self.up.weight, self.up.bias))
        return F.logsigmoid(F.linear(hidden, self.down.weight, self.head_bias)).transpose(1, 2)  # log beta [B, Hkv, T]

    @property
    def multiplicative(self) -> bool:
        return self.settings.decay == "multiplicative" and self.state.mode is GateMode.TRAIN

    def _retention(self, valid, q_len, k_len):
        """Sets `outputs`; returns (log beta [B, n, Tk] with sinks at 0, distance, soft decay, sinks)."""
        sink = self.sink_keys(valid)
        log_beta = self._sequence_values(q_len, k_len).masked_fill(sink, 0.0)  # a sink never decays
        distance = query_key_distance(q_len, k_len, log_beta.device)
        decay = retention_score(log_beta, distance)  # [B, Hkv, Tq, Tk], shared by occupancy and bias
        self.outputs = {"log_beta": log_beta, "occupancy": occupancy_from_decay(decay, valid)}
        return log_beta, distance, decay, sink

    def attention_bias(self, valid, q_len, k_len, dtype):
        log_beta, distance, decay, sink = self._retention(valid, q_len, k_len)
        if self.multiplicative:
            return visible_to_bias(valid, dtype)  # the decay multiplies logits in the eager path instead
        if self.state.mode is GateMode.TRAIN:
            return decay.to(dtype).masked_fill(~valid, masked_value(dtype))
        return visible_to_bias(topk_visible(log_beta, valid, distance, self.settings.budget, pinned=sink), dtype)

    def attention_score_mod(self, valid, q_len, k_len, dtype) -> ScoreMod:
        if self.multiplicative:
            raise GateError("multiplicative TRIM-KV decay scales logits and has no score_mod; use the eager path")
        log_beta, distance, _, sink = self._retention(valid, q_len, k_len)
        low, past, group = masked_value(dtype), k_len - q_len, self.query_group()
        if self.state.mode is GateMode.TRAIN:
            def decay_mod(score, b, h, q, kv):
                decayed = score + (q + past - kv).clamp(min=0) * log_beta[b, h // group, kv]
                return torch.where(valid[b, 0, q, kv], decayed, low)

            return decay_mod
        bias = visible_to_bias(topk_visible(log_beta, valid, distance, self.settings.budget, pinned=sink), dtype)
        return lambda score, b, h, q, kv: score + bias[b, h // group, q, kv]

    def decay_factor(self, q_len: int, k_len: int) -> torch.Tensor:
        """beta_i ** (t - i), for the multiplicative variant that scales attention logits."""
        distance = query_key_distance(q_len, k_len, self.outputs["log_beta"].device)
        return torch.exp(retention_score(self.outputs["log_beta"], distance))


# --- losses and statistics -----------------------------------------------------------------------------------
def capacity_loss(occupancy: list[torch.Tensor], attention_mask: torch.Tensor, budget: float) -> torch.Tensor:
    """mean_t relu(occupancy_t - M) / (t + 1), per layer and head, over real query positions."""
    occ = torch.stack(occupancy, dim=1)  # [B, L, Hkv, T]
    real = attention_mask.bool()
    t = (attention_mask.cumsum(-1) - 1).clamp(min=0).to(occ.dtype)  # position among real tokens
    per_token = torch.relu(occ - budget) / (t + 1)[:, None, None, :]
    mask = real[:, None, None, :].to(occ.dtype)
    return (per_token * mask).sum() / (mask.sum() * occ.shape[1] * occ.shape[2]).clamp(min=1)


class TrimKVKind(GateKind):
    name = "trimkv"
    settings_type = TrimKVSettings
    gate_type = TrimKVGate
    anneals_cr = False  # trained for one memory budget M

    def capacity_terms(self, outputs, attention_mask, settings, eviction_target, loss):
        occupancy = [o["occupancy"] for o in outputs]
        mean = torch.stack([o.detach().float().mean() for o in occupancy]).mean()
        return {"capacity": capacity_loss(occupancy, attention_mask, settings.budget), "occupancy": mean}

    def statistics(self, out):
        return {"retention": out["log_beta"].exp(), "occupancy": out["occupancy"]}

    def kv_reads(self, outputs, attention_mask, settings):
        """Each real query reads min(its position, M) keys per head: the hard mask keeps at most M."""
        per_head = len(outputs) * outputs[0]["log_beta"].shape[1]
        positions = attention_mask.cumsum(-1)
        return int(positions.clamp(max=settings.budget)[attention_mask.bool()].sum()) * per_head
