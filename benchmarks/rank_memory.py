"""Peak host memory per rank of a full fine-tune, on a random-weight stand-in for the 7B recipe's shape.

The stand-in keeps DeepSeek-R1-Distill-Qwen-7B's family and proportions (Qwen2, GQA 7:1, MLP 5.3x
hidden, untied embeddings) at a width and depth this machine holds twice over. The vocabulary is the
tokenizer's (49152, as the rows are real SmolLM2 tokens), so the embeddings are 27 % of the stand-in's
321M parameters (1.28 GB in float32) against 14 % of the 7B's. Each configuration is
launched as the recipe would be (torchrun, 2 processes over gloo, one optimizer step of 64-token rows)
and every rank prints its peak resident memory (ru_maxrss: weights, teacher, DeepSpeed buffers, Python) when
training starts (models loaded, strategy and optimizer set up), after the first step (memory-mapped weights
count once read: a teacher loaded lazily from the checkpoint is read by the first step) and over the whole
run (which adds the snapshot and the checkpoint), so the per-rank cost reads as a multiple of the weights.

    python benchmarks/rank_memory.py [--hidden 896] [--layers 16] [--vocab 49152] [--configs single ddp zero2 zero3]
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
from train.module import RetrofitModule
peaks = {}
def on_train_start(self):  # models loaded, strategy and optimizer set up: the load-time high-water mark
    peaks["at_load_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
def on_train_batch_end(self, *args):  # every weight read once (a memory-mapped one counts when first read)
    peaks.setdefault("first_step_gb", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6)
RetrofitModule.on_train_start = on_train_start
RetrofitModule.on_train_batch_end = on_train_batch_end
code = main(sys.argv[1:])
peaks["whole_run_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
print("RANK_MEMORY " + json.dumps({"rank": int(os.environ.get("RANK", 0)), "code": code, **peaks}), flush=True)
sys.exit(code)
"""


def stand_in(folder: Path, hidden: int, layers: int, vocab: int) -> int:
    """A random Qwen2 with the 7B's proportions, saved like a Hub checkpoint; returns its parameter count."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from models.backbone import embedded_model_dir

    if hidden % 448:
        raise SystemExit(f"--hidden {hidden}: use a multiple of 448 (7 query heads per KV head, head_dim 64)")
    heads = hidden // 64
    config = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=round(hidden * 5.286 / 64) * 64,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads // 7,
                         head_dim=64, max_position_embeddings=4096, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(embedded_model_dir())  # the data's ids must stay below `vocab`
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
    parser.add_argument("--hidden", type=int, default=896)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=49152, help="at least the tokenizer's 49152")
    parser.add_argument("--configs", nargs="+", default=["single", "ddp", "zero2", "zero3"], choices=sorted(CONFIGS))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "stand-in"
        params = stand_in(folder, args.hidden, args.layers, args.vocab)
        weights_gb = params * 4 / 1e9
        print(f"stand-in: Qwen2, hidden {args.hidden}, {args.layers} layers, vocabulary {args.vocab}, "
              f"{params / 1e6:.0f}M parameters, "
              f"{weights_gb:.2f} GB in float32")
        for config in args.configs:
            ranks = launch(folder, Path(tmp), config, 1 if config == "single" else 2)
            for r in ranks:
                print(f"{config:>6} rank {r['rank']}: peak host memory at load {r['at_load_gb']:.2f} GB "
                      f"({r['at_load_gb'] / weights_gb:.2f}x the weights), after the first step {r['first_step_gb']:.2f} GB "
                      f"({r['first_step_gb'] / weights_gb:.2f}x), over the whole run {r['whole_run_gb']:.2f} GB")


if __name__ == "__main__":
    main()
