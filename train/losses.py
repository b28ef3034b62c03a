"""The distillation loss (each gate kind's capacity loss lives with the kind, in models/gates/).

The distillation loss never holds full-vocabulary float32 logits for the whole batch: it takes final
hidden states, and per chunk of tokens applies the LM head, computes the KL, and (for the student)
recomputes that chunk in backward instead of keeping its logits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from models.metrics import token_kl


def _chunk_terms(head, teacher_head, student_h, teacher_h, labels, direction, temperature):
    student = head(student_h)
    with torch.no_grad():
        teacher = teacher_head(teacher_h)
    kl = token_kl(student, teacher, direction, temperature).sum()
    valid = labels >= 0
    nll = F.cross_entropy(student.float()[valid], labels[valid], reduction="sum") if valid.any() else student.sum() * 0
    return torch.stack([kl, nll])


def chunked_distillation(head: torch.nn.Module, student_hidden: torch.Tensor, teacher_hidden: torch.Tensor,
                         loss_mask: torch.Tensor, input_ids: torch.Tensor, direction: str = "reverse",
                         temperature: float = 1.0, chunk_tokens: int = 1024,
                         teacher_head: torch.nn.Module | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean KL over masked tokens and mean next-token NLL, from hidden states [B, T, H].

    `teacher_head` is the teacher's own LM head when it is a separate model (a full fine-tune trains the
    student's head, which must not move the target); by default the teacher shares the student's.

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
            total = total + checkpoint(_chunk_terms, head, teacher_head or head, s[part], t[part], y[part], direction,
                                       temperature, use_reentrant=False)
        else:
            total = total + _chunk_terms(head, teacher_head or head, s[part], t[part], y[part], direction, temperature)
    return total[0] / n_kl, total[1] / n_nll
