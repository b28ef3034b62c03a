"""What every gate kind shares: the run-time switches, the gate module's plumbing, and the `GateKind`
interface through which the trainer, the quick evaluation and the engine use a kind without naming it.

A gate maps a layer's inputs to one value per (token, KV head) (a DMS eviction logit, a TRIM-KV
log-retention). It listens to the layer through forward hooks and hands the attention function
(models.attention) an additive per-KV-head bias. All gates of a model share one `GateState`, so switching
between the teacher (gates off), training (noisy, soft) and inference (hard) modes copies nothing.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Callable, ClassVar

import torch
from torch import nn

from models.masks import masked_value
from models.masks import sink_keys as first_real_keys


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


ScoreMod = Callable[..., torch.Tensor]  # FlexAttention score_mod(score, batch, head, q_idx, kv_idx)


class KVGate(nn.Module):
    """Common plumbing: hooks, the per-position values of the current forward, and a decode history."""

    def __init__(self, config, layer_idx: int, state: GateState, settings: Any):
        super().__init__()
        self.settings = settings
        self.layer_idx = layer_idx
        self.num_kv_heads = config.num_key_value_heads
        self.group = config.num_attention_heads // config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.state = state  # plain attribute: shared, not a submodule
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        self._current: torch.Tensor | None = None  # [B, n, Tq] per-position gate values of this forward
        self._history: torch.Tensor | None = None  # [B, n, past] values of earlier decode steps
        self.outputs: dict[str, torch.Tensor] = {}

    def reset_parameters(self) -> None:
        """The gate's initial values, set at the end of __init__; attach_gates runs it again on the gathered
        parameters when DeepSpeed ZeRO-3 partitioned them during construction (which drops later writes)."""

    @property
    def active(self) -> bool:
        return self.state.mode is not GateMode.OFF

    @property
    def current_values(self) -> torch.Tensor | None:
        """[B, n, Tq] the gate values the layer's input produced in this forward (n = KV heads, or 1)."""
        return self._current

    @property
    def neuron_indices(self) -> list[int]:
        """Output rows of q_proj that carry the gate's decisions (a repurposed query neuron); none by default."""
        return []

    @property
    def multiplicative(self) -> bool:
        """True when the gate scales attention logits instead of adding a bias (then `decay_factor` applies)."""
        return False

    def install_hooks(self, layer: nn.Module) -> None:
        """(Re)attach to the layer's current submodules; call again after peft wraps them."""
        self.remove_hooks()
        self._hooks = [layer.input_layernorm.register_forward_hook(self._on_layer_input)]

    def remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def reset(self) -> None:
        """Forget the decode history and the last forward's outputs (on every mode switch)."""
        self._history = None
        self.outputs = {}

    def _on_layer_input(self, norm, args, normed):
        if self.active:
            self._current = self.compute(residual=args[0], normed=normed, layer_norm=norm)

    def compute(self, residual: torch.Tensor, normed: torch.Tensor, layer_norm: nn.Module | None = None
                ) -> torch.Tensor | None:
        """Per-position gate values [B, n, T] from the layer input (the residual stream and the layer's
        input_layernorm output, `layer_norm`'s); None when they come from elsewhere."""
        raise NotImplementedError

    def mask_query(self, query: torch.Tensor) -> torch.Tensor:
        return query

    def query_group(self) -> int:
        """Query heads per gate output: G for per-KV-head gates, all heads for one decision per layer."""
        return self.group * self.num_kv_heads // self.num_outputs

    @property
    def num_outputs(self) -> int:
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
        return first_real_keys(valid, self.settings.sinks)[:, None]

    def attention_bias(self, valid: torch.Tensor, q_len: int, k_len: int, dtype: torch.dtype) -> torch.Tensor:
        """Additive float bias [B, n, Tq, Tk] with the causal/padding pattern `valid` ([B, 1, Tq, Tk]) folded in."""
        raise NotImplementedError

    def attention_score_mod(self, valid: torch.Tensor, q_len: int, k_len: int, dtype: torch.dtype) -> ScoreMod:
        """The same bias as a FlexAttention score_mod, computed per score from per-key vectors."""
        raise NotImplementedError


class GateKind:
    """One gate kind behind one interface: its settings, its module, its capacity loss, its statistics and
    its read counting. The trainer, the quick evaluation and the engine look a kind up by name
    (models.gates.GATE_KINDS) and call these; none of them branches on the kind."""

    name: ClassVar[str]
    settings_type: ClassVar[type]
    gate_type: ClassVar[type[KVGate]]
    anneals_cr: ClassVar[bool]  # trained along a rising compression-ratio schedule (a CR family of snapshots)

    def capacity_terms(self, outputs: list[dict[str, torch.Tensor]], attention_mask: torch.Tensor, settings: Any,
                       eviction_target: float, loss: Any) -> dict[str, torch.Tensor]:
        """The capacity loss ("capacity"), optional extra penalties named as in the loss config (weighted
        by `loss.<name>_weight`), and detached statistics for the training log."""
        raise NotImplementedError

    def statistics(self, out: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Per-position statistics [B, n, T] of one layer's outputs, averaged by models.gate_statistics."""
        raise NotImplementedError

    def table_statistics(self, table: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Health figures for the training log from models.gate_statistics' [layers, n] table; none by default."""
        return {}

    def kv_reads(self, outputs: list[dict[str, torch.Tensor]], attention_mask: torch.Tensor, settings: Any) -> int:
        """Keys read by the real queries of a teacher-forced batch under hard decisions, over layers and heads."""
        raise NotImplementedError


def at_least_float32(x: torch.Tensor) -> torch.Tensor:
    """Gate values in float32 even for a bf16 model (float64 stays float64 for the reference tests)."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def visible_to_bias(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill(~visible, masked_value(dtype))
