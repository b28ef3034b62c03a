"""Self-generated training text: the teacher answers prompts and its own outputs become the data.

This is how the DMS paper retrofitted Llama-3.2-1B (the model's own distribution, so distillation does
not fight a domain shift). Generation is batched with left padding and a progress bar; the result is a
`datasets` folder (prompt, completion) that `data.source=traces data.path=...` reads and later runs reuse.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import datasets
import torch
from tqdm import tqdm

from data.sources import DataError


@torch.no_grad()
def generate_traces(model, tokenizer, prompts: list[str], out_dir: str | Path, max_new_tokens: int = 256,
                    batch_size: int = 8, overwrite: bool = False) -> datasets.Dataset:
    """Greedy answers to `prompts` with the model's chat template, saved to out_dir (reused if present)."""
    out_dir = Path(out_dir)
    if out_dir.is_dir() and not overwrite:
        return datasets.load_from_disk(str(out_dir))
    if not prompts:
        raise DataError("no prompts to generate traces from")
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"tokenizer {tokenizer.name_or_path!r} has no chat template to render trace prompts")
    side, tokenizer.padding_side = tokenizer.padding_side, "left"
    rows = []
    try:
        for start in tqdm(range(0, len(prompts), batch_size), desc="traces", unit="batch"):
            batch = prompts[start:start + batch_size]
            chats = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
                     for p in batch]
            enc = tokenizer(chats, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
            out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id)
            for prompt, ids in zip(batch, out[:, enc["input_ids"].shape[1]:]):
                rows.append({"prompt": prompt, "completion": tokenizer.decode(ids, skip_special_tokens=True).strip()})
    finally:
        tokenizer.padding_side = side
    ds = datasets.Dataset.from_list(rows)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    try:
        ds.save_to_disk(str(staging / "ds"))
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(staging / "ds", out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return ds
