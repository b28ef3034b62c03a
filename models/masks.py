"""The per-key attention biases of DMS and TRIM-KV, written once and shared by training and inference.

Every function returns a bias of shape [B, Hkv, Tq, Tk]: one mask per KV head, broadcast over the G query
heads of its group. `valid` is the causal + padding pattern ([B, 1 or Hkv, Tq, Tk], True = may attend) and
`distance` is t - i for query t and key i.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def masked_value(dtype: torch.dtype) -> float:
    """The finite 'minus infinity' transformers uses: a fully masked padding row stays finite."""
    return torch.finfo(dtype).min


def query_key_distance(q_len: int, k_len: int, device: torch.device) -> torch.Tensor:
    """t - i for the last q_len of k_len positions (queries are the newest tokens)."""
    t = torch.arange(k_len - q_len, k_len, device=device)
    i = torch.arange(k_len, device=device)
    return t[:, None] - i[None, :]


def decided_keys(attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, T] keys that carry a real DMS decision: the key and the next token (which decides for it) are real."""
    decided = torch.zeros_like(attention_mask, dtype=torch.bool)
    decided[:, :-1] = attention_mask[:, :-1].bool() & attention_mask[:, 1:].bool()
    return decided


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


def dms_soft_bias(key_log_keep: torch.Tensor, distance: torch.Tensor, window: int) -> torch.Tensor:
    """Training mask: 0 inside the window, log(1 - alpha_i) outside it (alpha_i = eviction probability of key i).

    key_log_keep: [B, Hkv, Tk], already aligned to keys (the decision made at i+1 marks key i).
    """
    outside = (distance > window).to(key_log_keep.dtype)
    return key_log_keep[:, :, None, :] * outside


def dms_hard_visible(key_evicted: torch.Tensor, distance: torch.Tensor, window: int) -> torch.Tensor:
    """Inference mask: an evicted key stays visible while t - i <= window and disappears after."""
    return ~(key_evicted[:, :, None, :] & (distance > window))


def trimkv_bias(log_beta: torch.Tensor, distance: torch.Tensor) -> torch.Tensor:
    """Additive retention decay (t - i) * log beta_i, the TRIM-KV eviction score itself."""
    return distance.clamp(min=0).to(log_beta.dtype) * log_beta[:, :, None, :]


def occupancy_from_decay(decay: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Expected kept tokens at each query: sum over visible keys of beta_i ** (t - i) = exp(decay). [B, Hkv, Tq]."""
    return torch.exp(decay.masked_fill(~valid, float("-inf"))).sum(-1)


def trimkv_topk_visible(log_beta: torch.Tensor, valid: torch.Tensor, distance: torch.Tensor, budget: int,
                        pinned: torch.Tensor | None = None) -> torch.Tensor:
    """Hard inference mask: at each query, only the `budget` visible keys with the highest retention score.
    `pinned` ([B, 1 or Hkv, Tk]) keys (sinks) always stay and count inside the budget."""
    score = trimkv_bias(log_beta, distance)
    if pinned is not None:
        score = score.masked_fill(pinned[:, :, None, :], float("inf"))
    score = score.masked_fill(~valid, float("-inf"))
    k = min(budget, score.shape[-1])
    top = score.topk(k, dim=-1).indices
    keep = torch.zeros_like(score, dtype=torch.bool).scatter_(-1, top, True)
    return keep & valid


def dms_logistic_noise(shape, generator: torch.Generator | None, device, dtype=torch.float32) -> torch.Tensor:
    """Difference of two Gumbel(0, 1) samples, i.e. standard logistic noise."""
    u = torch.rand(shape, generator=generator, device=device, dtype=dtype).clamp_(1e-6, 1 - 1e-6)
    return torch.log(u) - torch.log1p(-u)


def log_keep_from_logit(noisy_logit: torch.Tensor) -> torch.Tensor:
    """log(1 - sigmoid(x)) computed stably."""
    return F.logsigmoid(-noisy_logit)
