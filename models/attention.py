"""Gated attention behind transformers' AttentionInterface: one code path for every supported family.

The attention function receives the layer's RoPE'd queries/keys and asks the layer's gate for an additive
bias, one per KV head, which is broadcast over the G query heads of that group (the bias is never built
for all query heads). On CPU this runs on SDPA with a float mask (FlexAttention has no CPU backward); on
CUDA the same bias is applied through FlexAttention's score_mod, chosen automatically. With gates off the
call goes straight to transformers' SDPA attention, so the teacher is the original model.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

ATTENTION_NAME = "retrokv"
GATE_ATTRIBUTE = "kv_gate"  # the attention submodule that holds a layer's gate (models.gating attaches it)
_BACKEND_ENV = "RETROKV_ATTENTION"  # "sdpa" or "flex"; default: flex on CUDA, sdpa elsewhere


def boolean_causal_mask(*args, **kwargs):
    """transformers' causal+padding mask as an explicit boolean tensor (never skipped for is_causal)."""
    kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(*args, **kwargs)


def register_attention() -> None:
    AttentionInterface.register(ATTENTION_NAME, gated_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, boolean_causal_mask)


def _valid_pattern(attention_mask, batch: int, q_len: int, k_len: int, device) -> torch.Tensor:
    """[B, 1, Tq, Tk] bool, True where the key may be attended."""
    if attention_mask is None:
        distance = torch.arange(k_len - q_len, k_len, device=device)[:, None] - torch.arange(k_len, device=device)
        return (distance >= 0).expand(batch, 1, q_len, k_len)
    if attention_mask.dtype != torch.bool:
        attention_mask = attention_mask == 0
    return attention_mask[..., -k_len:]


def attention_backend(device: torch.device) -> str:
    choice = os.environ.get(_BACKEND_ENV)
    if choice not in (None, "sdpa", "flex"):
        raise ValueError(f"{_BACKEND_ENV}={choice!r} is invalid; valid: 'sdpa', 'flex'")
    return choice or ("flex" if device.type == "cuda" else "sdpa")


def gated_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    gate = getattr(module, GATE_ATTRIBUTE, None)
    if gate is None or not gate.active:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    batch, _, q_len, head_dim = query.shape
    k_len = key.shape[2]
    valid = _valid_pattern(attention_mask, batch, q_len, k_len, query.device)
    query = gate.mask_query(query)
    scaling = head_dim**-0.5 if scaling is None else scaling
    if attention_backend(query.device) == "flex" and not gate.multiplicative:
        score_mod = gate.attention_score_mod(valid, q_len, k_len, dtype=query.dtype)
        out = _flex(query, key, value, score_mod, scaling, visible_blocks(attention_mask, valid))
    else:
        bias = gate.attention_bias(valid, q_len, k_len, dtype=query.dtype)  # [B, n, Tq, Tk], n = Hkv or 1
        if gate.multiplicative:
            out = _grouped_eager_multiplicative(query, key, value, bias, gate.decay_factor(q_len, k_len), scaling)
        else:
            out = _grouped_sdpa(query, key, value, bias, scaling, dropout if module.training else 0.0)
    return out.transpose(1, 2).contiguous(), None


def _group(query, key, value, bias):
    """Views [B, Hkv, G, T, D] so a per-KV-head bias broadcasts over its query group without copies."""
    batch, heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    group = heads // kv_heads
    q = query.view(batch, kv_heads, group, q_len, dim)
    k = key[:, :, None].expand(-1, -1, group, -1, -1)
    v = value[:, :, None].expand(-1, -1, group, -1, -1)
    return q, k, v, bias[:, :, None]


def _grouped_sdpa(query, key, value, bias, scaling, dropout):
    q, k, v, b = _group(query, key, value, bias)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=b, dropout_p=dropout, scale=scaling)
    return out.reshape(query.shape)


def _grouped_eager_multiplicative(query, key, value, bias, decay, scaling):
    """TRIM-KV's original form: attention logits multiplied by beta ** (t - i); `bias` is the causal/padding mask."""
    q, k, v, b = _group(query, key, value, bias)
    scores = (q @ k.transpose(-1, -2)) * scaling * decay[:, :, None].to(q.dtype) + b
    return (scores.softmax(-1) @ v).reshape(query.shape)


@functools.cache
def _flex_kernel(compiled: bool):
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=True) if compiled else flex_attention


_BLOCK_MASK_CACHE: list = []  # [(the forward's mask tensor, q_len, k_len), BlockMask]: one entry


def visible_blocks(attention_mask, valid: torch.Tensor):
    """FlexAttention's BlockMask of the causal and padding structure, so blocks with no visible key (above the
    diagonal, all padding) are skipped instead of computed and masked.

    Every layer of a forward receives the same mask tensor from transformers, so the BlockMask is built once
    per forward and reused: the cache holds that tensor itself (not its id), which cannot be reused for another
    mask while it is held. The gates' decisions are not part of it: they change per layer and, in training,
    only bias scores (nothing is removed), so there is nothing more to skip by structure."""
    from torch.nn.attention.flex_attention import create_block_mask

    batch, _, q_len, k_len = valid.shape
    if attention_mask is not None and _BLOCK_MASK_CACHE:
        (cached_mask, *cached_lengths), cached_block_mask = _BLOCK_MASK_CACHE
        if cached_mask is attention_mask and cached_lengths == [q_len, k_len]:
            return cached_block_mask
    visible = valid.contiguous()
    block_mask = create_block_mask(lambda b, h, q, kv: visible[b, 0, q, kv], batch, None, q_len, k_len,
                                   device=valid.device)
    _BLOCK_MASK_CACHE[:] = [(attention_mask, q_len, k_len), block_mask]
    return block_mask


def _flex(query, key, value, score_mod, scaling, block_mask=None):
    """FlexAttention with the gate's bias computed per score from per-key vectors (no [B, H, T, T] tensor),
    skipping the blocks `block_mask` marks empty.

    Compiled into a fused kernel on CUDA; elsewhere (tests) the unfused reference implementation runs.
    """
    group = query.shape[1] // key.shape[1]
    kernel = _flex_kernel(query.is_cuda)
    return kernel(query, key, value, score_mod=score_mod, block_mask=block_mask, scale=scaling, enable_gqa=group > 1)
