"""Learned eviction gates (DMS, TRIM-KV) attached in place to a Hugging Face GQA causal LM.

A gate maps a layer's inputs to one value per (token, KV head): a DMS eviction logit or a TRIM-KV
log-retention. It listens to the layer through forward hooks (the residual stream at `input_layernorm`,
the query projection for DMS's repurposed neuron) and hands the attention function (models.attention)
an additive per-KV-head bias. All gates of a model share one `GateState`, so switching between the
teacher (gates off), training (noisy, soft) and inference (hard) modes copies nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
from typing import Any

import torch
from torch import nn

from models import masks

SUPPORTED_FAMILIES = ("llama", "qwen2", "qwen3", "mistral")
ATTENTION_NAME = "retrokv"


class GateError(ValueError):
    """Gate settings or a model the gates cannot serve, with the valid alternatives."""


class GateMode(str, enum.Enum):
    OFF = "off"  # exact original model: the distillation teacher
    TRAIN = "train"  # logistic noise, soft masks, straight-through hard decisions
    INFER = "infer"  # hard decisions, no noise


@dataclasses.dataclass
class GateState:
    """Run-time switches shared by every gate of one model."""

    mode: GateMode = GateMode.OFF
    step: int = 0  # seeds the DMS noise together with noise_seed and the layer index
    noise_seed: int = 0  # the run's seed: with step, layer and global row it fixes every noise draw
    row_offset: int = 0  # global index of this micro-batch's first row (rank and micro-batch folded in)
    neuron_keep: float = 0.0  # DMS query-neuron fade: 1 at the start of warm-up, 0 once it is repurposed
    tau: float | None = None  # overrides the settings' temperature when the trainer anneals it


@dataclasses.dataclass
class DMSSettings:
    """Dynamic Memory Sparsification (REFERENCE.md, DMS)."""

    window: int = 256
    source: str = "query_neuron"  # "query_neuron" | "adapter"
    neuron_channel: int = -1
    alpha_scale: float = 100.0
    offset: float = 5.0
    tau: float = 0.1
    per_layer: bool = False
    sinks: int = 4  # the first tokens of each sequence are never evicted (docs/experiments/2026-11-30-dms-quality.md)

    def validate(self, head_dim: int) -> None:
        if self.window < 0:
            raise GateError(f"dms window={self.window} is invalid; it must be an integer >= 0")
        if self.sinks < 0:
            raise GateError(f"dms sinks={self.sinks} is invalid; it must be an integer >= 0")
        if self.source not in ("query_neuron", "adapter"):
            raise GateError(f"dms source={self.source!r} is invalid; valid: 'query_neuron', 'adapter'")
        if not -head_dim <= self.neuron_channel < head_dim:
            raise GateError(f"dms neuron_channel={self.neuron_channel} is outside the head dim {head_dim}; "
                            f"valid: {-head_dim} .. {head_dim - 1}")
        if self.tau <= 0:
            raise GateError(f"dms tau={self.tau} is invalid; it must be > 0")


@dataclasses.dataclass
class TrimKVSettings:
    """TRIM-KV retention gates (REFERENCE.md, TRIM-KV)."""

    hidden: int = 512
    bias_init: float = 8.0
    decay: str = "additive"  # "additive" | "multiplicative"
    budget: int = 512  # M: the capacity-loss target and the per-head budget of the hard inference mask
    sinks: int = 0  # the first tokens of each sequence are never evicted; they count inside the budget

    def validate(self, head_dim: int) -> None:
        if not 0 <= self.sinks < self.budget:
            raise GateError(f"trimkv sinks={self.sinks} is invalid; valid: 0 .. budget - 1 = {self.budget - 1}")
        if self.hidden < 1:
            raise GateError(f"trimkv hidden={self.hidden} is invalid; it must be >= 1")
        if self.decay not in ("additive", "multiplicative"):
            raise GateError(f"trimkv decay={self.decay!r} is invalid; valid: 'additive', 'multiplicative'")
        if self.budget < 1:
            raise GateError(f"trimkv budget={self.budget} is invalid; it must be >= 1")


SETTINGS = {"dms": DMSSettings, "trimkv": TrimKVSettings}


def make_settings(kind: str, **settings: Any) -> DMSSettings | TrimKVSettings:
    if kind not in SETTINGS:
        raise GateError(f"unknown gate kind {kind!r}; valid: {sorted(SETTINGS)}")
    cls = SETTINGS[kind]
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(settings) - names)
    if unknown:
        raise GateError(f"unknown {kind} gate setting(s) {unknown}; valid: {sorted(names)}")
    return cls(**settings)


class KVGate(nn.Module):
    """Common plumbing: hooks, the per-position values of the current forward, and a decode history."""

    def __init__(self, config, layer_idx: int, state: GateState):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_kv_heads = config.num_key_value_heads
        self.group = config.num_attention_heads // config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.state = state  # plain attribute: shared, not a submodule
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        self._current: torch.Tensor | None = None  # [B, n, Tq] per-position gate values of this forward
        self._history: torch.Tensor | None = None  # [B, n, past] values of earlier decode steps
        self.outputs: dict[str, torch.Tensor] = {}

    @property
    def active(self) -> bool:
        return self.state.mode is not GateMode.OFF

    def install_hooks(self, layer: nn.Module) -> None:
        """(Re)attach to the layer's current submodules; call again after peft wraps them."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = [layer.input_layernorm.register_forward_hook(self._on_layer_input)]

    def _on_layer_input(self, norm, args, normed):
        if self.active:
            self._current = self.compute(residual=args[0], normed=normed)

    def compute(self, residual: torch.Tensor, normed: torch.Tensor) -> torch.Tensor | None:
        """Per-position gate values [B, n, T] from the layer input; None when they come from elsewhere."""
        raise NotImplementedError

    def mask_query(self, query: torch.Tensor) -> torch.Tensor:
        return query

    def _query_group(self) -> int:
        """Query heads per gate output: G for per-KV-head gates, all heads for one decision per layer."""
        return self.group * self.num_kv_heads // self._num_outputs()

    def _num_outputs(self) -> int:
        return self.num_kv_heads

    def _sequence_values(self, q_len: int, k_len: int) -> torch.Tensor:
        """Gate values for all k_len keys: the decode history followed by this forward's values."""
        if self._current is None:
            raise GateError(f"layer {self.layer_idx}: the gate saw no input in this forward; was the layer's "
                            "input_layernorm replaced after attach_gates?")
        past = k_len - q_len
        if past == 0:
            values = self._current
        else:
            if self.state.mode is GateMode.TRAIN:
                raise GateError("training-mode gates need the whole sequence in one forward (no KV cache); "
                                "use GateMode.INFER for cached generation")
            if self._history is None or self._history.shape[-1] != past:
                have = 0 if self._history is None else self._history.shape[-1]
                raise GateError(f"layer {self.layer_idx}: the cache holds {past} earlier tokens but the gate saw "
                                f"{have}; gated generation needs a cache that keeps every token in order (DynamicCache), "
                                "or eval.engine.BoundedCache for one that evicts")
            values = torch.cat([self._history, self._current], dim=-1)
        if self.state.mode is GateMode.INFER:
            self._history = values.detach()
        return values

    def sink_keys(self, valid: torch.Tensor) -> torch.Tensor:
        """[B, 1, Tk] True for the sequence's first `sinks` real keys, which are never evicted."""
        return masks.sink_keys(valid, self.settings.sinks)[:, None]

    def attention_bias(self, valid: torch.Tensor, q_len: int, k_len: int, dtype: torch.dtype, as_score_mod: bool = False):
        """Additive float bias [B, n, Tq, Tk] with the causal/padding pattern `valid` folded in, or (as_score_mod)
        the same bias as a FlexAttention score_mod computed from per-key vectors."""
        raise NotImplementedError


class DMSGate(KVGate):
    """DMS eviction decisions from a repurposed query neuron or a small adapter, with delayed eviction."""

    def __init__(self, config, layer_idx: int, state: GateState, settings: DMSSettings):
        super().__init__(config, layer_idx, state)
        self.settings = settings
        self.num_decisions = 1 if settings.per_layer else self.num_kv_heads
        self.channel = settings.neuron_channel % self.head_dim
        if settings.source == "adapter":
            self.norm = nn.RMSNorm(config.hidden_size, eps=getattr(config, "rms_norm_eps", 1e-6))
            # zero-initialised: every logit starts at -offset; the bias moves the eviction rate directly
            self.proj = nn.Linear(config.hidden_size, self.num_decisions, bias=True)
            nn.init.zeros_(self.proj.weight)
            nn.init.zeros_(self.proj.bias)
        # query heads whose `channel` carries a decision: the first head of each KV group
        step = self.group * self.num_kv_heads if settings.per_layer else self.group
        self.decision_heads = list(range(0, config.num_attention_heads, step))

    def _num_outputs(self) -> int:
        return self.num_decisions

    def install_hooks(self, layer: nn.Module) -> None:
        super().install_hooks(layer)
        if self.settings.source == "query_neuron":
            self._hooks.append(layer.self_attn.q_proj.register_forward_hook(self._on_q_proj))

    def compute(self, residual, normed):
        if self.settings.source != "adapter":
            return None
        x = self.proj(self.norm(_at_least_float32(residual)))  # [B, T, n]
        return self._logit(x)

    def _neuron_flat_index(self) -> list[int]:
        return [h * self.head_dim + self.channel for h in self.decision_heads]

    def _on_q_proj(self, q_proj, args, out):
        if not self.active:
            return None
        idx = self._neuron_flat_index()
        self._current = self._logit(out[..., idx])
        keep = torch.ones(out.shape[-1], dtype=out.dtype, device=out.device)
        keep[idx] = self.state.neuron_keep
        return out * keep  # zeroed before RoPE (and again after it, in mask_query)

    def _logit(self, x: torch.Tensor) -> torch.Tensor:
        return (self.settings.alpha_scale * _at_least_float32(x) - self.settings.offset).transpose(1, 2)

    def mask_query(self, query):
        if self.settings.source != "query_neuron":
            return query
        keep = torch.ones(query.shape[1], 1, query.shape[-1], dtype=query.dtype, device=query.device)
        keep[self.decision_heads, :, self.channel] = self.state.neuron_keep
        return query * keep

    def attention_bias(self, valid, q_len, k_len, dtype, as_score_mod=False):
        logit = self._sequence_values(q_len, k_len)  # [B, n, Tk], position-aligned
        distance = masks.query_key_distance(q_len, k_len, logit.device)
        sink = self.sink_keys(valid)
        w, past, low = self.settings.window, k_len - q_len, masks.masked_value(dtype)
        if self.state.mode is GateMode.TRAIN:
            tau = self.state.tau or self.settings.tau
            noise = torch.stack([masks.dms_logistic_noise(logit.shape[1:], self._noise_generator(logit.device, row),
                                                          logit.device, logit.dtype) for row in range(logit.shape[0])])
            noisy = (logit + noise) / tau
            soft = torch.sigmoid(noisy)
            hard = (soft > 0.5).to(soft.dtype) - soft.detach() + soft
            # sinks are kept whatever their gate says: no eviction, no gradient, counted as kept by the capacity loss
            self.outputs = {"evict_hard": _shift(hard, 0.0).masked_fill(sink, 0.0),
                            "evict_prob": _shift(soft, 0.0).masked_fill(sink, 0.0),
                            "logit": _shift(logit, -1e4), "sink": sink}
            log_keep = _shift(masks.log_keep_from_logit(noisy), 0.0).masked_fill(sink, 0.0)
            if as_score_mod:
                group = self._query_group()

                def soft_mod(score, b, h, q, kv):
                    decayed = score + torch.where(q + past - kv > w, log_keep[b, h // group, kv], 0.0)
                    return torch.where(valid[b, 0, q, kv], decayed, low)

                return soft_mod
            bias = masks.dms_soft_bias(log_keep, distance, w)
            return bias.to(dtype).masked_fill(~valid, low)
        evicted = _shift(logit > 0, False) & ~sink
        self.outputs = {"evict_hard": evicted.float(), "logit": _shift(logit, -1e4), "sink": sink}
        if as_score_mod:
            group = self._query_group()

            def hard_mod(score, b, h, q, kv):
                gone = evicted[b, h // group, kv] & (q + past - kv > w)
                return torch.where(valid[b, 0, q, kv] & ~gone, score, low)

            return hard_mod
        visible = valid & masks.dms_hard_visible(evicted, distance, w)
        return _visible_to_bias(visible, dtype)

    def _noise_generator(self, device, row: int) -> torch.Generator:
        """Noise keyed by (seed, step, layer, global row): a row draws the same noise whatever the batch
        size, rank count or accumulation that delivers it, and a resumed run draws it again."""
        key = (((self.state.noise_seed * 1_000_003 + self.state.step) * 1009 + self.layer_idx) * 100_003
               + self.state.row_offset + row)
        return torch.Generator(device=device).manual_seed(key % (2**63 - 1))


class TrimKVGate(KVGate):
    """TRIM-KV retention MLP: log beta per (token, KV head); a key's weight decays as beta ** age."""

    def __init__(self, config, layer_idx: int, state: GateState, settings: TrimKVSettings):
        super().__init__(config, layer_idx, state)
        self.settings = settings
        self.up = nn.Linear(config.hidden_size, settings.hidden, bias=True)
        self.act = nn.SiLU()
        self.down = nn.Linear(settings.hidden, self.num_kv_heads, bias=False)
        self.head_bias = nn.Parameter(torch.full((self.num_kv_heads,), float(settings.bias_init)))
        for linear in (self.up, self.down):
            nn.init.normal_(linear.weight, std=0.02)
        nn.init.zeros_(self.up.bias)

    def compute(self, residual, normed):
        x = self.down(self.act(self.up(_at_least_float32(normed)))) + self.head_bias
        return torch.nn.functional.logsigmoid(_at_least_float32(x)).transpose(1, 2)  # log beta [B, Hkv, T]

    @property
    def multiplicative(self) -> bool:
        return self.settings.decay == "multiplicative" and self.state.mode is GateMode.TRAIN

    def attention_bias(self, valid, q_len, k_len, dtype, as_score_mod=False):
        sink = self.sink_keys(valid)
        log_beta = self._sequence_values(q_len, k_len).masked_fill(sink, 0.0)  # a sink never decays
        distance = masks.query_key_distance(q_len, k_len, log_beta.device)
        decay = masks.trimkv_bias(log_beta, distance)  # [B, Hkv, Tq, Tk], shared by occupancy and bias
        self.outputs = {"log_beta": log_beta, "occupancy": masks.occupancy_from_decay(decay, valid)}
        low, past = masks.masked_value(dtype), k_len - q_len
        if self.multiplicative:
            return _visible_to_bias(valid, dtype)  # the decay multiplies logits in the eager path instead
        if self.state.mode is GateMode.TRAIN:
            if as_score_mod:
                group = self._query_group()

                def decay_mod(score, b, h, q, kv):
                    decayed = score + (q + past - kv).clamp(min=0) * log_beta[b, h // group, kv]
                    return torch.where(valid[b, 0, q, kv], decayed, low)

                return decay_mod
            return decay.to(dtype).masked_fill(~valid, low)
        visible = masks.trimkv_topk_visible(log_beta, valid, distance, self.settings.budget, pinned=sink)
        bias = _visible_to_bias(visible, dtype)
        if as_score_mod:
            group = self._query_group()
            return lambda score, b, h, q, kv: score + bias[b, h // group, q, kv]
        return bias

    def decay_factor(self, q_len: int, k_len: int) -> torch.Tensor:
        """beta_i ** (t - i), for the multiplicative variant that scales attention logits."""
        distance = masks.query_key_distance(q_len, k_len, self.outputs["log_beta"].device)
        return torch.exp(masks.trimkv_bias(self.outputs["log_beta"], distance))


def _at_least_float32(x: torch.Tensor) -> torch.Tensor:
    """Gate values in float32 even for a bf16 model (float64 stays float64 for the reference tests)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _shift(x: torch.Tensor, fill) -> torch.Tensor:
    """DMS's one-token shift: the decision made at position i+1 marks key i; the newest key has none yet."""
    return torch.cat([x[..., 1:], torch.full_like(x[..., :1], fill)], dim=-1)


def _visible_to_bias(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill(~visible, masks.masked_value(dtype))


GATE_CLASSES = {"dms": DMSGate, "trimkv": TrimKVGate}


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


def attach_gates(model: nn.Module, kind: str = "dms", **settings: Any) -> nn.Module:
    """Add eviction gates to every attention layer of `model`, in place, and route attention through them.

    The model stays a `PreTrainedModel`; gates start in `GateMode.OFF`, where it computes exactly what it
    did before. Settings are the fields of `DMSSettings` or `TrimKVSettings`.
    """
    from models.attention import register_attention

    config = model.config
    check_architecture(config)
    if model_gates(model):
        raise GateError("the model already has gates; load a fresh backbone to attach another kind")
    parsed = make_settings(kind, **settings)
    layers = decoder_layers(model)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    parsed.validate(head_dim)
    state = GateState()
    ref = next(model.parameters())
    for idx, layer in enumerate(layers):
        # gates train in float32 whatever the backbone's dtype: they are tiny and AdamW needs the precision
        gate = GATE_CLASSES[kind](config, idx, state, parsed).to(device=ref.device, dtype=torch.float32)
        layer.self_attn.kv_gate = gate
        gate.install_hooks(layer)
    model.retrokv_state = state
    config.retrokv = {"kind": kind, **dataclasses.asdict(parsed)}
    register_attention()
    model.set_attn_implementation(ATTENTION_NAME)
    return model


def gate_state(model: nn.Module) -> GateState:
    found = model_gates(model)
    if not found:
        raise GateError("the model has no gates; call models.attach_gates first")
    return found[0].state


def set_gate_mode(model: nn.Module, mode: GateMode | str) -> None:
    try:
        mode = GateMode(mode)
    except ValueError:
        raise GateError(f"unknown gate mode {mode!r}; valid: {[m.value for m in GateMode]}") from None
    state = gate_state(model)
    state.mode = mode
    for gate in model_gates(model):
        gate._history = None
        gate.outputs = {}


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
    """Per layer and KV head: DMS eviction fraction, or TRIM-KV mean retention and mean occupancy.

    `attention_mask` ([B, T], 1 = real token) keeps padding out of the averages.
    """
    stats: dict[str, list[torch.Tensor]] = {}
    for out in gate_outputs(model):
        if not out:
            continue
        for name, value in _statistics_of(out).items():
            if attention_mask is not None:
                mask = attention_mask[:, -value.shape[-1]:].to(value.dtype)[:, None, :]
                stats.setdefault(name, []).append((value.detach() * mask).sum((0, 2)) / mask.sum((0, 2)).clamp(min=1))
            else:
                stats.setdefault(name, []).append(value.detach().mean((0, 2)))
    return {name: torch.stack(rows) for name, rows in stats.items()}


def uncertain_decision_share(model: nn.Module, attention_mask: torch.Tensor, margin: float = 3.0) -> torch.Tensor:
    """Share of the last forward's DMS decisions with |logit| < margin, where logistic noise can still flip them.

    A saturated gate (|logit| far above the noise) gets no gradient from either loss; this is the early
    warning. Counts real keys that have a decision (the next token is real) and are not sinks.
    """
    near, total = 0.0, 0.0
    decided = masks.decided_keys(attention_mask)
    for out in gate_outputs(model):
        if "logit" not in out:
            continue
        keys = decided[:, None, -out["logit"].shape[-1]:] & ~out["sink"]
        near = near + ((out["logit"].detach().abs() < margin) & keys).sum()
        total = total + keys.expand_as(out["logit"]).sum()
    return torch.as_tensor(near / max(total, 1), dtype=torch.float32)


def _statistics_of(out: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if "evict_hard" in out:
        return {"evict_fraction": out["evict_hard"].float()}
    return {"retention": out["log_beta"].exp(), "occupancy": out["occupancy"]}
