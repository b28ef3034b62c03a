"""Mask pieces every gate kind shares: the masked value, query-key distances, attention sinks.

Each kind's own rules (DMS's shift and delayed eviction, TRIM-KV's retention score) live in its module
under models/gates/. `valid` is the causal + padding pattern ([B, 1 or Hkv, Tq, Tk], True = may attend)
and `distance` is t - i for query t and key i.
"""

from __future__ import annotations

import torch


def masked_value(dtype: torch.dtype) -> float:
    """The finite 'minus infinity' transformers uses: a fully masked padding row stays finite."""
    return torch.finfo(dtype).min


def query_key_distance(q_len: int, k_len: int, device: torch.device) -> torch.Tensor:
    """t - i for the last q_len of k_len positions (queries are the newest tokens)."""
    t = torch.arange(k_len - q_len, k_len, device=device)
    i = torch.arange(k_len, device=device)
    return t[:, None] - i[None, :]


def sink_keys(valid: torch.Tensor, sinks: int) -> torch.Tensor:
    """[B, Tk] True for the first `sinks` real keys of each sequence (padding skipped).

    A key is real when some query of this forward may read it. When the forward covers every key (no
    cache), a key's rank is the number of keys its own query reads, so documents packed with restarted
    positions (a block-diagonal mask) each get their own sinks; with a cache, the newest query reads every
    earlier real key of the one sequence.
    """
    pattern = valid[:, 0]
    real = pattern.any(-2)
    if pattern.shape[-2] == pattern.shape[-1]:
        count = pattern.sum(-1)  # query i reads its real keys up to i: rank of key i + 1
    else:
        count = real.cumsum(-1)
    return real & (count <= sinks)


def mean_over_real(value: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """[n] mean of per-position values [B, n, T] over real tokens (padding excluded), per head."""
    mask = attention_mask[:, -value.shape[-1]:].to(value.dtype)[:, None, :]
    return (value * mask).sum((0, 2)) / mask.sum((0, 2)).clamp(min=1)
