"""The bounded-memory engine against full caches, plain float64 references, and its invariants."""

import pytest
import torch
from conftest import tiny_model
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AttentionInterface, DynamicCache

import models
from eval.engine import POLICIES, TOVA, BoundedCache, EngineError, Sink
from eval.engine import layer as engine_layer
from models import attach_gates, gate_mode, model_gates

BASELINES = ["full", "window", "sink", "h2o", "tova", "quest"]


def left_padded_batch(seed=1, length=20, vocab=97):
    torch.manual_seed(seed)
    ids = torch.randint(1, vocab, (3, length))
    mask = torch.ones_like(ids)
    mask[0, :6] = 0
    mask[2, :2] = 0
    return ids, mask


def gated(kind, family="llama", seed=0, **settings):
    """A tiny model with gates whose decisions are far from trivial: random DMS adapters (about half the
    tokens marked), or TRIM-KV retention spread over [sigmoid(-2), sigmoid(2)]."""
    model = tiny_model(family, seed=seed)
    if kind == "dms":
        settings.setdefault("source", "adapter")
    attach_gates(model, kind, **settings)
    generator = torch.Generator().manual_seed(seed + 7)
    for gate in model_gates(model):
        if kind == "dms" and gate.settings.source == "query_neuron":
            continue  # the repurposed q_proj channel of a random model already decides about half the tokens
        if kind == "dms":
            gate.proj.weight.data = torch.randn(gate.proj.weight.shape, generator=generator) * 0.2
        else:
            gate.down.weight.data = torch.randn(gate.down.weight.shape, generator=generator) * 0.5
            gate.head_bias.data.zero_()
    return model


def generate(model, ids, mask, cache=None, new=8):
    out = model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, cache=cache,
                         output_scores=True, return_dict_in_generate=True, pad_token_id=0)
    return out.sequences, torch.stack(out.scores)


# --- a budget that holds everything is the full cache --------------------------------------------------
@pytest.mark.parametrize("policy", BASELINES)
def test_budget_over_sequence_equals_full_cache(policy, family):
    model = tiny_model(family)
    ids, mask = left_padded_batch()
    ref_seq, ref_scores = generate(model, ids, mask)
    seq, scores = generate(model, ids, mask, BoundedCache(model, policy=policy, budget=64))
    assert torch.equal(seq, ref_seq)
    torch.testing.assert_close(scores, ref_scores, atol=1e-5, rtol=1e-5)


def test_learned_policies_with_room_equal_the_gated_model_on_a_dynamic_cache():
    ids, mask = left_padded_batch()
    for kind in ("dms", "trimkv"):
        model = gated(kind, window=3) if kind == "dms" else gated(kind, budget=64)
        with gate_mode(model, "infer"):
            ref_seq, ref_scores = generate(model, ids, mask, DynamicCache(config=model.config))
        seq, scores = generate(model, ids, mask, BoundedCache(model, policy=kind, budget=64))
        assert torch.equal(seq, ref_seq), kind
        torch.testing.assert_close(scores, ref_scores, atol=1e-5, rtol=1e-5)


def test_rows_that_reach_eos_stop_as_with_a_full_cache():
    model = tiny_model()
    ids, mask = left_padded_batch()
    free_run, _ = generate(model, ids, mask)
    eos = int(free_run[0, 22])  # row 0's third new token
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, eos_token_id=eos, pad_token_id=0)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, eos_token_id=eos, pad_token_id=0,
                         cache=BoundedCache(model, policy="h2o", budget=64))
    assert torch.equal(out, ref) and bool((out[0, 23:] == 0).all())


def test_transformers_prefill_chunking_through_the_engine():
    model = tiny_model()
    ids, mask = left_padded_batch(length=30)
    ref_seq, ref_scores = generate(model, ids, mask, BoundedCache(model, policy="tova", budget=8, chunk_size=6))
    cache = BoundedCache(model, policy="tova", budget=8, chunk_size=6)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, cache=cache, output_scores=True,
                         return_dict_in_generate=True, pad_token_id=0, prefill_chunk_size=12)
    assert torch.equal(out.sequences, ref_seq)  # 12-token forwards split into the same 6-token chunks
    torch.testing.assert_close(torch.stack(out.scores), ref_scores)


def test_sampling_and_batches_run_under_eviction():
    model = tiny_model()
    ids, mask = left_padded_batch(length=30)
    cache = BoundedCache(model, policy="tova", budget=8, chunk_size=5)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=True, top_k=20, cache=cache,
                         pad_token_id=0)
    assert out.shape == (3, 42)
    stats = cache.stats()
    assert int(stats.peak_tokens.max()) == 8 and stats.capacity_evictions > 0 and stats.read_reduction > 1


@pytest.mark.parametrize("policy", ["window", "sink", "h2o", "tova", "dms", "trimkv"])
def test_a_padded_batch_row_equals_the_row_alone_under_eviction(policy):
    """Padding never takes a slot or shifts a decision: each row evicts exactly as it would alone.
    (chunk_size 1, so chunk boundaries fall on the same tokens with and without padding.)"""
    # learned policies with sinks: a padded row pins its own first real tokens, not the padding
    model = (gated(policy, window=2, sinks=2) if policy == "dms" else gated(policy, sinks=2) if policy == "trimkv"
             else tiny_model())
    ids, mask = left_padded_batch(length=24)
    seq, scores = generate(model, ids, mask, BoundedCache(model, policy=policy, budget=6, chunk_size=1))
    for row in range(3):
        real = mask[row].bool()
        alone_seq, alone_scores = generate(model, ids[row:row + 1, real], mask[row:row + 1, real],
                                           BoundedCache(model, policy=policy, budget=6, chunk_size=1))
        assert torch.equal(seq[row, -8:], alone_seq[0, -8:])
        torch.testing.assert_close(scores[:, row], alone_scores[:, 0], atol=1e-4, rtol=1e-4)


# --- a plain float64 reference of every eviction rule ------------------------------------------------
REFERENCE: dict = {}


def reference_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """Whole-sequence attention that replays the policy token by token with Python sets (batch 1, float64);
    counts the keys each query reads per KV head."""
    cfg = REFERENCE
    policy, budget, chunks = cfg["policy"], cfg["budget"], cfg["chunks"]
    q, k, v = query[0], key[0], value[0]
    heads, length, _ = q.shape
    kv_heads = k.shape[0]
    group = heads // kv_heads
    gate = module.kv_gate._current[0].expand(kv_heads, -1) if policy in ("dms", "trimkv") else None
    window = module.kv_gate.settings.window if policy == "dms" else None
    pinned = module.kv_gate.settings.sinks if policy in ("dms", "trimkv") else 0  # the gated model's sinks

    def dms_gone(i, t):  # key i marked by token i+1's decision, and older than the window; sinks never go
        return i >= pinned and i + 1 < length and bool(gate[h, i + 1] > 0) and t - i > window

    def retention(i, t):  # TRIM-KV's score; a sink ranks above every other key
        return float("inf") if i < pinned else float(gate[h, i]) * (t - i)

    kept = [set() for _ in range(kv_heads)]
    acc = [{} for _ in range(kv_heads)]
    out = torch.zeros(heads, length, v.shape[-1], dtype=q.dtype)
    for start, stop in chunks:
        probs = {}
        for t in range(start, stop):
            for h in range(kv_heads):
                cand = kept[h] | set(range(start, t + 1))
                if policy == "dms":
                    cand = {i for i in cand if not dms_gone(i, t)}
                if policy == "trimkv":
                    cand = set(sorted(cand, key=lambda i: retention(i, t))[-budget:])
                cand = sorted(cand)
                cfg["reads"] += len(cand)
                for g in range(group):
                    head = h * group + g
                    p = torch.softmax(torch.stack([q[head, t] @ k[h, i] for i in cand]) * scaling, 0)
                    out[head, t] = sum(p_i * v[h, i] for p_i, i in zip(p, cand))
                    probs[head, t] = dict(zip(cand, p.tolist()))
        last = stop - 1
        for h in range(kv_heads):
            cand = kept[h] | set(range(start, stop))
            excess = len(cand) - budget
            if policy == "window":
                kept[h] = set(sorted(cand)[-budget:])
            elif policy == "sink":
                rest = sorted(i for i in cand if i >= cfg["sinks"])
                kept[h] = cand - set(rest[:max(0, excess)])
            elif policy == "tova":
                score = {i: sum(probs[head, last][i] for head in range(heads)) / heads for i in cand}
                kept[h] = cand - set(sorted(cand, key=score.get)[:max(0, excess)])
            elif policy == "h2o":
                for t in range(start, stop):
                    for g in range(group):
                        for i, p in probs[h * group + g, t].items():
                            acc[h][i] = acc[h].get(i, 0.0) + p / group
                recent = budget // 2
                old = sorted((i for i in cand if i <= last - recent), key=lambda i: acc[h].get(i, 0.0))
                kept[h] = cand - set(old[:max(0, excess)])
            elif policy == "trimkv":
                kept[h] = set(sorted(cand, key=lambda i: retention(i, last))[-budget:])
            elif policy == "dms":
                kept[h] = {i for i in cand if not dms_gone(i, last + 1)}
    cfg["kept"][module.layer_idx] = kept
    return out.transpose(0, 1)[None].to(query.dtype), None


def engine_chunks(prefill: int, chunk: int, length: int) -> list[tuple[int, int]]:
    """The chunks the engine sees: the prefill split by chunk_size, then one token per decode forward."""
    spans = [(a, min(a + chunk, prefill)) for a in range(0, prefill, chunk)]
    return spans + [(t, t + 1) for t in range(prefill, length)]


def make_reference_model(policy, seed):
    if policy == "dms":
        return gated("dms", seed=seed, window=3, sinks=2).double()
    if policy == "trimkv":
        return gated("trimkv", seed=seed, sinks=2).double()
    return tiny_model(seed=seed).double()


@pytest.mark.parametrize("policy", ["window", "sink", "h2o", "tova", "trimkv", "dms"])
@pytest.mark.parametrize("chunk", [1, 3])
@pytest.mark.parametrize("prefill", [11, 1])  # 1: decode steps start before the learned policies' sinks are passed
@torch.no_grad()
def test_evictions_and_logits_equal_the_plain_reference(policy, chunk, prefill):
    torch.manual_seed(3)
    length = 26
    budget = 32 if policy == "dms" else 6  # DMS evicts by its own decisions; forced evictions are tested apart
    model = make_reference_model(policy, seed=2)
    ids = torch.randint(0, 97, (1, length))

    cache = BoundedCache(model, policy=policy, budget=budget, chunk_size=chunk)
    logits = [model(ids[:, :prefill], cache=cache).logits]
    logits += [model(ids[:, t:t + 1], cache=cache).logits for t in range(prefill, length)]
    engine_logits = torch.cat(logits, 1)
    engine_kept = [[set(layer.positions[0, h][layer.positions[0, h] >= 0].tolist()) for h in range(2)]
                   for layer in cache.layers]

    REFERENCE.clear()
    REFERENCE.update(policy=policy, budget=budget, sinks=4, kept={}, reads=0, chunks=engine_chunks(prefill, chunk, length))
    AttentionInterface.register("engine_reference", reference_attention)
    model.set_attn_implementation("engine_reference")
    ref_logits = model(ids, use_cache=False).logits

    assert engine_kept == [REFERENCE["kept"][i] for i in range(len(cache.layers))]
    assert cache.stats().query_reads == REFERENCE["reads"]  # every query, every layer and KV head
    torch.testing.assert_close(engine_logits, ref_logits, atol=1e-9, rtol=1e-9)
    if policy != "dms":
        assert cache.stats().capacity_evictions > 0


@pytest.mark.parametrize("policy", ["h2o", "sink", "dms", "trimkv"])
@pytest.mark.parametrize("chunk", [3, 11])
def test_prefill_in_blocks_of_queries_equals_the_plain_reference(policy, chunk, monkeypatch):
    """A prefill chunk's masked attention runs in blocks of queries, each reading only what its queries see."""
    monkeypatch.setattr(engine_layer, "QUERY_BLOCK", 2)
    test_evictions_and_logits_equal_the_plain_reference(policy, chunk, 11)


@pytest.mark.parametrize("policy", ["h2o", "window"])
@torch.no_grad()
def test_prefill_blocks_read_what_their_queries_see_whatever_the_positions(policy, monkeypatch):
    """Positions that restart (two segments in one prompt) let early queries see later keys: a block still reads
    them (it reads through the last candidate its queries see, not just through its own keys)."""
    model = tiny_model()
    ids = torch.randint(1, 97, (1, 12))
    mask = torch.ones_like(ids)
    mask[0, 0] = 0  # padding: the chunk takes the masked path
    positions = (torch.arange(12) % 6)[None]

    def logits():
        with BoundedCache(model, policy=policy, budget=16) as cache:
            return model(ids, attention_mask=mask, position_ids=positions, cache=cache).logits

    expected = logits()
    monkeypatch.setattr(engine_layer, "QUERY_BLOCK", 2)
    torch.testing.assert_close(logits(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("policy", ["h2o", "window", "dms"])
def test_prefill_blocks_of_padding_alone_change_nothing(policy, monkeypatch):
    """Blocks where every row is padding see only their own keys; the real tokens' results are one block's."""
    model = gated(policy, window=2, sinks=2) if policy == "dms" else tiny_model()
    ids, mask = left_padded_batch(length=24)
    mask[:, :2] = 0  # the first block of two queries is padding in every row
    expected = generate(model, ids, mask, BoundedCache(model, policy=policy, budget=12))
    monkeypatch.setattr(engine_layer, "QUERY_BLOCK", 2)
    seq, scores = generate(model, ids, mask, BoundedCache(model, policy=policy, budget=12))
    assert torch.equal(seq, expected[0])
    torch.testing.assert_close(scores, expected[1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("source", ["adapter", "query_neuron"])
def test_dms_teacher_forcing_equals_the_gated_model_with_the_hard_mask(source):
    model = gated("dms", window=4, source=source)
    ids, mask = left_padded_batch(length=30)
    with gate_mode(model, "infer"):
        reference = model(ids, attention_mask=mask, use_cache=False).logits
    cache = BoundedCache(model, policy="dms", budget=64, chunk_size=7)
    logits = [model(ids[:, :12], attention_mask=mask[:, :12], cache=cache).logits]
    logits += [model(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], cache=cache).logits for t in range(12, 30)]
    real = mask.bool()
    torch.testing.assert_close(torch.cat(logits, 1)[real], reference[real], atol=1e-5, rtol=1e-5)
    stats = cache.stats()
    assert stats.capacity_evictions == 0 and stats.compression > 1.2  # the gates evict on their own


def test_dms_reads_shrink_back_to_what_it_holds_and_stay_exact():
    """DMS frees slots itself; new tokens fill the lowest free slot, and the region every query reads shrinks
    back to the highest occupied slot after each prefill chunk and every SHRINK_EVERY decode steps."""
    from eval.engine.layer import SHRINK_EVERY

    model = gated("dms", window=3, sinks=1)
    for gate in model_gates(model):
        gate.proj.bias.data.fill_(gate.settings.offset + 2.0)  # most keys marked: the cache holds far fewer than it saw
    length = 12 + 2 * SHRINK_EVERY
    ids, mask = left_padded_batch(length=length)
    with gate_mode(model, "infer"):
        reference = model(ids, attention_mask=mask, use_cache=False).logits
    cache = BoundedCache(model, policy="dms", budget=128, chunk_size=5)
    logits = [model(ids[:, :12], attention_mask=mask[:, :12], cache=cache).logits]
    logits += [model(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], cache=cache).logits for t in range(12, length)]
    real = mask.bool()
    torch.testing.assert_close(torch.cat(logits, 1)[real], reference[real], atol=1e-5, rtol=1e-5)
    cache.stats()  # settles the peak
    for layer in cache.layers:  # just shrunk (the last decode step is a multiple of SHRINK_EVERY)
        assert bool((layer.positions[..., layer.in_use:] < 0).all())  # nothing held past the region read
        assert layer.in_use <= int(layer.peak.max()) < length // 2  # lowest-free placement: extent <= peak held


def test_quest_reads_fewer_keys_but_keeps_them_all():
    model = tiny_model()
    ids, mask = left_padded_batch(length=40)
    cache = BoundedCache(model, policy="quest", budget=16, chunk_size=64)
    generate(model, ids, mask, cache, new=10)
    stats = cache.stats()
    assert stats.read_reduction > 1.5  # reads: two 8-token pages of ~45 tokens, per query head group
    assert stats.compression == pytest.approx(1.0)  # memory: nothing evicted
    assert stats.slots == 1024 and stats.capacity_evictions == 0


def test_quest_page_selection_follows_the_key_bound():
    from eval.engine import Quest

    quest = Quest(page_size=2)
    quest.bind(tiny_model(), budget=4)  # two pages: the newest, and the best of the rest
    key_min = torch.tensor([[[[0.0, 0.0], [1.0, -1.0], [-3.0, 0.0]]]])
    key_max = torch.tensor([[[[1.0, 1.0], [2.0, 0.0], [-2.0, 0.5]]]])
    query = torch.tensor([[[[1.0, 0.0]]]])  # bounds: page 0 -> 1, page 1 -> 2, page 2 -> -2
    ok = torch.tensor([[[True, True, True]]])
    chosen = quest.top_pages(query, key_min, key_max, ok)
    assert sorted(chosen.flatten().tolist()) == [1, 2]  # the best page, plus the newest page always


# --- gap compression ------------------------------------------------------------------------------------
def test_gaps_over_ten_become_rounded_log_log():
    from eval.engine.positions import compress_gaps, compressed_positions

    gaps = torch.tensor([1, 5, 10, 11, 100, 10**6])
    assert compress_gaps(gaps).tolist() == [1, 5, 10, 1, 2, 3]
    positions = torch.tensor([[52, 0, 1, 2, 3, 50, 51, -1]])
    assert compressed_positions(positions, positions >= 0)[0, :7].tolist() == [6, 0, 1, 2, 3, 4, 5]


def test_rerotating_a_key_equals_rope_at_the_new_position():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from eval.engine.positions import rotary_frequencies, rotate

    model = tiny_model().double()
    torch.manual_seed(0)
    x = torch.randn(1, 2, 9, 16, dtype=torch.float64)
    pos = torch.randint(0, 900, (1, 9))
    delta = torch.randint(-500, 100, (1, 9)).clamp(min=-pos)

    def rope(positions):
        cos, sin = model.model.rotary_emb(x, positions)
        return apply_rotary_pos_emb(x, x, cos, sin)[0]

    moved = rotate(rope(pos), delta[:, None].expand(1, 2, 9), rotary_frequencies(model))
    # transformers computes the RoPE angles in float32: about 1e-5 at positions near 1000
    torch.testing.assert_close(moved, rope(pos + delta), atol=1e-4, rtol=1e-4)


def test_gap_compression_changes_nothing_without_gaps_and_something_with_them():
    model = tiny_model()
    ids, mask = left_padded_batch(length=30)
    _, plain = generate(model, ids, mask, BoundedCache(model, policy="window", budget=8, chunk_size=1))
    _, compressed = generate(model, ids, mask, BoundedCache(model, policy="window", budget=8, chunk_size=1,
                                                             gap_compression=True))
    torch.testing.assert_close(compressed, plain)  # a window leaves no gaps between kept tokens
    _, sink = generate(model, ids, mask, BoundedCache(model, policy="sink", budget=8, chunk_size=1))
    _, sink_compressed = generate(model, ids, mask, BoundedCache(model, policy="sink", budget=8, chunk_size=1,
                                                                 gap_compression=True))
    assert (sink - sink_compressed).abs().max() > 1e-3  # sinks far behind the window are moved closer


# --- invariants ------------------------------------------------------------------------------------------
_MODEL = tiny_model(seed=5)
_DMS_MODEL = gated("dms", seed=5, window=2, sinks=1)


@settings(max_examples=25, deadline=None)
@given(policy=st.sampled_from(["window", "sink", "h2o", "tova", "trimkv-burst"]), budget=st.integers(5, 12),
       chunk=st.integers(1, 9), length=st.integers(1, 40), seed=st.integers(0, 10))
def test_never_more_valid_slots_than_capacity_and_sinks_stay(policy, budget, chunk, length, seed):
    from eval.engine import TrimKV

    model = _MODEL
    chosen = Sink(sinks=3) if policy == "sink" else policy
    if policy == "trimkv-burst":
        model, chosen = gated("trimkv", seed=seed), TrimKV(burst=3)
    torch.manual_seed(seed)
    ids = torch.randint(0, 97, (2, length))
    cache = BoundedCache(model, policy=chosen, budget=budget, chunk_size=chunk)
    for start in range(0, length, 7):
        model(ids[:, start:start + 7], cache=cache)
        for layer in cache.layers:
            held = (layer.positions >= 0).sum(-1)
            assert int(held.max()) <= layer.slots
            if policy == "sink":
                for pos in range(min(3, start + 7, length)):
                    assert bool((layer.positions == pos).any(-1).all())
    assert cache.stats().bytes_allocated == sum(layer.bytes_allocated for layer in cache.layers)


@settings(max_examples=15, deadline=None)
@given(length=st.integers(2, 30), seed=st.integers(0, 50))
def test_a_dms_marked_token_stays_readable_for_exactly_window_steps(length, seed):
    model, window = _DMS_MODEL, 2
    torch.manual_seed(seed)
    ids = torch.randint(0, 97, (1, length))
    with gate_mode(model, "infer"):
        model(ids, use_cache=False)
        logits = [gate.outputs["logit"][0] for gate in model_gates(model)]  # already shifted: decision for key i
    cache = BoundedCache(model, policy="dms", budget=64)
    for t in range(length):
        model(ids[:, t:t + 1], cache=cache)
        for layer, logit in zip(cache.layers, logits):
            for h in range(logit.shape[0]):
                held = set(layer.positions[0, h][layer.positions[0, h] >= 0].tolist())
                # after token t: key i < t is gone iff marked and the next query (t + 1) is past its window
                # (key 0 is the sink and stays)
                expected = {i for i in range(t + 1) if not (0 < i < t and bool(logit[h, i] > 0) and t + 1 - i > window)}
                assert held == expected


# --- errors --------------------------------------------------------------------------------------------
def test_a_cache_serves_one_generate_call():
    model = tiny_model()
    ids = torch.randint(0, 97, (1, 6))
    with BoundedCache(model, policy="window", budget=4) as cache:
        model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, max_new_tokens=3, do_sample=False)
        for prompt in (ids, ids[:, :3], torch.cat([ids, ids], 1)):
            with pytest.raises(EngineError, match="already holds 8 positions from an earlier call; use a new BoundedCache"):
                model.generate(prompt, attention_mask=torch.ones_like(prompt), cache=cache, max_new_tokens=3)


@pytest.mark.parametrize("budget", [2.5, "8", True, None])
def test_budget_and_chunk_types_are_checked_when_the_cache_is_made(budget):
    model = tiny_model()
    with pytest.raises(EngineError, match=f"budget={budget!r} is invalid; it must be an integer >= 1"):
        BoundedCache(model, policy="tova", budget=budget)
    with pytest.raises(EngineError, match="chunk_size=2.0 is invalid; it must be an integer >= 1"):
        BoundedCache(model, policy="tova", budget=4, chunk_size=2.0)


def test_bad_settings_get_clear_errors():
    model = tiny_model()
    with pytest.raises(EngineError, match="unknown policy 'lru'.*valid"):
        BoundedCache(model, policy="lru")
    with pytest.raises(EngineError, match="budget=0"):
        BoundedCache(model, policy="tova", budget=0)
    with pytest.raises(EngineError, match="sinks=8 .*budget=8"):
        BoundedCache(model, policy=Sink(sinks=8), budget=8)
    with pytest.raises(EngineError, match="dms policy needs a model with dms gates.*no gates"):
        BoundedCache(model, policy="dms")
    for kind in ("dms", "trimkv"):
        with pytest.raises(EngineError, match=f"{kind} budget=3 does not exceed the model's 3 sinks; valid: budget >= 4"):
            BoundedCache(gated(kind, sinks=3), policy=kind, budget=3)
    with pytest.raises(EngineError, match="full policy must keep more tokens than its 4 slots"):
        model(torch.randint(0, 97, (1, 9)), cache=BoundedCache(model, policy="full", budget=4))
    cache = BoundedCache(model, policy="tova", budget=4)
    model.set_attn_implementation("sdpa")
    with pytest.raises(EngineError, match="needs the model's attention set to 'retrokv_engine'"):
        model(torch.randint(0, 97, (1, 3)), cache=cache)


def test_a_closed_cache_restores_the_model_and_refuses_more_work():
    model = attach_gates(tiny_model(), "dms", window=2)
    with gate_mode(model, "train"):
        with BoundedCache(model, policy="dms", budget=8) as cache:
            assert model.config._attn_implementation == "retrokv_engine" and models.gate_state(model).mode == "infer"
            model(torch.randint(0, 97, (1, 5)), cache=cache)
        assert model.config._attn_implementation == "retrokv" and models.gate_state(model).mode == "train"
        with pytest.raises(EngineError, match="closed"):
            model(torch.randint(0, 97, (1, 3)), cache=cache)
        assert cache.stats().tokens_seen == 5  # what it measured stays readable
    plain = tiny_model()
    cache = BoundedCache(plain, policy="tova", budget=4)
    cache.close()
    cache.close()  # idempotent
    assert plain.config._attn_implementation == "sdpa"


def test_detached_gates_leave_the_original_model():
    model = tiny_model()
    ids, mask = left_padded_batch()
    reference = model(ids, attention_mask=mask).logits
    for kind in ("dms", "trimkv"):
        attach_gates(model, kind)
        models.detach_gates(model)
        assert not model_gates(model) and not hasattr(model.config, "retrokv")
        assert model.config._attn_implementation == "sdpa"
        torch.testing.assert_close(model(ids, attention_mask=mask).logits, reference, rtol=0, atol=0)
    with pytest.raises(models.GateError, match="no gates to detach"):
        models.detach_gates(model)


def test_the_engine_attention_without_a_bounded_cache_is_the_model_itself():
    model = tiny_model()
    ids, mask = left_padded_batch()
    reference = model(ids, attention_mask=mask).logits
    BoundedCache(model, policy=TOVA(), budget=4)  # switches the attention implementation
    real = mask.bool()
    torch.testing.assert_close(model(ids, attention_mask=mask).logits[real], reference[real])
    assert sorted(POLICIES) == sorted(["full", "window", "sink", "h2o", "tova", "dms", "trimkv", "quest"])


@pytest.mark.slow
@pytest.mark.ci
def test_smollm2_generates_through_the_engine(smollm2, tokenizer):
    """The real model: a roomy TOVA cache is the full cache; a tight one still answers, in 1/4 of the memory."""
    model, _ = smollm2
    prompt = tokenizer(["The capital of France is", "Water boils at a temperature of"], return_tensors="pt",
                       padding=True, padding_side="left")
    full_seq, full_scores = generate(model, prompt.input_ids, prompt.attention_mask, new=12)
    with BoundedCache(model, "tova", budget=64) as cache:  # gives the session's model its attention back
        seq, scores = generate(model, prompt.input_ids, prompt.attention_mask, cache, new=12)
    assert torch.equal(seq, full_seq)
    torch.testing.assert_close(scores, full_scores, atol=1e-4, rtol=1e-4)
    assert "Paris" in tokenizer.decode(seq[0, -12:])
    stop = {"max_new_tokens": 12, "do_sample": False, "stop_strings": ["Paris"], "tokenizer": tokenizer}
    france = tokenizer("The capital of France is", return_tensors="pt")
    with_full = model.generate(**france, **stop)
    with BoundedCache(model, "window", budget=64) as cache:
        with_engine = model.generate(**france, cache=cache, **stop)
    assert torch.equal(with_engine, with_full)
    assert tokenizer.decode(with_full[0]).endswith("Paris") and with_full.shape[1] < france.input_ids.shape[1] + 12


@pytest.mark.parametrize("policy", ["window", "sink", "h2o", "tova", "dms", "trimkv"])
def test_a_decode_step_reads_nothing_back_to_the_host(policy):
    """No tensor becomes a Python value in the engine's decode step (it would stall a GPU each layer)."""
    from eval.engine.syncs import count_host_syncs

    model = gated(policy, sinks=2) if policy in ("dms", "trimkv") else tiny_model()
    ids, mask = left_padded_batch()
    with BoundedCache(model, policy=policy, budget=6) as cache:
        model(ids, attention_mask=mask, cache=cache)
        with count_host_syncs() as syncs:
            for layer in cache.layers:  # the engine's own work, not the model's or transformers'
                batch = ids.shape[0]
                layer.update(*(torch.randn(batch, 2, 1, 16),) * 2)
                gate = torch.randn(batch, 2, 1) if policy in ("dms", "trimkv") else None
                layer.attend(torch.randn(batch, 4, 1, 16), torch.ones(batch, 1, dtype=torch.bool),
                             torch.full((batch, 1), 30), 0.25, gate)
        assert syncs["count"] == 0
        with count_host_syncs() as syncs:
            int(torch.ones(()))
        assert syncs["count"] == 1  # the counter itself works


def _decode_through(forward, model, policy: str, steps: int = 40):
    """A padded batch prefilled eagerly, then `steps` greedy decode steps through `forward`: (logits [steps, B, V],
    the cache's statistics)."""
    ids, mask = left_padded_batch()
    with BoundedCache(model, policy=policy, budget=6) as cache:
        logits = model(ids, attention_mask=mask, cache=cache).logits[:, -1]
        out = []
        for _ in range(steps):
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
            logits = forward(logits.argmax(-1, keepdim=True), attention_mask=mask,
                             position_ids=mask.sum(-1, keepdim=True) - 1, cache=cache).logits[:, -1]
            out.append(logits)
        return torch.stack(out), cache.stats().summary()


@pytest.mark.parametrize("policy", ["window", "sink", "h2o", "tova", "dms", "trimkv"])
def test_torch_compile_captures_the_decode_step_whole(policy):
    """torch.compile takes a decode step as one graph with no break (fullgraph), and after the first step's graph,
    which specialises on the step counters, that one graph serves every step, past DMS's shrink interval too; it
    computes what eager does, statistics included."""
    model = gated(policy, sinks=2) if policy in ("dms", "trimkv") else tiny_model()
    graphs = []

    def backend(graph, example_inputs):  # count the graphs and run each as captured
        graphs.append(graph)
        return graph.forward

    torch._dynamo.reset()
    with torch.no_grad():
        eager_logits, eager_stats = _decode_through(model.forward, model, policy)
        logits, stats = _decode_through(torch.compile(model.forward, backend=backend, fullgraph=True), model, policy)
    assert len(graphs) == 2
    # (to rounding: a compiled step reads every slot, so its sums run over more, masked, terms)
    torch.testing.assert_close(logits, eager_logits, rtol=0, atol=1e-6)
    assert stats == eager_stats and stats["decode_steps"] == 40 > engine_layer.SHRINK_EVERY


@pytest.mark.slow
@pytest.mark.ci
def test_an_inductor_compiled_decode_step_equals_eager():
    """The same through inductor's generated code (DMS: sinks, window, drops, the folded adapter gate)."""
    model = gated("dms", sinks=2)
    torch._dynamo.reset()
    with torch.no_grad():
        eager_logits, eager_stats = _decode_through(model.forward, model, "dms")
        logits, stats = _decode_through(torch.compile(model.forward), model, "dms")
    torch.testing.assert_close(logits, eager_logits, rtol=1e-5, atol=1e-5)
    assert stats == eager_stats
