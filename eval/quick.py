"""Quick teacher-forced evaluation of a gate snapshot on its run's held-out split.

Reports, with hard (inference) decisions: KL from the original model, perplexity with and without the
gates, and how many keys each query still attends to (KV reads) against the full causal cache. This is
the model's own masked attention, used to judge the retrofit; memory savings are measured in the
bounded-memory engine, not here.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from omegaconf import OmegaConf
from tqdm import tqdm

import models
from checkpoints import list_snapshots, load_snapshot
from models import masks
from models.gates import GateMode
from train.config import RunConfig
from train.losses import token_kl


def resolve_snapshot(path: str | Path) -> Path:
    """A snapshot folder, or a run folder (its final snapshot, else its highest CR)."""
    path = Path(path)
    if (path / "retrokv.json").is_file():
        return path
    if (path / "snapshots" / "final" / "retrokv.json").is_file():
        return path / "snapshots" / "final"
    family = list_snapshots(path)
    if not family:
        raise FileNotFoundError(f"{path} is neither a snapshot nor a run folder with snapshots/")
    return family[-1][0]


def run_config(meta: dict) -> RunConfig:
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RunConfig), meta["config"]))


def visible_keys(evict_hard: torch.Tensor, attention_mask: torch.Tensor, window: int) -> torch.Tensor:
    """Keys each real query attends to under hard DMS decisions (the attention mask's own rule): [B, n, T]."""
    length = attention_mask.shape[1]
    distance = masks.query_key_distance(length, length, attention_mask.device)
    real = attention_mask.bool()
    valid = (distance >= 0) & real[:, None, None, :] & real[:, None, :, None]
    return (valid & masks.dms_hard_visible(evict_hard.bool(), distance, window)).sum(-1)


@torch.no_grad()
def quick_eval(snapshot: str | Path, max_batches: int | None = None, device: str = "cpu",
               dtype: str | None = None) -> dict:
    from data import RetrofitDataModule
    from models.backbone import cache_root

    folder = resolve_snapshot(snapshot)
    model, tokenizer, meta = load_snapshot(folder, dtype=dtype, device=device)
    cfg = run_config(meta)
    data = RetrofitDataModule(cfg.data, tokenizer, cfg.seed, cache_root() / "data")
    data.setup()
    if not data.eval_set:
        raise ValueError(f"run config of {folder} has no held-out split (data.eval_samples=0)")
    totals = {"kl": 0.0, "nll_full": 0.0, "nll_gated": 0.0, "tokens": 0, "reads_full": 0, "reads_gated": 0}
    batches = list(data.val_dataloader())[:max_batches]
    for batch in tqdm(batches, desc="eval", unit="batch"):
        batch = {k: v.to(device) for k, v in batch.items()}
        mask = batch["attention_mask"]
        with models.gate_mode(model, GateMode.OFF):
            full = model(input_ids=batch["input_ids"], attention_mask=mask, use_cache=False).logits.float()
        with models.gate_mode(model, GateMode.INFER):
            gated = model(input_ids=batch["input_ids"], attention_mask=mask, use_cache=False).logits.float()
            outputs = models.gate_outputs(model)
        real = mask.bool()
        totals["kl"] += float(token_kl(gated[real], full[real], "forward", 1.0).sum())
        target = batch["input_ids"][:, 1:]
        pair = (mask[:, 1:] * mask[:, :-1]).bool()
        for name, logits in (("full", full), ("gated", gated)):
            nll = torch.nn.functional.cross_entropy(logits[:, :-1][pair], target[pair], reduction="sum")
            totals[f"nll_{name}"] += float(nll)
        totals["tokens"] += int(pair.sum())
        causal = (mask.cumsum(-1) * mask).sum()  # sum over real queries of real keys up to them
        per_head = len(outputs) * (outputs[0].get("evict_hard", outputs[0].get("log_beta"))).shape[1]
        totals["reads_full"] += int(causal) * per_head
        if cfg.gate.kind == "dms":
            for out in outputs:
                totals["reads_gated"] += int(visible_keys(out["evict_hard"], mask, cfg.gate.dms.window).sum())
        else:
            budget = cfg.gate.trimkv.budget
            positions = mask.cumsum(-1)
            totals["reads_gated"] += int(positions.clamp(max=budget)[real].sum()) * per_head
    n = max(totals["tokens"], 1)
    real_tokens = max(sum(int(b["attention_mask"].sum()) for b in batches), 1)
    result = {
        "snapshot": str(folder),
        "cr_trained": meta.get("cr"),
        "step": meta.get("step"),
        "kl_full_to_gated": totals["kl"] / real_tokens,
        "ppl_full": math.exp(totals["nll_full"] / n),
        "ppl_gated": math.exp(totals["nll_gated"] / n),
        "kv_reads_full": totals["reads_full"],
        "kv_reads_gated": totals["reads_gated"],
        "kv_read_compression": totals["reads_full"] / max(totals["reads_gated"], 1),
        "eval_tokens": real_tokens,
        "device": str(device),
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
    }
    out_dir = folder / "eval"
    out_dir.mkdir(exist_ok=True)
    (out_dir / "quick.json").write_text(json.dumps(result, indent=2))
    return result

