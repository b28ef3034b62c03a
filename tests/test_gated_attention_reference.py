"""The gated attention function against plain float64 references on random shapes.

The references below are written loop-by-loop from the method notes (docs/methods.md), independently of the
rules in models/gates/.
Gate values are injected into real gate objects, then the registered attention function is called.
"""

import math
import types

import pytest
import torch

from models.attention import gated_attention
from models.gates import (
    DMSGate,
    DMSSettings,
    GateMode,
    GateState,
    TrimKVGate,
    TrimKVSettings,
)

F64 = torch.float64  # references and inputs in float64, set per tensor (no global default)
NEG = float("-inf")


def random_case(seed):
    g = torch.Generator().manual_seed(seed)
    r = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=g))  # noqa: E731
    batch, kv_heads, group, length, window = r(1, 3), r(1, 4), r(1, 3), r(1, 300), r(0, 64)
    dim = 8
    heads = kv_heads * group
    q = torch.randn(batch, heads, length, dim, generator=g, dtype=F64)
    k = torch.randn(batch, kv_heads, length, dim, generator=g, dtype=F64)
    v = torch.randn(batch, kv_heads, length, dim, generator=g, dtype=F64)
    pads = [r(0, length - 1) for _ in range(batch)]  # left padding per row
    real = torch.ones(batch, length, dtype=torch.bool)
    for b, p in enumerate(pads):
        real[b, :p] = False
    config = types.SimpleNamespace(num_key_value_heads=kv_heads, num_attention_heads=heads, head_dim=dim,
                                   hidden_size=heads * dim, rms_norm_eps=1e-6)
    return q, k, v, real, window, config, g


def sink_of(real, sinks):
    """is_sink(b, i): key i is among row b's first `sinks` real tokens (counted in a loop, not with cumsum)."""
    pinned = set()
    for b in range(real.shape[0]):
        count = 0
        for i in range(real.shape[1]):
            count += bool(real[b, i])
            if real[b, i] and count <= sinks:
                pinned.add((b, i))
    return lambda b, i: (b, i) in pinned


def causal_padding_mask(real):
    length = real.shape[1]
    causal = torch.tril(torch.ones(length, length, dtype=torch.bool))
    return (causal[None] & real[:, None, :])[:, None]  # [B, 1, T, T]


def reference_attention(q, k, v, real, bias_of, scores_of=None):
    """softmax(q.k * scale + bias) v, one (batch, head, query) at a time; rows of padding queries are skipped."""
    batch, heads, length, dim = q.shape
    group = heads // k.shape[1]
    out = torch.zeros(batch, length, heads, dim, dtype=F64)
    for b in range(batch):
        for h in range(heads):
            hk = h // group
            for t in range(length):
                if not real[b, t]:
                    continue
                scores = []
                for i in range(t + 1):
                    s = float(q[b, h, t] @ k[b, hk, i]) / math.sqrt(dim)
                    if scores_of is not None:
                        s = scores_of(b, hk, t, i, s)
                    scores.append(s + bias_of(b, hk, t, i) if real[b, i] else NEG)
                w = torch.softmax(torch.tensor(scores, dtype=F64), 0)
                out[b, t, h] = w @ v[b, hk, : t + 1]
    return out


def run_gate(gate, q, k, v, real):
    module = types.SimpleNamespace(kv_gate=gate, training=False)
    out, _ = gated_attention(module, q, k, v, causal_padding_mask(real), scaling=q.shape[-1] ** -0.5)
    return out


def assert_close_on_real_queries(out, ref, real):
    rows = real[:, :, None, None].expand_as(out)
    torch.testing.assert_close(out[rows], ref[rows], atol=1e-6, rtol=0)


SEEDS = range(6)


@pytest.mark.parametrize("seed", SEEDS)
def test_dms_soft_mask_matches_reference(seed):
    q, k, v, real, window, config, g = random_case(seed)
    state = GateState(mode=GateMode.TRAIN, noise_seed=seed)
    sinks = seed % 4
    gate = DMSGate(config, 0, state, DMSSettings(window=window, source="adapter", tau=1.0, sinks=sinks))
    gate._current = torch.randn(q.shape[0], config.num_key_value_heads, q.shape[2], generator=g, dtype=F64) * 2
    out = run_gate(gate, q, k, v, real)
    prob = gate.outputs["evict_prob"]  # the noisy eviction probability, already shifted onto keys
    length = q.shape[2]
    is_sink = sink_of(real, sinks)

    def bias(b, hk, t, i):
        if is_sink(b, i):
            return 0.0
        return math.log1p(-float(prob[b, hk, i])) if t - i > window and i + 1 < length else 0.0

    assert_close_on_real_queries(out, reference_attention(q, k, v, real, bias), real)
    # the shift: key i carries the probability computed at position i + 1; the newest key carries none
    assert torch.all(prob[..., -1] == 0)


@pytest.mark.parametrize("seed", SEEDS)
def test_dms_hard_mask_matches_reference(seed):
    q, k, v, real, window, config, g = random_case(seed)
    sinks = seed % 4
    gate = DMSGate(config, 0, GateState(mode=GateMode.INFER), DMSSettings(window=window, source="adapter", sinks=sinks))
    logits = torch.randn(q.shape[0], config.num_key_value_heads, q.shape[2], generator=g, dtype=F64)
    gate._current = logits
    out = run_gate(gate, q, k, v, real)
    length = q.shape[2]
    is_sink = sink_of(real, sinks)

    def bias(b, hk, t, i):
        evicted = i + 1 < length and float(logits[b, hk, i + 1]) > 0 and not is_sink(b, i)
        return NEG if evicted and t - i > window else 0.0

    assert_close_on_real_queries(out, reference_attention(q, k, v, real, bias), real)


@pytest.mark.parametrize("seed", SEEDS)
def test_trimkv_additive_decay_and_occupancy_match_reference(seed):
    q, k, v, real, _, config, g = random_case(seed)
    sinks = seed % 4
    gate = TrimKVGate(config, 0, GateState(mode=GateMode.TRAIN), TrimKVSettings(hidden=4, sinks=sinks))
    raw = torch.nn.functional.logsigmoid(torch.randn(q.shape[0], config.num_key_value_heads, q.shape[2], generator=g, dtype=F64) + 2)
    gate._current = raw
    out = run_gate(gate, q, k, v, real)
    is_sink = sink_of(real, sinks)
    log_beta = raw.clone()
    for b in range(q.shape[0]):
        for i in range(q.shape[2]):
            if is_sink(b, i):
                log_beta[b, :, i] = 0.0  # a sink never decays
    assert_close_on_real_queries(out, reference_attention(q, k, v, real, lambda b, hk, t, i: (t - i) * float(log_beta[b, hk, i])), real)
    occupancy = gate.outputs["occupancy"]
    for b in range(q.shape[0]):
        for hk in range(config.num_key_value_heads):
            for t in range(q.shape[2]):
                if real[b, t]:
                    expected = sum(math.exp(float(log_beta[b, hk, i]) * (t - i)) for i in range(t + 1) if real[b, i])
                    assert abs(float(occupancy[b, hk, t]) - expected) < 1e-6 * max(1.0, expected)


@pytest.mark.parametrize("seed", SEEDS[:3])
def test_trimkv_multiplicative_decay_matches_reference(seed):
    q, k, v, real, _, config, g = random_case(seed)
    sinks = seed % 4
    gate = TrimKVGate(config, 0, GateState(mode=GateMode.TRAIN), TrimKVSettings(hidden=4, decay="multiplicative", sinks=sinks))
    raw = torch.nn.functional.logsigmoid(torch.randn(q.shape[0], config.num_key_value_heads, q.shape[2], generator=g, dtype=F64) + 2)
    gate._current = raw
    out = run_gate(gate, q, k, v, real)
    is_sink = sink_of(real, sinks)
    log_beta = torch.stack([torch.stack([raw[b, :, i] * (not is_sink(b, i)) for i in range(q.shape[2])], -1)
                            for b in range(q.shape[0])])
    ref = reference_attention(q, k, v, real, lambda b, hk, t, i: 0.0,
                              scores_of=lambda b, hk, t, i, s: s * math.exp(float(log_beta[b, hk, i]) * (t - i)))
    assert_close_on_real_queries(out, ref, real)


@pytest.mark.parametrize("seed", SEEDS[:4])
def test_trimkv_hard_topk_matches_reference(seed):
    q, k, v, real, _, config, g = random_case(seed)
    budget = max(1, q.shape[2] // 3)
    sinks = min(seed % 4, budget - 1)
    gate = TrimKVGate(config, 0, GateState(mode=GateMode.INFER), TrimKVSettings(hidden=4, budget=budget, sinks=sinks))
    log_beta = torch.nn.functional.logsigmoid(torch.randn(q.shape[0], config.num_key_value_heads, q.shape[2], generator=g, dtype=F64))
    gate._current = log_beta
    out = run_gate(gate, q, k, v, real)
    is_sink = sink_of(real, sinks)
    kept = {}
    for b in range(q.shape[0]):
        for hk in range(config.num_key_value_heads):
            for t in range(q.shape[2]):
                candidates = [i for i in range(t + 1) if real[b, i]]
                pinned = [i for i in candidates if is_sink(b, i)]
                ranked = sorted((i for i in candidates if i not in pinned), key=lambda i: -(t - i) * float(log_beta[b, hk, i]))
                kept[b, hk, t] = set(pinned + ranked[:budget - len(pinned)])
    ref = reference_attention(q, k, v, real, lambda b, hk, t, i: 0.0 if i in kept[b, hk, t] else NEG)
    assert_close_on_real_queries(out, ref, real)


def test_flex_score_mod_path_matches_sdpa_path(monkeypatch):
    """The CUDA path (FlexAttention score_mod) computes the same attention as the CPU SDPA path."""
    q, k, v, real, window, config, g = random_case(3)
    logits = torch.randn(q.shape[0], config.num_key_value_heads, q.shape[2], generator=g, dtype=F64)
    outs = {}
    for backend in ("sdpa", "flex"):
        monkeypatch.setenv("RETROKV_ATTENTION", backend)
        for mode in (GateMode.TRAIN, GateMode.INFER):
            gate = DMSGate(config, 0, GateState(mode=mode, noise_seed=1), DMSSettings(window=window, source="adapter"))
            gate._current = logits
            outs[backend, mode, "dms"] = run_gate(gate, q.float(), k.float(), v.float(), real)
            tgate = TrimKVGate(config, 0, GateState(mode=mode), TrimKVSettings(hidden=4, budget=7))
            tgate._current = torch.nn.functional.logsigmoid(logits)
            outs[backend, mode, "trimkv"] = run_gate(tgate, q.float(), k.float(), v.float(), real)
    rows = real[:, :, None, None]
    for mode in (GateMode.TRAIN, GateMode.INFER):
        for kind in ("dms", "trimkv"):
            a, b = outs["sdpa", mode, kind], outs["flex", mode, kind]
            torch.testing.assert_close(a[rows.expand_as(a)], b[rows.expand_as(b)], atol=2e-5, rtol=0)


def test_flex_block_mask_skips_exactly_the_blocks_without_visible_keys():
    """The BlockMask FlexAttention gets marks a (query block, key block) pair computed iff some query there may
    see some key (causal and padding); it is built once per forward and shared by every layer."""
    from models.attention import visible_blocks

    real = torch.ones(2, 300, dtype=torch.bool)
    real[1, :170] = False  # left padding: the second row's first key block is all padding
    mask = causal_padding_mask(real)
    valid = mask if mask.dtype == torch.bool else mask == 0
    block_mask = visible_blocks(mask, valid)
    dense = block_mask.to_dense()[:, 0].bool()  # [B, query blocks, key blocks]
    blocks = -(-300 // 128)
    padded = torch.zeros(2, blocks * 128, blocks * 128, dtype=torch.bool)
    padded[:, :300, :300] = valid[:, 0]
    expected = padded.view(2, blocks, 128, blocks, 128).any(4).any(2)
    assert torch.equal(dense, expected)
    assert not dense[0, 0, 1] and not dense[1, 2, 0] and dense[1, 2, 1]  # above the diagonal; all-padding keys
    assert visible_blocks(mask, valid) is block_mask  # the next layer of the same forward reuses it
