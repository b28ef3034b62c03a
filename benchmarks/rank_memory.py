"""Peak host memory per rank of a full fine-tune, on a random-weight stand-in for the 7B recipe's shape.

The stand-in keeps DeepSeek-R1-Distill-Qwen-7B's family and proportions (Qwen2, GQA 7:1, vocabulary
152064, MLP 5.3x hidden) at a width and depth this machine holds twice over. Each configuration is
launched as the recipe would be (torchrun, 2 processes over gloo, one optimizer step of 64-token rows)
and every rank prints its peak resident memory (ru_maxrss: weights, teacher, DeepSpeed buffers, Python),
next to the model's size, so the per-rank cost reads as a multiple of the weights.

    python benchmarks/rank_memory.py [--hidden 448] [--layers 8] [--configs single ddp zero2 zero3]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

CONFIGS = {
    "single": ["strategy.name=single"],
    "ddp": ["strategy.name=ddp"],
    "zero2": ["strategy.name=deepspeed", "strategy.zero_stage=2"],
    "zero3": ["strategy.name=deepspeed", "strategy.zero_stage=3"],
}

RANK_WRAPPER = """
import json, os, resource, sys
from train.__main__ import main
code = main(sys.argv[1:])
print("RANK_MEMORY " + json.dumps({"rank": int(os.environ.get("RANK", 0)), "code": code,
      "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6}), flush=True)
sys.exit(code)
"""


def stand_in(folder: Path, hidden: int, layers: int) -> int:
    """A random Qwen2 with the 7B's proportions, saved like a Hub checkpoint; returns its parameter count."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from models.backbone import embedded_model_dir

    if hidden % 448:
        raise SystemExit(f"--hidden {hidden}: use a multiple of 448 (7 query heads per KV head, head_dim 64)")
    heads = hidden // 64
    config = Qwen2Config(vocab_size=152064, hidden_size=hidden, intermediate_size=round(hidden * 5.286 / 64) * 64,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads // 7,
                         head_dim=64, max_position_embeddings=4096, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(embedded_model_dir())  # any tokenizer: the ids stay below 49152
    tokenizer.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def launch(folder: Path, out: Path, config: str, processes: int) -> list[dict]:
    overrides = [f"model.backbone={folder}", "model.backbone_mode=full", "gate.dms.source=query_neuron",
                 "trainer.accelerator=cpu", f"trainer.devices={processes}", "trainer.max_steps=1", "data.max_length=64",
                 "data.train_samples=8", "data.eval_samples=0", "trainer.enable_progress_bar=false",
                 f"output_dir={out / config}", *CONFIGS[config]]
    wrapper = out / "rank_wrapper.py"
    wrapper.write_text(RANK_WRAPPER)
    command = [sys.executable, str(wrapper), *overrides] if processes == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(processes), str(wrapper), *overrides]
    done = subprocess.run(command, capture_output=True, text=True)
    ranks = [json.loads(line.split(" ", 1)[1]) for line in done.stdout.splitlines() if line.startswith("RANK_MEMORY ")]
    if done.returncode or len(ranks) != processes:
        raise SystemExit(f"{config} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return sorted(ranks, key=lambda r: r["rank"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=448)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--configs", nargs="+", default=["single", "ddp", "zero2", "zero3"], choices=sorted(CONFIGS))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "stand-in"
        params = stand_in(folder, args.hidden, args.layers)
        weights_gb = params * 4 / 1e9
        print(f"stand-in: Qwen2, hidden {args.hidden}, {args.layers} layers, {params / 1e6:.0f}M parameters, "
              f"{weights_gb:.2f} GB in float32")
        for config in args.configs:
            ranks = launch(folder, Path(tmp), config, 1 if config == "single" else 2)
            for r in ranks:
                print(f"{config:>6} rank {r['rank']}: peak host memory {r['peak_rss_gb']:.2f} GB = "
                      f"{r['peak_rss_gb'] / weights_gb:.2f}x the weights")


if __name__ == "__main__":
    main()
