"""Training tokens/s of the gated retrofit step over a plain distillation step, in one process.

Both steps distil SmolLM2 into itself with LoRA adapters trainable (so the plain step has something to
train): teacher pass (adapters off) + student pass + chunked KL + backward. The gated step adds the
gates in training mode and the capacity loss. Steps alternate so drift hits both equally.

    python benchmarks/train_throughput.py [--recipe dms_smollm2_cr4] [--steps 4]
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="dms_smollm2_cr4")
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()

    import models
    from models.gates import GateMode
    from train.config import load_recipe
    from train.losses import chunked_distillation
    from train.module import RetrofitModule, causal_lm_parts

    cfg = load_recipe(args.recipe, ["model.backbone_mode=lora"])
    module = RetrofitModule(cfg)
    module.configure_model()  # what Lightning calls once the device is known; here the CPU
    ids = torch.randint(0, module.model.config.vocab_size, (cfg.data.batch_size, cfg.data.max_length))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
    tokens = ids.numel()

    def plain_step():
        teacher = module.teacher_hidden(batch)
        with models.gate_mode(module.model, GateMode.OFF):
            student = module._hidden(module.model, batch)
        kl, _ = chunked_distillation(causal_lm_parts(module.model)[1], student, teacher, batch["loss_mask"], ids,
                                     cfg.loss.kl_direction, cfg.loss.temperature, cfg.loss.chunk_tokens)
        kl.backward()

    def gated_step():
        module.losses(batch, step=10)["loss"].backward()

    timings = {"plain": [], "gated": []}
    for i in range(args.steps + 1):
        for name, step in (("plain", plain_step), ("gated", gated_step)):
            start = time.perf_counter()
            step()
            module.model.zero_grad(set_to_none=True)
            if i:  # the first round warms up
                timings[name].append(time.perf_counter() - start)
    rate = {name: tokens / min(values) for name, values in timings.items()}
    print(f"{args.recipe}: {cfg.gate.kind} gates, batch {cfg.data.batch_size} x {cfg.data.max_length} tokens, "
          f"LoRA trainable, best of {args.steps}")
    print(f"plain distillation step  {rate['plain']:8.1f} tokens/s")
    print(f"gated retrofit step      {rate['gated']:8.1f} tokens/s")
    print(f"ratio gated / plain      {rate['gated'] / rate['plain']:8.3f}")


if __name__ == "__main__":
    main()
