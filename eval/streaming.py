"""Streaming perplexity and KL to the full cache, through the bounded-memory engine.

A document is fed through a `BoundedCache` `chunk_size` tokens per forward, so eviction happens as it would
in generation: with chunk size 1 every token is a decode step (each query reads exactly what the policy
kept); with a larger chunk the chunk's queries also read each other and eviction runs between chunks, so
a query may read up to `budget + chunk_size - 1` keys. The per-token NLL of the next token and the KL from
the full cache's distribution (the same model, plain forward) are kept for positions from `score_from` on.
"""

from __future__ import annotations

import dataclasses

import torch

from eval.engine import BoundedCache, Policy


class EvalError(ValueError):
    """A task, text, model or results folder the evaluation cannot use, with what would work."""


@torch.no_grad()
def reference_logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    """[T, V] float32 log-probabilities of the full cache (one plain forward, gates off)."""
    from models import gate_mode, model_gates

    if model_gates(model):
        with gate_mode(model, "off"):
            logits = model(input_ids=ids[None], use_cache=False).logits[0]
    else:
        logits = model(input_ids=ids[None], use_cache=False).logits[0]
    return torch.log_softmax(logits.float(), -1)


@dataclasses.dataclass
class StreamResult:
    nll: torch.Tensor  # [scored] next-token NLL at each scored position
    kl: torch.Tensor  # [scored] KL(full || engine) of the next-token distribution
    stats: object  # the cache's CacheStats


@torch.no_grad()
def stream_document(model, ids: torch.Tensor, policy: str | Policy, budget: int, chunk_size: int,
                    reference: torch.Tensor, score_from: int) -> StreamResult:
    """Feed `ids` [T] through a BoundedCache and score positions t >= score_from (predicting t + 1)."""
    length = ids.shape[0]
    if length < score_from + 2:
        raise EvalError(f"a text of {length} tokens is too short to score from position {score_from}; "
                        f"give texts of at least {score_from + 2} tokens or lower score_from")
    nll, kl = [], []
    with BoundedCache(model, policy=policy, budget=budget, chunk_size=chunk_size) as cache:
        for start in range(0, length - 1, chunk_size):
            end = min(start + chunk_size, length - 1)  # the last token predicts nothing
            logits = model(input_ids=ids[None, start:end], cache=cache, use_cache=True).logits[0]
            first = max(score_from, start)
            if first >= end:
                continue
            logp = torch.log_softmax(logits[first - start:].float(), -1)
            ref = reference[first:end].to(logp.device)
            nll.append(-logp.gather(-1, ids[first + 1:end + 1, None].to(logp.device))[:, 0])
            kl.append((ref.exp() * (ref - logp)).sum(-1).clamp(min=0))
    return StreamResult(nll=torch.cat(nll).cpu(), kl=torch.cat(kl).cpu(), stats=cache.stats())
