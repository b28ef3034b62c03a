"""Eviction policies of the bounded-memory engine, each a small class.

A policy sees one chunk of new tokens at a time together with the tokens already in the slots (the
"candidates": slots first, then the chunk) and answers three questions:
  * `visibility`: which candidates each query of the chunk may read beyond the causal rule (None = all);
  * `keep_scores`: after the chunk, how much each candidate is worth keeping (+inf pinned, -inf dropped);
    the engine keeps the highest scores that fit in the slots;
  * `capacity`: how many slots per (sequence, KV head) it needs for a budget.
Per-slot state a policy carries (H2O's accumulated attention, DMS decisions, TRIM-KV retention) is declared
in `state` and moved by the engine together with keys and values.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import torch

from models.gates import dms, trimkv

NEG, POS = float("-inf"), float("inf")


class EngineError(ValueError):
    """A cache setting or a model the engine cannot serve, with the valid alternatives."""


@dataclasses.dataclass
class Chunk:
    """What a policy knows about the current chunk; candidate tensors are [B, Hkv, N].

    Two layouts: a prefill chunk's candidates are the slots followed by the c new tokens (N = slots + c); a
    decode step's new token is already written into a free slot, `new_index`, and the candidates are the
    slots themselves (N = slots, c = 1). `set_new` writes either layout.
    """

    query: torch.Tensor  # [B, Hkv, G, c, D], RoPE applied
    positions: torch.Tensor  # [B, c] true positions of the chunk's tokens
    real: torch.Tensor  # [B, c] False for padding
    gate: torch.Tensor | None  # [B, n, c] gate values of the chunk (DMS logits, TRIM-KV log beta), n = Hkv or 1
    cand_pos: torch.Tensor  # [B, Hkv, N] true position, -1 for an empty slot or padding
    cand_ok: torch.Tensor  # [B, Hkv, N] holds a real token
    state: dict[str, torch.Tensor]  # per-candidate policy state, [B, Hkv, N]
    num_slots: int
    rank_start: torch.Tensor  # [B] real tokens each sequence had before this chunk
    most_held: int  # at most this many candidates of one (sequence, KV head) hold a token: slots in use + chunk
    new_index: torch.Tensor | None = None  # decode layout: [B, Hkv, 1] the slot holding the new token
    latest: torch.Tensor | None = None  # [B, 1, 1] `now`, when the engine has it already (a decode step)
    past_sinks: bool = False  # every sequence is past its first `Policy.sink_count` real tokens: no new sink

    @property
    def size(self) -> int:
        return self.positions.shape[1]

    def distance(self) -> torch.Tensor:
        """[B, Hkv, c, N] t - i from each query to each candidate."""
        return self.positions[:, None, :, None] - self.cand_pos[:, :, None, :]

    def set_new(self, name: str, values: torch.Tensor | float) -> None:
        """Write the chunk's tokens' state `name` ([B, Hkv or 1, c], or one value for all) into its candidate
        positions (in place)."""
        state = self.state[name]
        if self.new_index is None:
            state[..., self.num_slots:] = values
        elif isinstance(values, torch.Tensor):
            state.scatter_(-1, self.new_index, values.to(state.dtype).expand(self.new_index.shape))
        else:
            state.scatter_(-1, self.new_index, values)

    @property
    def rank(self) -> torch.Tensor:
        """[B, c] index of each chunk token among its sequence's real tokens (padding excluded)."""
        return self.rank_start[:, None] + self.real.long().cumsum(-1) - 1

    def sinks(self, count: int) -> torch.Tensor:
        """[B, 1, c] True for the chunk's tokens that are among their sequence's first `count` real tokens."""
        rank = self.rank_start[:, None] if self.size == 1 else self.rank  # (padding's rank is masked out below)
        return ((rank < count) & self.real)[:, None]

    @property
    def last_real(self) -> torch.Tensor:
        """[B] index in the chunk of each sequence's last real token (0 for a row that is all padding)."""
        index = torch.arange(self.size, device=self.real.device).expand_as(self.real)
        return torch.where(self.real, index, torch.zeros_like(index)).max(-1).values

    @property
    def now(self) -> torch.Tensor:
        """[B, 1, 1] position of the chunk's last token (rows that are all padding get -1)."""
        if self.latest is not None:
            return self.latest
        pos = torch.where(self.real, self.positions, -1)
        return pos[:, :, None] if self.size == 1 else pos.max(-1).values[:, None, None]


class Policy:
    """Base: no per-query restriction, nothing learned, slots = budget."""

    name = "policy"
    # keep_scores reads attention probabilities: False (none), "last" (the last real query's, [B, Hkv, G, N]) or
    # "received" (what each candidate received from the chunk's real queries, mean over the group, [B, Hkv, N]);
    # with False or "last" a prefill chunk attends through fused SDPA
    needs_probs: bool | str = False
    gate_kind: str | None = None  # the model's gates this policy reads ("dms" | "trimkv"), if any
    can_overflow = False  # pins (+inf) more tokens than fit; only Full may: the others' pins are bounded in bind
    drops = False  # keep_scores may give -inf: a token the policy itself drops (DMS's expired keys)
    # each query reads exactly the candidates keep_scores would keep at its step (TRIM-KV's top budget): a decode
    # step then scores first and reads every candidate but the one it evicts, with no visibility of its own
    # (such a policy drops nothing: its victim is the lowest keep score among the candidates)
    reads_what_it_keeps = False
    sink_count = 0  # a sequence's first real tokens that the policy pins (the gated model's sinks)
    state: ClassVar[dict[str, tuple[torch.dtype, float]]] = {}  # per-slot state: name -> (dtype, empty value)

    def bind(self, model, budget: int) -> None:
        """Check the budget (and the model, for learned policies) before anything is allocated."""
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
            raise EngineError(f"budget={budget!r} is invalid; it must be an integer >= 1 (tokens per KV head)")
        self.budget = budget

    def capacity(self) -> int:
        return self.budget

    def evict_to(self) -> int:
        """How many tokens stay when the slots overflow (below capacity for a burst buffer)."""
        return self.capacity()

    def candidate_state(self, chunk: Chunk) -> None:
        """A gated policy's state for the chunk's tokens, every entry of it (`Chunk.set_new`), and its update
        of the slots' state. Policies without gates never run it: their new tokens get the empty values."""

    def visibility(self, chunk: Chunk) -> torch.Tensor | None:
        return None

    def keep_scores(self, chunk: Chunk, probs: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if k != "budget")
        return f"{type(self).__name__}({fields})"


class Full(Policy):
    """No eviction: the topline. The budget is the number of slots and must cover the whole sequence."""

    name = "full"
    can_overflow = True

    def keep_scores(self, chunk, probs):
        return torch.full(chunk.cand_pos.shape, POS, device=chunk.cand_pos.device)


class Window(Policy):
    """The last `budget` tokens."""

    name = "window"

    def keep_scores(self, chunk, probs):
        return chunk.cand_pos.float()


class Sink(Policy):
    """StreamingLLM: the first `sinks` tokens pinned, the rest of the budget a window of the most recent."""

    name = "sink"

    def __init__(self, sinks: int = 4):
        self.sinks = sinks

    def bind(self, model, budget):
        super().bind(model, budget)
        if not 0 <= self.sinks < budget:
            raise EngineError(f"sink policy: sinks={self.sinks} must be >= 0 and below budget={budget}")

    def keep_scores(self, chunk, probs):
        # (empty slots score as sinks here; the engine never keeps a candidate that holds no token)
        return chunk.cand_pos.float().masked_fill(chunk.cand_pos < self.sinks, POS)


class H2O(Policy):
    """Heavy hitters: half the budget the most recent tokens, half the highest cumulative attention, per KV head."""

    name = "h2o"
    needs_probs = "received"
    state: ClassVar = {"acc": (torch.float32, 0.0)}

    def __init__(self, recent_fraction: float = 0.5):
        self.recent_fraction = recent_fraction

    def bind(self, model, budget):
        super().bind(model, budget)
        if not 0.0 <= self.recent_fraction <= 1.0:
            raise EngineError(f"h2o recent_fraction={self.recent_fraction} must be within [0, 1]")
        self.recent = max(1, round(budget * self.recent_fraction)) if self.recent_fraction else 0

    def keep_scores(self, chunk, probs):
        # probs [B, Hkv, N]: attention each candidate received from the chunk's real queries, mean over the group
        chunk.state["acc"] = chunk.state["acc"] + probs
        recent = chunk.cand_pos > chunk.now - self.recent
        return torch.where(recent & chunk.cand_ok, POS, chunk.state["acc"])


class TOVA(Policy):
    """Token Omission Via Attention: drop the tokens the last query attends to least.

    Layer-wise by default (the mean over all query heads, so every KV head evicts the same token); head-wise
    averages over each KV head's query group only.
    """

    name = "tova"
    needs_probs = "last"

    def __init__(self, head_wise: bool = False):
        self.head_wise = head_wise

    def keep_scores(self, chunk, probs):
        # probs [B, Hkv, G, N]: the attention of each sequence's last real query
        return probs.mean(2) if self.head_wise else probs.mean((1, 2))[:, None].expand(-1, probs.shape[1], -1)


class DMS(Policy):
    """The gated model's own hard DMS decisions (models.gates.dms): a key marked for eviction (by the next
    token's gate, the one-token shift) stays readable for `window` more steps and then frees its slot.

    Slots = budget + window. The budget is the memory cap the run reports against, not a rule: if the model
    keeps more tokens than fit, the engine evicts the most eviction-prone ones outside the window and counts
    them in `stats().capacity_evictions`. The model's `sinks` first tokens are never evicted.

    One float per slot says everything about its key: the decision logit (evicted iff positive), NaN while
    the token that decides it has not come yet, -inf for a sink (never evicted, kept first when slots
    overflow). A single state tensor keeps a decode step's bookkeeping to a few small ops.
    """

    name = "dms"
    gate_kind = "dms"
    drops = True
    state: ClassVar = {"logit": (torch.float32, math.nan)}

    def bind(self, model, budget):
        super().bind(model, budget)
        settings = _gate_settings(model, "dms")
        self.window, self.sink_count = settings.window, _sinks_within("dms", settings, budget)

    def capacity(self):
        return self.budget + self.window

    def candidate_state(self, chunk):
        logit = chunk.state["logit"]
        # the first token of this chunk decides the key still pending: the last key of the previous forward (the
        # chunk's own tokens look pending too here, and so may the decode layout's new slot with what its last
        # occupant left, or an empty slot; the first two are overwritten just below, the last is never read)
        logit.copy_(torch.where(logit.isnan() & chunk.real[:, None, :1], chunk.gate[..., :1], logit))
        # inside the chunk key j is decided by token j + 1; the last waits for the next forward (a decode step's
        # single token decides nothing of its own)
        new = dms.shift(chunk.gate, math.nan) if chunk.size > 1 else math.nan
        if not chunk.past_sinks:
            new = torch.where(chunk.sinks(self.sink_count), NEG, new)
        chunk.set_new("logit", new)

    def visibility(self, chunk):
        return dms.hard_visible(dms.evicts(chunk.state["logit"]), chunk.distance(), self.window)[:, :, None]

    def keep_scores(self, chunk, probs):
        # still inside the window at the next step (age <= window): kept. Outside it the most eviction-prone go
        # first when slots overflow (-logit: an undecided key, only possible with window 0, ranks as logit 0; a
        # sink's -inf logit ranks it first to stay), and a marked key (logit > 0, so -logit < 0) has expired
        logit = chunk.state["logit"]
        in_window = chunk.cand_pos > chunk.now - self.window
        score = torch.where(in_window, POS, logit.nan_to_num(0.0).neg_())
        return score.masked_fill_(score < 0, NEG)


class TrimKV(Policy):
    """TRIM-KV (models.gates.trimkv): per KV head, the `budget` tokens with the highest retention score
    log beta_i * (t - i).

    Each query reads the top-budget candidates at its own step; after the chunk the top-budget at the last
    step stay. With `burst` > 0 the slots take `burst` more tokens before one batched eviction back to the
    budget, and queries read every stored token.
    """

    name = "trimkv"
    gate_kind = "trimkv"
    reads_what_it_keeps = True
    state: ClassVar = {"log_beta": (torch.float32, 0.0), "sink": (torch.bool, False)}

    def __init__(self, burst: int = 0):
        self.burst = burst

    def bind(self, model, budget):
        super().bind(model, budget)
        self.sink_count = _sinks_within("trimkv", _gate_settings(model, "trimkv"), budget)
        if self.burst < 0:
            raise EngineError(f"trimkv burst={self.burst} is invalid; it must be >= 0")

    def capacity(self):
        return self.budget + self.burst

    def candidate_state(self, chunk):
        chunk.set_new("log_beta", chunk.gate)
        # past the sinks a decode step leaves the new slot's flag as it is: False, as in every empty slot, since
        # sinks are never evicted (they score +inf and fit in the budget)
        if not (chunk.past_sinks and chunk.new_index is not None):
            chunk.set_new("sink", False if chunk.past_sinks else chunk.sinks(self.sink_count))

    def visibility(self, chunk):
        if self.burst or chunk.most_held <= self.budget:  # (no query can see more than its budget: all stay)
            return None
        distance = chunk.distance()
        valid = (distance >= 0) & chunk.cand_ok[:, :, None, :]
        keep = trimkv.topk_visible(chunk.state["log_beta"], valid, distance, self.budget, pinned=chunk.state["sink"])
        return keep[:, :, None]

    def keep_scores(self, chunk, probs):
        # trimkv.retention_score at the chunk's last step, which no held candidate comes after (a row that is all
        # padding, now -1, adds nothing and so evicts nothing, whatever its scores)
        score = (chunk.now - chunk.cand_pos) * chunk.state["log_beta"]
        return score.masked_fill_(chunk.state["sink"], POS)

    def evict_to(self):
        return self.budget


class Quest(Full):
    """Quest (query-aware page selection): keeps every token, but each decode query head reads only the
    `budget // page_size` pages whose key bounds promise the largest score (plus the newest page).

    It saves reads, not memory: slots = `max_length`. Prefill chunks read everything.
    """

    name = "quest"

    def __init__(self, max_length: int | None = None, page_size: int = 16):
        self.max_length = max_length
        self.page_size = page_size

    def bind(self, model, budget):
        super().bind(model, budget)
        if self.page_size < 1:
            raise EngineError(f"quest page_size={self.page_size} is invalid; it must be >= 1")
        if budget < self.page_size:
            raise EngineError(f"quest budget={budget} is below one page ({self.page_size} tokens)")
        self.max_length = self.max_length or model.config.max_position_embeddings
        self.max_length = math.ceil(self.max_length / self.page_size) * self.page_size
        self.pages = budget // self.page_size

    def capacity(self):
        return self.max_length

    def top_pages(self, query: torch.Tensor, key_min: torch.Tensor, key_max: torch.Tensor,
                  page_ok: torch.Tensor) -> torch.Tensor:
        """[B, Hkv, G, k] the pages each query head reads: the newest page, then the best by key bound.

        query [B, Hkv, G, D]; key_min/key_max [B, Hkv, pages, D]: element-wise key bounds per page. An upper
        bound of q.k over a page is sum_d max(q_d * min_d, q_d * max_d).
        """
        q = query[:, :, :, None, :]
        bound = torch.maximum(q * key_min[:, :, None], q * key_max[:, :, None]).sum(-1)
        bound = bound.masked_fill(~page_ok[:, :, None], NEG)
        newest = page_ok.long().cumsum(-1).argmax(-1, keepdim=True)  # last page holding a token
        bound.scatter_(-1, newest[:, :, None].expand(-1, -1, bound.shape[2], -1), POS)
        return bound.topk(min(self.pages, bound.shape[-1]), dim=-1).indices


POLICIES: dict[str, type[Policy]] = {cls.name: cls for cls in (Full, Window, Sink, H2O, TOVA, DMS, TrimKV, Quest)}


def make_policy(policy: str | Policy) -> Policy:
    if isinstance(policy, Policy):
        return policy
    if policy not in POLICIES:
        raise EngineError(f"unknown policy {policy!r}; valid: {sorted(POLICIES)}")
    return POLICIES[policy]()


def _gate_settings(model, kind: str):
    """The typed settings of the model's gates, which must be of `kind`."""
    from models import GateError, gate_settings

    try:
        have, settings = gate_settings(model)
    except GateError:
        have, settings = "no gates", None
    if have != kind:
        raise EngineError(f"the {kind} policy needs a model with {kind} gates (models.attach_gates or a "
                          f"checkpoint snapshot); this model has {have}")
    return settings


def _sinks_within(kind: str, settings, budget: int) -> int:
    """The model's sink count, which must leave room in the budget (sinks are kept inside it)."""
    if settings.sinks >= budget:
        raise EngineError(f"{kind} budget={budget} does not exceed the model's {settings.sinks} sinks; "
                          f"valid: budget >= {settings.sinks + 1}")
    return settings.sinks
