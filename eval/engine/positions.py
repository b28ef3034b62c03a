"""TOVA's gap compression: after eviction, large position gaps between kept tokens shrink so a long run
stays inside the positions the model was trained on.

Keys are stored with RoPE at their true positions; RoPE rotations compose (R(a) R(b) = R(a + b)), so a key
is moved to its compressed position by rotating it by the difference, as if it had been stored unrotated.
"""

from __future__ import annotations

import math

import torch

from eval.engine.policies import EngineError

GAP_LIMIT = 10  # gaps up to this many positions stay as they are


def compress_gaps(gaps: torch.Tensor) -> torch.Tensor:
    """A gap g > 10 becomes round(ln(ln(g))) (at least 1); smaller gaps are kept."""
    big = gaps > GAP_LIMIT
    squeezed = torch.log(torch.log(gaps.clamp(min=math.e).double())).round().clamp(min=1).to(gaps.dtype)
    return torch.where(big, squeezed, gaps)


def compressed_positions(positions: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Positions [..., N] (any order, `valid` marks real tokens) with the gaps between kept tokens compressed;
    the oldest kept token keeps its position. Invalid entries get arbitrary values."""
    far = torch.iinfo(positions.dtype).max // 4
    ordered, order = positions.masked_fill(~valid, far).sort(-1)
    gaps = compress_gaps(ordered.diff(dim=-1))
    steps = torch.cat([ordered[..., :1], gaps], -1).cumsum(-1).to(positions.dtype)
    return torch.empty_like(positions).scatter_(-1, order, steps)


def rotate(x: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Apply RoPE for `delta` more positions to x [..., N, D] (delta [..., N]), in the half-split layout."""
    angle = delta[..., None].double() * inv_freq.double()
    cos, sin = torch.cat([angle.cos(), angle.cos()], -1), torch.cat([angle.sin(), angle.sin()], -1)
    half = x.shape[-1] // 2
    rotated_half = torch.cat([-x[..., half:], x[..., :half]], -1)
    return (x.double() * cos + rotated_half.double() * sin).to(x.dtype)


def rotary_frequencies(model) -> torch.Tensor:
    """The model's RoPE inverse frequencies (from its rotary embedding module)."""
    for module in model.modules():
        inv_freq = getattr(module, "inv_freq", None)
        if isinstance(inv_freq, torch.Tensor):
            return inv_freq
    raise EngineError("gap compression needs a RoPE model; no rotary embedding (inv_freq) was found")
