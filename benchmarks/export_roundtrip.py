"""Export a run's final snapshot (full and gates-only), time it, size it, and load each export the way a
transformers user without RetroKV does; print whether its greedy completion equals the gated model's.

    python benchmarks/export_roundtrip.py outputs/dms_smollm2_cr4 [--out outputs/export_check] [--tokens 48]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import torch

PROMPT = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
          "How many clips did Natalia sell altogether in April and May?")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run")
    parser.add_argument("--out", default=None, help="where the exports go (default: a temporary folder, removed)")
    parser.add_argument("--tokens", type=int, default=48)
    args = parser.parse_args()
    import models
    from checkpoints import export_snapshot, load_snapshot
    from checkpoints.export import folder_size
    from checkpoints.hub import describe, plan_uploads
    from checkpoints.standalone import generate_without_retrokv

    work = Path(args.out or tempfile.mkdtemp(prefix="retrokv-export-"))
    snapshot = Path(args.run) / "snapshots" / "final"
    model, tokenizer, meta = load_snapshot(snapshot)
    models.set_gate_mode(model, "infer")
    text = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, return_tensors="pt").input_ids
    with torch.no_grad():
        gated = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.tokens, do_sample=False)
        with models.gate_mode(model, "off"):
            plain = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.tokens, do_sample=False)
    completion = tokenizer.decode(gated[0, ids.shape[1]:], skip_special_tokens=True)
    print(f"snapshot {snapshot}: {meta.gate_kind}, CR {meta.cr:g}, step {meta.step}, {meta.backbone_mode} backbone")
    print(f"gated completion (in-process, DynamicCache): {completion!r}")
    print(f"ungated completion: {tokenizer.decode(plain[0, ids.shape[1]:], skip_special_tokens=True)!r}")
    try:
        for gates_only in (False, True):
            out = work / ("gates_only" if gates_only else "full")
            start = time.perf_counter()
            export_snapshot(snapshot, out, gates_only=gates_only)
            took = time.perf_counter() - start
            start = time.perf_counter()
            result = generate_without_retrokv(out, ids.tolist(), args.tokens, work / f"{out.name}.logits.pt",
                                              work / "modules")
            loaded = time.perf_counter() - start
            logits = torch.load(work / f"{out.name}.logits.pt")
            with torch.no_grad():
                reference = model(gated).logits
            same = result["tokens"] == gated.tolist()
            print(f"{out.name}: export {took:.1f} s, {folder_size(out) / 1e6:.1f} MB; loaded without RetroKV as "
                  f"{result['class']} and generated in {loaded:.1f} s; greedy tokens equal: {same}; "
                  f"max |logit difference| {float((logits - reference).abs().max()):.2e}")
        print(describe(plan_uploads(work / "full"), "ORG/NAME"))
    finally:
        if args.out is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
