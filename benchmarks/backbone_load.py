"""The embedded default model: cached load time, peak RSS, and a greedy completion.

    python benchmarks/backbone_load.py
"""

from __future__ import annotations

import resource
import time

import torch


def main() -> None:
    from models import load_backbone
    from models.backbone import embedded_model_dir

    start = time.perf_counter()
    folder = embedded_model_dir()  # dequantizes the GGUF once if this machine has no cache yet
    prepared = time.perf_counter() - start
    start = time.perf_counter()
    model, tokenizer = load_backbone("smollm2-135m")
    load = time.perf_counter() - start
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
                                           tokenize=False, add_generation_prompt=True)
    ids = tokenizer(prompt, return_tensors="pt")
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=32, do_sample=False)
    gen = time.perf_counter() - start
    new = out.shape[1] - ids["input_ids"].shape[1]
    print(f"cache folder        {folder} (first-use preparation {prepared:.2f} s in this run)")
    print(f"load from cache     {load:.2f} s  ({sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters, {model.dtype})")
    print(f"greedy completion   {tokenizer.decode(out[0, ids['input_ids'].shape[1]:], skip_special_tokens=True)!r}")
    print(f"generation          {new} tokens in {gen:.2f} s ({new / gen:.1f} tokens/s, batch 1)")
    print(f"peak RSS            {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB")


if __name__ == "__main__":
    main()
