"""A short identity of a model's base weights, recorded when gates are trained and checked wherever they
are loaded again (snapshots, exported folders), so gates never silently run on other weights."""

from __future__ import annotations

import contextlib
import hashlib

import torch

from models.attention import GATE_ATTRIBUTE


def weights_fingerprint(model: torch.nn.Module, samples: int = 1024) -> str:
    """A short hash of the model's weights: names, shapes and an evenly strided sample of each tensor's
    values rounded to bfloat16 (so a float32 and a bfloat16 load of the same weights agree). It tells two
    models with the same architecture apart at a fraction of a full hash's cost.

    Parameters that DeepSpeed ZeRO-3 partitioned as they loaded are gathered one at a time (a collective:
    every rank calls this), so a partitioned model has the fingerprint of the same model whole."""
    params = dict(model.named_parameters(remove_duplicate=False))
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        if GATE_ATTRIBUTE in name.split("."):
            continue  # gates are not base weights: a gated and a plain model of the same weights agree
        param = params.get(name)  # None for a buffer
        with _whole(param):
            whole = param.detach() if hasattr(param, "ds_id") else tensor.detach()
            flat = whole.reshape(-1)
            sample = flat[:: max(1, flat.numel() // samples)][:samples].to(torch.bfloat16).float().cpu()
            digest.update(f"{name}{tuple(whole.shape)}".encode())
        digest.update(sample.numpy().tobytes())
    return digest.hexdigest()[:16]


def _whole(param):
    """Gathers a ZeRO-3 partitioned parameter for the block; nothing for any other tensor."""
    if not hasattr(param, "ds_id"):
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters([param], modifier_rank=None)
