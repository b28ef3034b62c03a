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
from tqdm import tqdm

import models
from checkpoints import SnapshotMeta, list_snapshots, load_snapshot
from data.config import DataConfig
from models.gates import GateMode
from models.metrics import token_kl


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


def run_data(meta: SnapshotMeta) -> tuple[DataConfig, int]:
    """The data config and seed of the run that wrote the snapshot: they name its held-out split."""
    return DataConfig.from_dict(meta.config.get("data", {})), int(meta.config.get("seed", 0))


@torch.no_grad()
def quick_eval(snapshot: str | Path, max_batches: int | None = None, device: str = "cpu",
               dtype: str | None = None) -> dict:
    from assets import cache_root
    from data import RetrofitDataModule

    folder = resolve_snapshot(snapshot)
    model, tokenizer, meta = load_snapshot(folder, dtype=dtype, device=device)
    data_config, seed = run_data(meta)
    kind, settings = models.gate_kind(meta.gate_kind), models.gate_settings(model)[1]
    data = RetrofitDataModule(data_config, tokenizer, seed, cache_root() / "data")
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
        totals["reads_full"] += int(causal) * sum(gate.num_outputs for gate in models.model_gates(model))
        totals["reads_gated"] += kind.kv_reads(outputs, mask, settings)
    n = max(totals["tokens"], 1)
    real_tokens = max(sum(int(b["attention_mask"].sum()) for b in batches), 1)
    result = {
        "snapshot": str(folder),
        "cr_trained": meta.cr,
        "step": meta.step,
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

