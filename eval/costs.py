"""What a cell cost, added up over the documents or batches it ran: KV reads, mean and peak KV tokens.

The DMS paper's cost axes: KV reads (keys attended, summed over queries, layers and KV heads), peak KV tokens
held in memory, and here also the realised mean KV tokens (memory over time), the axis baselines are
matched on. Everything is per (layer, KV head) of one sequence unless a name says otherwise.
"""

from __future__ import annotations

import torch


class CostMeter:
    def __init__(self):
        self.query_reads = 0
        self.query_full_reads = 0
        self.tokens = 0  # real tokens attended, over all sequences
        self.held = None  # [layers, KV heads] tokens held, integrated over real tokens
        self.peak = None  # [layers, KV heads]
        self.capacity_evictions = 0
        self.bytes_allocated = 0
        self.lengths: list[int] = []  # real tokens per sequence (for matching a budget to a mean)

    def add(self, stats, lengths: list[int]) -> None:
        self.query_reads += stats.query_reads
        self.query_full_reads += stats.query_full_reads
        self.tokens += stats.tokens_seen
        held = stats.mean_tokens.double() * stats.tokens_seen
        self.held = held if self.held is None else self.held + held
        self.peak = stats.peak_tokens if self.peak is None else torch.maximum(self.peak, stats.peak_tokens)
        self.capacity_evictions += stats.capacity_evictions
        self.bytes_allocated = max(self.bytes_allocated, stats.bytes_allocated)
        self.lengths += lengths

    def summary(self) -> dict:
        heads = self.peak.numel()
        mean = self.held / max(self.tokens, 1)
        return {
            "kv_reads": self.query_reads,
            "kv_reads_full": self.query_full_reads,
            "read_reduction": self.query_full_reads / max(self.query_reads, 1),
            "reads_per_query": self.query_reads / max(heads * self.tokens, 1),
            "mean_kv_tokens": float(mean.mean()),
            "peak_kv_tokens": int(self.peak.max()),
            "mean_kv_tokens_per_head": [[round(float(x), 2) for x in row] for row in mean],
            "capacity_evictions": self.capacity_evictions,
            "kv_bytes_allocated": self.bytes_allocated,
            "sequence_lengths": self.lengths,
        }


def realised_mean(budget: int, lengths: list[int]) -> float:
    """Mean tokens held by a cache that fills up to `budget` and then stays there, over sequences of `lengths`
    (tokens held after each token: min(t, budget), averaged over every token of every sequence)."""
    total = sum(lengths)
    held = 0
    for n in lengths:
        b = min(budget, n)
        held += b * (b + 1) // 2 + (n - b) * budget
    return held / total


def matched_budget(target_mean: float, lengths: list[int]) -> int:
    """The smallest budget whose realised mean KV tokens over `lengths` reaches `target_mean` (at least 1)."""
    if not lengths or max(lengths) < 1:
        raise ValueError("matched_budget needs at least one sequence of one token or more")
    low, high = 1, max(lengths)
    while low < high:
        mid = (low + high) // 2
        low, high = (low, mid) if realised_mean(mid, lengths) >= target_mean else (mid + 1, high)
    return low
