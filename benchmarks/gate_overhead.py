"""Forward+backward cost of the gated SmolLM2 against the plain model, measured in one invocation.

Each variant runs in its own child process (so peak RSS is its own); the parent prints the ratios.
Backward reaches every layer in all variants: gradients flow to the input embeddings (and, for gated
variants, to the gate parameters, as in a frozen-backbone retrofit).

    python benchmarks/gate_overhead.py [--seq 512] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time


def measure(variant: str, seq: int, repeats: int) -> dict:
    import torch

    import models

    torch.manual_seed(0)
    model, _ = models.load_backbone("smollm2-135m")
    model.requires_grad_(False)
    if variant != "plain":
        models.attach_gates(model, variant, **({"window": 64, "source": "adapter"} if variant == "dms" else {}))
        models.configure_backbone(model, "frozen")
        models.set_gate_mode(model, "train")
    ids = torch.randint(0, model.config.vocab_size, (1, seq))
    embeds = model.get_input_embeddings()(ids).detach().requires_grad_(True)
    times = []
    for i in range(repeats + 1):
        start = time.perf_counter()
        hidden = model.model(inputs_embeds=embeds, attention_mask=torch.ones_like(ids)).last_hidden_state
        hidden.float().pow(2).mean().backward()
        if i:  # the first pass warms up allocators and kernels
            times.append(time.perf_counter() - start)
        embeds.grad = None
        model.zero_grad(set_to_none=True)
    return {"variant": variant, "seconds": min(times), "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant:
        print(json.dumps(measure(args.variant, args.seq, args.repeats)))
        return
    results = {}
    for variant in ("plain", "dms", "trimkv"):
        out = subprocess.run([sys.executable, __file__, "--variant", variant, "--seq", str(args.seq), "--repeats", str(args.repeats)],
                             capture_output=True, text=True, check=True)
        results[variant] = json.loads(out.stdout.strip().splitlines()[-1])
    base = results["plain"]
    print(f"SmolLM2-135M, batch 1, sequence {args.seq}, forward+backward, best of {args.repeats}")
    print(f"{'variant':8} {'seconds':>8} {'ratio':>6} {'peak RSS MB':>12} {'RSS ratio':>9}")
    for name, r in results.items():
        print(f"{name:8} {r['seconds']:8.3f} {r['seconds'] / base['seconds']:6.3f} {r['peak_rss_mb']:12.0f} "
              f"{r['peak_rss_mb'] / base['peak_rss_mb']:9.3f}")


if __name__ == "__main__":
    main()
