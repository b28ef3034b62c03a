"""Count the calls that make a CUDA device wait for the host: a tensor read back as a Python value.

On CPU nothing waits, but the same calls would; counting them here keeps the decode path free of them, so
that it can be captured by torch.compile / CUDA graphs on a GPU. `torch.cuda.set_sync_debug_mode` is the
device-side check.
"""

from __future__ import annotations

import contextlib

import torch

_READBACKS = ("__bool__", "__int__", "__float__", "__index__", "item", "tolist", "nonzero")


@contextlib.contextmanager
def count_host_syncs():
    """Within the block, count tensor-to-Python readbacks; yields a dict whose "count" grows."""
    counter = {"count": 0}
    originals = {name: getattr(torch.Tensor, name) for name in _READBACKS}

    def counted(original):
        def call(*args, **kwargs):
            counter["count"] += 1
            return original(*args, **kwargs)
        return call

    for name, original in originals.items():
        setattr(torch.Tensor, name, counted(original))
    try:
        yield counter
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
