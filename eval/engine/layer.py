"""One layer of the bounded cache: fixed slots per (sequence, KV head), chunked attention, eviction.

Slots hold RoPE'd keys, values, the token's true position (-1 = empty) and the policy's per-slot state.
A forward's new tokens are attended in chunks: each chunk reads the occupied slots plus its own keys
(causally), then the policy scores slots and chunk together and the best ones that fit stay. Tokens that
stay overwrite freed slots in place; nothing is compacted and nothing grows past the slots allocated.
A decode step (one token) is written into a free slot first and attended in one pass (`_decode`), which is
why a layer allocates one slot more than it may hold. `QuestLayer` adds Quest's page bounds and its sparse
decode step on top.

Counters: `length` is what transformers counts positions from (padding included); `real_tokens` [B] is
each sequence's real tokens; reads and held tokens are device tensors, read once by `BoundedCache.stats`.
Decode steps log their per-step counts by reference and fold them in every `DECODE_LOG` steps
(`settle_counters`): a few reductions then, instead of a dozen small ops per layer and step.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from transformers.cache_utils import CacheLayerMixin

from eval.engine.policies import NEG, POS, Chunk, EngineError, Policy
from eval.engine.positions import compressed_positions, rotate

DECODE_LOG = 256  # decode steps whose counts are folded into the counters at once
SHRINK_EVERY = 32  # decode steps between two shrinks of a dropping policy's used region (one readback each)
QUERY_BLOCK = 128  # queries per block of a prefill chunk's masked attention (see query_blocks)


def _readable(candidates: torch.Tensor, used: int, slots: int) -> torch.Tensor:
    """A prefill chunk's per-candidate tensor [..., slots + c] without the empty slots [used, slots)."""
    return torch.cat([candidates[..., :used], candidates[..., slots:]], -1)


def query_blocks(visible: torch.Tensor, used: int) -> list[tuple[int, int, int]]:
    """(first query, end query, candidates it reads) per block of `QUERY_BLOCK` queries of a prefill chunk whose
    [B, Hkv, 1, c, used + c] visibility is `visible`. A block reads the candidates up to the last one any of
    its queries sees, and at least through its own keys: causally about half the chunk's score matrix instead of
    all of it, and a smaller mask at a time. The candidates it skips are hidden from its queries, so the result
    is exact for any positions. One readback per chunk of more than one block."""
    c, read = visible.shape[-2:]
    if c <= QUERY_BLOCK:
        return [(0, c, read)]
    starts = range(0, c, QUERY_BLOCK)
    seen = visible.any(2).any(1).any(0)  # [c, read]: some sequence's query reads the candidate
    reach = (seen * torch.arange(1, read + 1, device=seen.device)).amax(-1)  # [c] through its last candidate seen
    ends = torch.stack([reach[a:a + QUERY_BLOCK].amax() for a in starts]).tolist()
    return [(a, min(a + QUERY_BLOCK, c), max(n, used + min(a + QUERY_BLOCK, c))) for a, n in zip(starts, ends)]


def slot_positions(positions: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """The positions new tokens' slots hold (int32): their own, -1 for padding (which never takes a slot)."""
    return positions.to(torch.int32).masked_fill(~real, -1)


class BoundedLayer(CacheLayerMixin):
    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, policy: Policy, chunk_size: int, inv_freq: torch.Tensor | None = None):
        super().__init__()
        self.policy = policy
        self.inv_freq = inv_freq  # set: TOVA gap compression re-rotates keys and queries each chunk
        self.slots = policy.capacity()  # tokens held at most, per (sequence, KV head)
        # one spare slot: a decode step writes its token into a free slot first and attends once (see _decode)
        self.allocated = self.slots + 1
        # decode steps take _decode unless TOVA's gap compression re-rotates keys or a burst buffer evicts in batches
        self.decodes_in_place = inv_freq is None and policy.evict_to() == self.slots
        self.chunk_size = chunk_size
        self.length = 0  # positions processed, padding included: what transformers counts positions from
        self.in_use = 0  # slots [0, in_use) may hold tokens; later ones are still empty and are not read
        self.past_sinks = policy.sink_count == 0  # no new token can be a sink (see _read_back)
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None
        self.decode_steps = 0
        self.decode_reads = 0
        self.full_cache_reads = 0
        self.capacity_evictions = 0
        self.peak: torch.Tensor | None = None  # [Hkv] most tokens held by any sequence at once
        # every query, prefill chunks too; tensors, so that counting never waits on the device:
        self.query_reads: torch.Tensor | int = 0  # keys read, over real queries, KV heads and sequences
        self.held_integral: torch.Tensor | int = 0  # [Hkv] tokens held after each real token, summed over them
        self._decode_log: list[tuple[torch.Tensor, ...]] = []  # (reads, wanting to stay, real, seen) per decode step

    # --- the transformers layer API -------------------------------------------------------------------
    def lazy_initialization(self, key_states, value_states):
        batch, kv_heads, _, dim = key_states.shape
        shape = (batch, kv_heads, self.allocated)
        self.device = key_states.device
        self.keys = key_states.new_zeros(*shape, dim)
        self.values = value_states.new_zeros(*shape, value_states.shape[-1])
        self.positions = torch.full(shape, -1, dtype=torch.int32, device=self.device)  # 4 bytes next to 2*D values
        score_dtype = torch.promote_types(key_states.dtype, torch.float32)  # float32 scores, float64 for references
        self.state = {name: torch.full(shape, fill, dtype=score_dtype if dtype.is_floating_point else dtype,
                                       device=self.device) for name, (dtype, fill) in self.policy.state.items()}
        self.peak = torch.zeros(kv_heads, dtype=torch.long, device=self.device)
        self.real_tokens = torch.zeros(batch, dtype=torch.long, device=self.device)  # real tokens seen per sequence
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        """Hold the new keys/values for the engine's attention, which attends and stores them."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if key_states.shape[0] != self.keys.shape[0]:
            raise EngineError(f"batch size changed from {self.keys.shape[0]} to {key_states.shape[0]}; "
                              "use a new BoundedCache for a new batch")
        self.pending = (key_states, value_states)
        return key_states, value_states

    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """The mask covers only the new tokens (their padding and causal order); slots carry their own validity."""
        return query_length, self.length

    def get_max_length(self) -> int:
        return -1  # any length: the policy evicts

    def reset(self) -> None:
        self.is_initialized = False
        self.keys = self.values = None
        self.length = self.in_use = self.decode_steps = 0
        self.past_sinks = self.policy.sink_count == 0
        self.decode_reads = self.full_cache_reads = self.capacity_evictions = 0
        self.query_reads = self.held_integral = 0
        self._decode_log = []

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select_batch(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select_batch(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._select_batch(torch.arange(self.keys.shape[0], device=self.device).repeat_interleave(repeats))

    def _select_batch(self, index: torch.Tensor) -> None:
        if not self.is_initialized:
            return
        self.settle_counters()  # the log holds rows of the old batch
        index = index.to(self.device)
        self.keys, self.values, self.positions, self.real_tokens = (
            t.index_select(0, index) for t in (self.keys, self.values, self.positions, self.real_tokens))
        self.state = {name: t.index_select(0, index) for name, t in self.state.items()}

    @property
    def query_full_reads(self) -> int:
        """Keys a full cache would have read for every real query so far: the k-th real token of a sequence
        reads k keys per KV head."""
        if not self.is_initialized:
            return 0
        n = self.real_tokens.long()
        return int((n * (n + 1) // 2).sum()) * self.keys.shape[1]

    @property
    def bytes_allocated(self) -> int:
        if not self.is_initialized:
            return 0
        return sum(t.numel() * t.element_size() for t in self._stored_tensors())

    def _stored_tensors(self) -> list[torch.Tensor]:
        return [self.keys, self.values, self.positions, *self.state.values()]

    # --- attention --------------------------------------------------------------------------------------
    def attend(self, query: torch.Tensor, new_real: torch.Tensor, positions: torch.Tensor, scaling: float,
               gate: torch.Tensor | None, stored: torch.Tensor | None = None) -> torch.Tensor:
        """Attention output [B, H, q, D] for the held new tokens, storing them chunk by chunk. `stored`: the
        positions their slots will hold (-1 for padding), when the caller has them already."""
        if self.pending is None:
            raise EngineError("the engine's attention ran without a cache update for this layer")
        keys, values = self.pending
        self.pending = None
        q_len = query.shape[2]
        decode = q_len == 1
        self.length += q_len
        self.decode_steps += int(decode)
        if decode and self.decodes_in_place:
            if stored is None:
                stored = slot_positions(positions, new_real)
            return self._decode(query, keys, values, positions, new_real, gate, scaling, stored)
        out = query.new_empty(*query.shape[:3], values.shape[-1])
        for a in range(0, q_len, self.chunk_size):
            b = min(a + self.chunk_size, q_len)
            out[:, :, a:b] = self._attend_chunk(query[:, :, a:b], keys[:, :, a:b], values[:, :, a:b],
                                                positions[:, a:b], new_real[:, a:b],
                                                None if gate is None else gate[..., a:b], scaling, decode)
        return out

    def _decode(self, query, keys, values, positions, real, gate, scaling, stored) -> torch.Tensor:
        """One new token per sequence, written into a free slot first (there is always one: at most `slots`
        tokens are held in `slots + 1`) and attended together with the held tokens in one pass; then the policy
        frees what it drops and, when `slots + 1` tokens want to stay, evicts its lowest-scoring one (the new
        token included). The same candidates and rule as a chunk of one, without copies or host synchronisation.
        The slots read include one empty slot while the cache fills, so that "free the lowest candidate, empty
        slots lowest of all" evicts exactly when the slots overflow, with no test of the count."""
        batch, heads, _, dim = query.shape
        kv_heads = keys.shape[1]
        compiling = torch.compiler.is_compiling()
        # a compiled step reads every slot: static shapes, so one graph serves every step (empty slots are masked)
        n = self.allocated if compiling else min(self.in_use + 2, self.allocated)
        pos, slot_keys, slot_values = self.positions[..., :n], self.keys[:, :, :n], self.values[:, :, :n]
        free = pos.argmin(-1, keepdim=True)  # [B, Hkv, 1] a slot holding -1 (free)
        pos.scatter_(-1, free, stored[:, None].expand(-1, kv_heads, -1))
        slot_keys.scatter_(2, free[..., None].expand(-1, -1, -1, dim), keys)
        slot_values.scatter_(2, free[..., None].expand(-1, -1, -1, values.shape[-1]), values)
        state = {name: t[..., :n] for name, t in self.state.items()}
        chunk = Chunk(query=query.view(batch, kv_heads, heads // kv_heads, 1, dim), positions=positions, real=real,
                      gate=gate, cand_pos=pos, cand_ok=pos >= 0, state=dict(state), num_slots=n,
                      rank_start=self.real_tokens, most_held=self.in_use + 1, new_index=free,
                      latest=stored[:, :, None], past_sinks=self.past_sinks)
        if gate is None:
            for name, t in state.items():
                t.scatter_(-1, free, self.policy.state[name][1])
        else:
            self.policy.candidate_state(chunk)
        self.real_tokens = self.real_tokens + real[:, 0]

        visible = chunk.cand_ok[:, :, None, None, :]  # [B, Hkv, 1, 1, N]
        score = victim = extra = None
        if self.policy.reads_what_it_keeps:  # the query reads what stays: the lowest candidate leaves first
            score = self.policy.keep_scores(chunk, None)
            victim = torch.where(chunk.cand_ok, score, NEG).argmin(-1, keepdim=True)
            pos.scatter_(-1, victim, -1)
            visible = (pos >= 0)[:, :, None, None, :]
        else:
            extra = self.policy.visibility(chunk)
            if extra is not None:
                visible = visible & extra
        # one bmm pair over [B * Hkv, ...] views (fewer dispatches than a 4-d matmul); fused SDPA here measured no
        # faster at one query per sequence (docs/experiments/2026-11-30-eval-suite.md, sessions 10 and 12)
        scores = torch.bmm(query.view(batch * kv_heads, -1, dim), slot_keys.flatten(0, 1).transpose(1, 2))
        if scores.dtype not in (torch.float32, torch.float64):  # softmax in float32 at least
            scores = scores.float()
        scores = torch.where(visible, scores.mul_(scaling).view(batch, kv_heads, -1, 1, n), torch.finfo(scores.dtype).min)
        probs = scores.softmax(-1)  # [B, Hkv, G, 1, N]
        out = torch.bmm(probs.to(values.dtype).view(batch * kv_heads, -1, n), slot_values.flatten(0, 1))

        if score is None:
            score = self.policy.keep_scores(chunk, self._policy_input(chunk, probs))
        for name, t in state.items():
            if chunk.state[name] is not t:  # the policy replaced its state (H2O's accumulated attention)
                t.copy_(chunk.state[name])
        if self.policy.drops:  # what the policy drops (DMS's expired keys) frees its slot
            pos.masked_fill_(score == NEG, -1)
            keep = pos >= 0
        else:
            keep = chunk.cand_ok
        count = keep.sum(-1)  # [B, Hkv] tokens that want to stay
        if self.policy.can_overflow:  # Full pins every token: past its slots, refuse rather than evict one
            pinned = torch.isposinf(torch.where(keep, score, POS).amin(-1))
            if bool(((count > self.slots) & pinned).any()):
                raise self._overflow()
        # the lowest candidate leaves: an empty (or dropped) slot whenever there is one, which changes nothing,
        # else the weakest held or new token; held tokens never score -inf (only what a policy drops does)
        if victim is None:
            victim = torch.where(keep, score, NEG).argmin(-1, keepdim=True)
            pos.scatter_(-1, victim, -1)
        # [B, Hkv] keys read; a policy that reads what it keeps read all but the victim when the slots overflowed,
        # min(count, slots), which settle_counters takes
        read = count if extra is None else visible.sum((2, 3, 4))
        self._decode_log.append((read, count, real, self.real_tokens))
        if len(self._decode_log) == DECODE_LOG or compiling:
            self.settle_counters()  # (a compiled step folds at once: the fold fuses, and a growing list would recompile)
        self.in_use = min(self.in_use + 1, self.allocated)
        # (a compiled step skips the shrink: its readback would break the graph, and it reads every slot anyway)
        if self.policy.drops and not compiling and self.decode_steps % SHRINK_EVERY == 0:
            self._read_back()
        return out.view(batch, heads, 1, -1)

    def _read_back(self) -> None:
        """Bring the host's view of the slots up to date, in one readback: after each prefill chunk and every
        `SHRINK_EVERY` decode steps of a dropping policy, never in the other decode steps.

        `in_use` falls back to the highest occupied slot + 1 for a policy that frees slots by itself (DMS's
        expired keys): it leaves holes, which new tokens fill lowest first, so what it holds stays near the front
        while `in_use` only ever grows by itself, and every query reads `in_use` slots. `past_sinks` turns true
        once every sequence has more real tokens than the policy's sinks: new tokens' sink tests stop then."""
        shrink, sinks = self.policy.drops and self.in_use > 0, not self.past_sinks
        wanted = []
        if shrink:
            extent = torch.arange(1, self.in_use + 1, device=self.device)
            wanted.append(((self.positions[..., :self.in_use] >= 0) * extent).amax())
        if sinks:
            wanted.append((self.real_tokens >= self.policy.sink_count).all())
        if not wanted:
            return
        values = torch.stack([v.long() for v in wanted]).tolist()
        if shrink:
            self.in_use = values.pop(0)
        if sinks:
            self.past_sinks = bool(values.pop(0))

    def settle_counters(self) -> None:
        """Fold the logged decode steps into the counters (reads, what a full cache would read, forced
        evictions, peak and integral of held tokens); `BoundedCache.stats` calls it first."""
        if not self._decode_log:
            return
        read, count, real, seen = (torch.stack(parts) for parts in zip(*self._decode_log))  # [S, B, ...]
        self._decode_log = []
        real = real.long()  # [S, B, 1]
        held = count.clamp(max=self.slots)  # [S, B, Hkv]
        if self.policy.reads_what_it_keeps:
            read = held
        reads = (read * real).sum()
        self.query_reads += reads
        self.decode_reads += reads
        self.full_cache_reads += seen.sum() * self.keys.shape[1]
        self.capacity_evictions += (count - held).sum()
        self.peak = torch.maximum(self.peak, held.amax((0, 1)))
        self.held_integral += (held * real).sum((0, 1))

    def _chunk(self, query, positions, real, gate) -> Chunk:
        """The chunk's tokens next to the occupied slots (the candidates), with the policy's state for both."""
        batch, heads, c, dim = query.shape
        kv_heads = self.keys.shape[1]
        slots = min(self.in_use + c, self.allocated)  # the used slots plus room for this chunk
        positions = positions.to(torch.int32)
        new_pos = slot_positions(positions, real)[:, None].expand(-1, kv_heads, -1)
        cand_pos = torch.cat([self.positions[..., :slots], new_pos], -1)
        cand_ok = cand_pos >= 0
        state = {name: torch.cat([t[..., :slots], torch.full((batch, kv_heads, c), self.policy.state[name][1], dtype=t.dtype,
                                                device=t.device)], -1) for name, t in self.state.items()}
        chunk = Chunk(query=query.view(batch, kv_heads, heads // kv_heads, c, dim), positions=positions, real=real,
                      gate=gate, cand_pos=cand_pos, cand_ok=cand_ok, state=state, num_slots=slots,
                      rank_start=self.real_tokens, most_held=self.in_use + c, past_sinks=self.past_sinks)
        if gate is not None:
            self.policy.candidate_state(chunk)
        self.real_tokens = self.real_tokens + real.sum(-1)
        return chunk

    def _attend_chunk(self, query, keys, values, positions, real, gate, scaling, decode):
        batch, heads, c, _ = query.shape
        chunk = self._chunk(query, positions, real, gate)
        slots = chunk.num_slots
        used = self.in_use  # slots [used, slots) are still empty: room for the chunk, nothing to read
        slot_keys, slot_values = self.keys[:, :, :used], self.values[:, :, :used]
        # what the queries read, the used slots and the chunk: their [B, Hkv, 1, c, read] visibility is built on
        # those candidates alone (a first chunk would otherwise build it over as many empty slots as it has tokens)
        reading = chunk if used == slots else dataclasses.replace(
            chunk, cand_pos=_readable(chunk.cand_pos, used, slots), cand_ok=_readable(chunk.cand_ok, used, slots),
            state={name: _readable(t, used, slots) for name, t in chunk.state.items()}, num_slots=used)
        causal = reading.cand_pos[:, :, None, :] <= chunk.positions[:, None, :, None]
        visible = (reading.cand_ok[:, :, None, :] & causal)[:, :, None]  # [B, Hkv, 1, c, read]
        extra = self.policy.visibility(reading)
        if extra is not None:
            visible = visible & extra
        if self.inv_freq is not None:
            out, probs = self._attend_scores(chunk, query, slot_keys, keys, slot_values, values, visible, scaling)
            probs = self._policy_input(chunk, probs)
        elif self.policy.needs_probs == "received":
            out, probs = self._attend_received(chunk, query, slot_keys, keys, slot_values, values, visible, scaling)
        else:
            if used == 0 and extra is None and bool(real.all()):
                # nothing held yet and no padding: the chunk's own causal attention, as a plain cache computes it
                out = F.scaled_dot_product_attention(query, keys, values, is_causal=True, scale=scaling,
                                                     enable_gqa=heads > keys.shape[1])
            else:
                out = self._attend_fused(query, slot_keys, keys, slot_values, values, visible, scaling)
            probs = self._last_query_probs(chunk, slot_keys, keys, visible, scaling) \
                if self.policy.needs_probs == "last" else None
        if probs is not None and used < slots:  # the empty slots received no attention
            probs = torch.cat([probs[..., :used], probs.new_zeros(*probs.shape[:-1], slots - used), probs[..., used:]], -1)

        self._count_reads((visible.any(2) & real[:, None, :, None]).sum(), decode)
        score = self.policy.keep_scores(chunk, probs)
        self._retain(chunk, score, keys, values)
        self.in_use = slots
        self._read_back()
        self._count_held(real)
        return out.view(batch, heads, c, -1)

    def _attend_scores(self, chunk: Chunk, query, slot_keys, keys, slot_values, values, visible, scaling):
        """Attention over gap compression's re-rotated queries and keys, with the probabilities written out
        ([B, Hkv, G, c, used slots + c]) for the policy to read."""
        batch, heads, c, dim = query.shape
        kv_heads, group, read = keys.shape[1], heads // keys.shape[1], slot_keys.shape[2] + c
        if self.inv_freq is not None:
            query, slot_keys, keys = self._compress_positions(chunk, slot_keys, keys)
        if slot_keys.shape[2]:  # one matmul over slots and chunk: concatenating keys is cheaper than scores
            keys, values = torch.cat([slot_keys, keys], 2), torch.cat([slot_values, values], 2)
        scores = query.reshape(batch, kv_heads, group * c, dim) @ keys.transpose(-1, -2)
        dtype = torch.promote_types(scores.dtype, torch.float32)  # softmax in float32 at least (float64 stays)
        scores = scores.to(dtype).mul_(scaling).view(batch, kv_heads, group, c, read)
        scores.masked_fill_(~visible, torch.finfo(dtype).min)
        probs = scores.softmax(-1)
        return probs.to(values.dtype).view(batch, kv_heads, group * c, read) @ values, probs

    @staticmethod
    def _attend_received(chunk: Chunk, query, slot_keys, keys, slot_values, values, visible, scaling):
        """A prefill chunk's attention [B, H, c, D] and what each candidate received from its real queries, mean
        over the query group, [B, Hkv, used slots + c] (H2O): the probabilities written out a block of queries at
        a time (`query_blocks`), each block reading only the candidates its queries can see."""
        batch, heads, c, dim = query.shape
        kv_heads, group, used = keys.shape[1], heads // keys.shape[1], slot_keys.shape[2]
        if used:  # one matmul over slots and chunk: concatenating keys is cheaper than scores
            keys, values = torch.cat([slot_keys, keys], 2), torch.cat([slot_values, values], 2)
        dtype = torch.promote_types(keys.dtype, torch.float32)  # softmax in float32 at least (float64 stays)
        queries = query.view(batch, kv_heads, group, c, dim)
        weights = chunk.real.to(dtype)  # real queries only
        out = query.new_empty(batch, kv_heads, group, c, values.shape[-1])
        received = torch.zeros(batch, kv_heads, used + c, dtype=dtype, device=query.device)
        for a, b, n in query_blocks(visible, used):
            scores = queries[:, :, :, a:b].reshape(batch, kv_heads, group * (b - a), dim) @ keys[:, :, :n].transpose(-1, -2)
            scores = scores.to(dtype).mul_(scaling).view(batch, kv_heads, group, b - a, n)
            scores.masked_fill_(~visible[..., a:b, :n], torch.finfo(dtype).min)
            probs = scores.softmax(-1)
            out[:, :, :, a:b] = (probs.to(values.dtype).view(batch, kv_heads, group * (b - a), n)
                                 @ values[:, :, :n]).view(batch, kv_heads, group, b - a, -1)
            received[..., :n] += (weights[:, None, None, None, a:b] @ probs)[:, :, :, 0].mean(2)
        return out.view(batch, heads, c, -1), received

    def _policy_input(self, chunk: Chunk, probs: torch.Tensor) -> torch.Tensor | None:
        """What the policy's keep_scores reads (`Policy.needs_probs`) from the chunk's probabilities [B, Hkv, G, c, N]:
        the last real query's row, or the attention each candidate received from the real queries, mean over the
        query group (a weighted sum over queries as one matmul, not a [B, Hkv, G, c, N] product)."""
        decode = probs.shape[3] == 1
        if self.policy.needs_probs == "last":
            return probs[:, :, :, 0] if decode else probs[torch.arange(probs.shape[0], device=probs.device), :, :,
                                                               chunk.last_real]
        if self.policy.needs_probs == "received":
            if decode:
                return probs[:, :, :, 0].mean(2) * chunk.real[:, :, None]
            return (chunk.real.to(probs.dtype)[:, None, None, None, :] @ probs)[:, :, :, 0].mean(2)
        return None

    @staticmethod
    def _attend_fused(query, slot_keys, keys, slot_values, values, visible, scaling):
        """The chunk's attention through fused SDPA with a boolean mask, a block of queries at a time
        (`query_blocks`): no score matrix of our own. A query that sees nothing (padding) is let see its own key:
        an all-masked row would give NaN, which would reach the padding tokens' keys and values in the next
        layer, and 0 x NaN the real queries' outputs."""
        batch, heads, c, _ = query.shape
        kv_heads, used = keys.shape[1], slot_keys.shape[2]
        if used:
            keys, values = torch.cat([slot_keys, keys], 2), torch.cat([slot_values, values], 2)
        out = query.new_empty(batch, heads, c, values.shape[-1])
        for a, b, n in query_blocks(visible, used):
            own_key = torch.zeros(b - a, n, dtype=torch.bool, device=query.device)
            own_key[:, used + a:used + b] = torch.eye(b - a, dtype=torch.bool, device=query.device)
            block = visible[..., a:b, :n]
            mask = block | (~block.any(-1, keepdim=True) & own_key)  # [B, Hkv, 1, b - a, n]
            mask = mask.expand(-1, -1, heads // kv_heads, -1, -1).reshape(batch, heads, b - a, n)
            out[:, :, a:b] = F.scaled_dot_product_attention(query[:, :, a:b], keys[:, :, :n], values[:, :, :n],
                                                            attn_mask=mask, scale=scaling, enable_gqa=heads > kv_heads)
        return out

    @staticmethod
    def _last_query_probs(chunk: Chunk, slot_keys, keys, visible, scaling) -> torch.Tensor:
        """[B, Hkv, G, N] the attention of each sequence's last real query of the chunk (what TOVA reads)."""
        rows = torch.arange(keys.shape[0], device=keys.device)
        query = chunk.query[rows, :, :, chunk.last_real]  # [B, Hkv, G, D]
        scores = torch.cat([query @ slot_keys.transpose(-1, -2), query @ keys.transpose(-1, -2)], -1)
        dtype = torch.promote_types(scores.dtype, torch.float32)
        scores = scores.to(dtype).mul_(scaling)
        scores.masked_fill_(~visible[rows, :, :, chunk.last_real], torch.finfo(dtype).min)
        return scores.softmax(-1)

    def _count_reads(self, reads: torch.Tensor, decode: bool) -> None:
        """Keys read by this chunk's real queries; a decode step also counts what a full cache would read."""
        self.query_reads += reads
        if decode:
            self.decode_reads += reads
            self.full_cache_reads += self.real_tokens.sum() * self.keys.shape[1]

    def _count_held(self, real: torch.Tensor) -> None:
        """Add the tokens held after this chunk ([B, Hkv], counted from the slots) once per real token in it
        (memory over time, per KV head)."""
        held = (self.positions >= 0).sum(-1)
        self.held_integral += (held * real.sum(-1, keepdim=True)).sum(0)

    def _compress_positions(self, chunk: Chunk, slot_keys, keys):
        """Query and keys re-rotated from their true positions to the gap-compressed ones."""
        slots = chunk.num_slots
        target = compressed_positions(chunk.cand_pos, chunk.cand_ok)
        delta = torch.where(chunk.cand_ok, target - chunk.cand_pos, torch.zeros_like(target))
        slot_keys = rotate(slot_keys, delta[..., :slot_keys.shape[2]], self.inv_freq)  # the used slots
        new_keys = rotate(keys, delta[..., slots:], self.inv_freq)
        batch, kv_heads, group, c, dim = chunk.query.shape
        query = rotate(chunk.query, delta[:, :, None, slots:].expand(-1, -1, group, -1), self.inv_freq)
        return query.reshape(batch, kv_heads * group, c, dim), slot_keys, new_keys

    # --- eviction ----------------------------------------------------------------------------------------
    def _overflow(self) -> EngineError:
        return EngineError(f"the {self.policy.name} policy must keep more tokens than its {self.slots} slots per KV "
                           f"head hold (budget={self.policy.budget}); raise the budget")

    def _retain(self, chunk: Chunk, score: torch.Tensor, keys, values) -> None:
        slots = self.slots  # the capacity (candidates may cover fewer slots while the cache fills)
        score = score.float().masked_fill(~chunk.cand_ok, NEG)
        dropped = score == NEG
        count = (~dropped).sum(-1)
        keep = torch.where(count > slots, torch.full_like(count, self.policy.evict_to()), count)
        n_evict = count - keep
        most = int(n_evict.max())
        if most:
            lowest = score.masked_fill(dropped, POS).topk(most, dim=-1, largest=False)
            take = torch.arange(most, device=score.device) < n_evict[..., None]
            if bool((lowest.values == POS)[take].any()):
                raise self._overflow()
            dropped |= torch.zeros_like(dropped).scatter_(-1, lowest.indices, take)
            self.capacity_evictions += int(n_evict.sum())
        kept = chunk.cand_ok & ~dropped
        self._commit(chunk, kept, keys, values)

    def _commit(self, chunk: Chunk, kept: torch.Tensor, keys, values) -> None:
        slots = chunk.num_slots
        slot_kept, new_kept = kept[..., :slots], kept[..., slots:]
        self.positions[..., :slots].masked_fill_(~slot_kept, -1)
        for name, t in self.state.items():
            t[..., :slots].copy_(chunk.state[name][..., :slots])
        if bool(new_kept.any()):
            free = (~slot_kept).to(torch.int8)
            if new_kept.shape[-1] == 1:
                dest = free.argmax(-1, keepdim=True)
            else:
                order = free.sort(dim=-1, descending=True, stable=True).indices
                dest = order.gather(-1, (new_kept.long().cumsum(-1) - 1).clamp(min=0))
            b, h, j = new_kept.nonzero(as_tuple=True)
            s = dest[b, h, j]
            self.keys[b, h, s] = keys[b, h, j]
            self.values[b, h, s] = values[b, h, j]
            self.positions[b, h, s] = chunk.cand_pos[b, h, slots + j]
            for name, t in self.state.items():
                t[b, h, s] = chunk.state[name][b, h, slots + j]
            self._stored(b, h, s, keys[b, h, j])
        held = (self.positions >= 0).sum(-1)
        self.peak = torch.maximum(self.peak, held.max(0).values)

    def _stored(self, b: torch.Tensor, h: torch.Tensor, slot: torch.Tensor, key: torch.Tensor) -> None:
        """Hook: new keys `key` [n, D] were written to (sequence b, KV head h, slot)."""



class QuestLayer(BoundedLayer):
    """Quest: the base layer's storage (it evicts nothing) plus element-wise key bounds per page, which a
    decode step uses to read only the pages that promise the largest scores."""

    def __init__(self, policy, chunk_size: int, inv_freq: torch.Tensor | None = None):
        super().__init__(policy, chunk_size, inv_freq)
        self.allocated = self.slots  # whole pages; the decode step stores its token after reading
        self.decodes_in_place = True  # its own sparse decode step, also with gap compression

    def lazy_initialization(self, key_states, value_states):
        super().lazy_initialization(key_states, value_states)
        batch, kv_heads, _, dim = key_states.shape
        pages = (batch, kv_heads, self.slots // self.policy.page_size, dim)
        self.key_min = key_states.new_full(pages, POS)
        self.key_max = key_states.new_full(pages, NEG)

    def _select_batch(self, index: torch.Tensor) -> None:
        super()._select_batch(index)
        if self.is_initialized:
            index = index.to(self.device)
            self.key_min, self.key_max = self.key_min.index_select(0, index), self.key_max.index_select(0, index)

    def _stored_tensors(self) -> list[torch.Tensor]:
        return super()._stored_tensors() + [self.key_min, self.key_max]

    def _decode(self, query, keys, values, positions, real, gate, scaling, stored):
        chunk = self._chunk(query, positions, real, gate)
        out = self._sparse_decode(chunk, keys, values, scaling)
        self._retain_one(chunk, self.policy.keep_scores(chunk, None), keys, values)
        self.in_use = chunk.num_slots
        self._count_held(real)
        return out

    def _sparse_decode(self, chunk: Chunk, keys, values, scaling) -> torch.Tensor:
        """Quest's decode step: each query head gathers and reads only its chosen pages (and the new key)."""
        batch, kv_heads, group, _, dim = chunk.query.shape
        page = self.policy.page_size
        query = chunk.query[:, :, :, 0]  # [B, Hkv, G, D]
        occupied = (self.positions >= 0).view(batch, kv_heads, -1, page).any(-1)
        top = self.policy.top_pages(query, self.key_min, self.key_max, occupied)  # [B, Hkv, G, k]
        tokens = (top[..., None] * page + torch.arange(page, device=top.device)).flatten(-2)  # [B, Hkv, G, k*page]
        at = tokens[..., None].expand(-1, -1, -1, -1, dim)
        picked_keys = self.keys[:, :, None].expand(-1, -1, group, -1, -1).gather(3, at)
        picked_values = self.values[:, :, None].expand(-1, -1, group, -1, -1).gather(3, at)
        ok = self.positions[:, :, None].expand(-1, -1, group, -1).gather(3, tokens) >= 0
        dtype = torch.promote_types(query.dtype, torch.float32)
        scores = torch.cat([(picked_keys @ query[..., None])[..., 0], (query * keys[:, :, None, 0]).sum(-1, keepdim=True)], -1)
        scores = scores.to(dtype) * scaling
        scores[..., :-1].masked_fill_(~ok, torch.finfo(dtype).min)
        probs = scores.softmax(-1).to(values.dtype)
        out = (probs[..., None, :-1] @ picked_values)[..., 0, :] + probs[..., -1:] * values[:, :, None, 0]

        read_pages = torch.zeros_like(occupied).scatter_(-1, top.flatten(2), True)  # union over the query group
        read = read_pages.repeat_interleave(page, -1) & (self.positions >= 0)
        self._count_reads(read.sum() + chunk.cand_ok[..., -1].sum(), decode=True)
        return out.reshape(batch, kv_heads * group, 1, -1)

    def _retain_one(self, chunk: Chunk, score: torch.Tensor, keys, values) -> None:
        """Store the decode step's token: at most one eviction. The lowest-scoring candidate makes room:
        an empty or dropped slot if there is one, else the weakest token (the new one included)."""
        slots = chunk.num_slots
        score = score.masked_fill(~chunk.cand_ok, NEG)
        self.positions[..., :slots].masked_fill_(score[..., :slots] == NEG, -1)  # free slots the policy dropped
        lowest, victim = score.min(-1)
        if bool(torch.isposinf(lowest).any()):
            raise self._overflow()
        self.capacity_evictions += torch.isfinite(lowest).sum()
        write = (victim < slots) & chunk.cand_ok[..., slots]  # the new token stays (in the victim's slot)
        index = victim.clamp(max=slots - 1)[..., None]
        for name, t in self.state.items():
            t[..., :slots].copy_(chunk.state[name][..., :slots])
        tensors = [(self.positions, chunk.cand_pos[..., slots:]), (self.keys, keys), (self.values, values)]
        tensors += [(self.state[name], chunk.state[name][..., slots:]) for name in self.state]
        for stored, new in tensors:
            at = index if stored.dim() == 3 else index[..., None].expand(-1, -1, -1, stored.shape[-1])
            keep_new = write[..., None] if stored.dim() == 3 else write[..., None, None]
            stored.scatter_(2, at, torch.where(keep_new, new, stored.gather(2, at)))
        b, h = write.nonzero(as_tuple=True)
        self._update_page_bounds(b, h, index[b, h, 0] // self.policy.page_size, keys[b, h, 0])
        self.peak = torch.maximum(self.peak, (self.positions >= 0).sum(-1).max(0).values)

    def _stored(self, b, h, slot, key) -> None:
        self._update_page_bounds(b, h, slot // self.policy.page_size, key)

    def _update_page_bounds(self, b, h, page, key) -> None:
        _, kv_heads, pages, dim = self.key_min.shape
        flat = ((b * kv_heads + h) * pages + page)[:, None].expand(-1, dim)
        self.key_min.view(-1, dim).scatter_reduce_(0, flat, key, "amin")
        self.key_max.view(-1, dim).scatter_reduce_(0, flat, key, "amax")
