"""Distances between a gated model's next-token distributions and the original model's."""

from __future__ import annotations

import torch
import torch.nn.functional as F


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
