"""Distillation and capacity losses.

The distillation loss never holds full-vocabulary float32 logits for the whole batch: it takes final
hidden states, and per chunk of tokens applies the LM head, computes the KL, and (for the student)
recomputes that chunk in backward instead of keeping its logits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from models.masks import decided_keys


def token_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, direction: str, temperature: float) -> torch.Tensor:
    """Per-token KL between softened distributions, times temperature**2 (Hinton). [N, V] -> [N]."""
    log_s = F.log_softmax(student_logits.float() / temperature, dim=-1)
    log_t = F.log_softmax(teacher_logits.float() / temperature, dim=-1)
    if direction == "forward":  # KL(teacher || student)
        kl = (log_t.exp() * (log_t - log_s)).sum(-1)
    elif direction == "reverse":  # KL(student || teacher)
        kl = (log_s.exp() * (log_s - log_t)).sum(-1)
    else:
        raise ValueError(f"kl direction {direction!r} is invalid; valid: 'forward', 'reverse'")
    return kl * temperature**2


def _chunk_terms(head, student_h, teacher_h, labels, direction, temperature):
    student = head(student_h)
    with torch.no_grad():
        teacher = head(teacher_h)
    kl = token_kl(student, teacher, direction, temperature).sum()
    valid = labels >= 0
    nll = F.cross_entropy(student.float()[valid], labels[valid], reduction="sum") if valid.any() else student.sum() * 0
    return torch.stack([kl, nll])


def chunked_distillation(head: torch.nn.Module, student_hidden: torch.Tensor, teacher_hidden: torch.Tensor,
                         loss_mask: torch.Tensor, input_ids: torch.Tensor, direction: str = "reverse",
                         temperature: float = 1.0, chunk_tokens: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean KL over masked tokens and mean next-token NLL, from hidden states [B, T, H].

    loss_mask [B, T] marks positions whose next-token distribution is distilled (0 on padding). The NLL
    target of a marked position t is input_ids[t + 1] when that token is marked too (real, not padding).
    """
    labels = torch.full_like(input_ids, -100)
    labels[:, :-1] = input_ids[:, 1:].masked_fill(loss_mask[:, 1:] == 0, -100)
    keep = loss_mask.bool()
    s, t, y = student_hidden[keep], teacher_hidden[keep], labels[keep]
    n_kl, n_nll = keep.sum().clamp(min=1), (y >= 0).sum().clamp(min=1)
    total = student_hidden.new_zeros(2, dtype=torch.float32)
    for start in range(0, s.shape[0], chunk_tokens):
        part = slice(start, start + chunk_tokens)
        if torch.is_grad_enabled() and s.requires_grad:
            total = total + checkpoint(_chunk_terms, head, s[part], t[part], y[part], direction, temperature,
                                       use_reentrant=False)
        else:
            total = total + _chunk_terms(head, s[part], t[part], y[part], direction, temperature)
    return total[0] / n_kl, total[1] / n_nll


def dms_capacity_loss(evict_hard: list[torch.Tensor], attention_mask: torch.Tensor, target: float):
    """One-sided L1: relu(target - eviction fraction) per sequence, averaged; over-compression is free.

    evict_hard: per layer [B, n, T] (straight-through). Returns (loss, achieved fraction without gradient).
    """
    valid = decided_keys(attention_mask)[:, None, None, :]  # [B, 1, 1, T]
    decisions = torch.stack(evict_hard, dim=1)  # [B, L, n, T]
    count = (valid.sum((-1,)) * decisions.shape[1] * decisions.shape[2]).squeeze(-1).squeeze(-1).clamp(min=1)
    per_sequence = (decisions * valid).sum((1, 2, 3)) / count
    return torch.relu(target - per_sequence).mean(), per_sequence.detach().mean()


def dms_head_cap_loss(evict_hard: list[torch.Tensor], attention_mask: torch.Tensor, cap: float) -> torch.Tensor:
    """Per-(layer, KV head) guard: mean over gates of relu(eviction fraction - cap).

    The capacity loss constrains only the average, so single heads may drift to evicting everything (a
    bare window), where their decisions saturate and no loss pulls them back; this term does.
    """
    valid = decided_keys(attention_mask)[:, None, :].to(evict_hard[0].dtype)  # [B, 1, T]
    per_head = torch.stack([(e * valid).sum((0, 2)) / valid.sum((0, 2)).clamp(min=1) for e in evict_hard])
    return torch.relu(per_head - cap).mean()


def trimkv_capacity_loss(occupancy: list[torch.Tensor], attention_mask: torch.Tensor, budget: float) -> torch.Tensor:
    """mean_t relu(occupancy_t - M) / (t + 1), per layer and head, over real query positions."""
    occ = torch.stack(occupancy, dim=1)  # [B, L, Hkv, T]
    real = attention_mask.bool()
    t = (attention_mask.cumsum(-1) - 1).clamp(min=0).to(occ.dtype)  # position among real tokens
    per_token = torch.relu(occ - budget) / (t + 1)[:, None, None, :]
    mask = real[:, None, None, :].to(occ.dtype)
    return (per_token * mask).sum() / (mask.sum() * occ.shape[1] * occ.shape[2]).clamp(min=1)
