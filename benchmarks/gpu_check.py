"""The first thing to run on a CUDA machine: do the GPU paths compute what the CPU-tested paths compute?

1. Training attention: a gated forward + backward of a random Qwen2-shaped model (GQA, a left-padded row)
   through the compiled FlexAttention kernel (score_mod + the causal/padding BlockMask) against the SDPA
   float-mask path the CPU tests check against float64 references. DMS (train and infer mode) and TRIM-KV
   (train mode); logits and every gate gradient are compared, and both paths' step times and peak memory
   are printed.
2. The engine on CUDA: greedy decoding through `BoundedCache` with a budget over the sequence against
   transformers' `DynamicCache` (tokens equal, logits close); TOVA and window at a small budget against a
   `DynamicCache` holding as many tokens (the floor), step times synchronised; a decode step under
   `torch.cuda.set_sync_debug_mode("error")`, which raises on any device-to-host wait; TOVA decode steps through
   `torch.compile(model.forward)`, in the default mode and with CUDA graphs ("reduce-overhead"), against eager.
3. Loading: the embedded model straight onto the GPU against on the host then moved, peak host memory of each
   in its own process (what a rank of a multi-GPU run holds while it loads).

Each check prints PASS or FAIL; the script exits 1 if any failed. About 3 minutes on one GPU, most of it
compiling the FlexAttention kernels.

    python benchmarks/gpu_check.py [--seq 1024] [--dtype bfloat16]
    python benchmarks/gpu_check.py --device cpu --seq 96   # the same code on CPU: forward-only smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

FAILED: list[str] = []


def verdict(name: str, ok: bool, detail: str) -> None:
    print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}")
    if not ok:
        FAILED.append(name)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory_mb(device: torch.device) -> float:
    return torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else float("nan")


def gated_model(kind: str, settings: dict, device: torch.device, dtype: torch.dtype):
    """The same random Qwen2 (GQA 4:1) and gates every call; the gates get small random weights so they act."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    import models

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=8192)
    model = Qwen2ForCausalLM(config).to(device=device, dtype=dtype)
    models.attach_gates(model, kind, **settings)
    for name, param in model.named_parameters():
        if "kv_gate" in name:
            param.data.normal_(0, 0.02, generator=torch.Generator(device=param.device).manual_seed(1))
    models.configure_backbone(model, "frozen")
    return model


def attention_step(kind: str, settings: dict, mode: str, backend: str, batch: dict, device, dtype, backward: bool):
    """One gated forward (+ backward) with the given attention backend; returns logits, gate grads, seconds, MB."""
    import models

    os.environ["RETROKV_ATTENTION"] = backend
    model = gated_model(kind, settings, device, dtype)
    models.set_gate_mode(model, mode)
    model.retrokv_state.noise_seed = 3
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(3):  # the first call compiles; the median of the rest is the step time
        model.zero_grad(set_to_none=True)
        synchronize(device)
        start = time.perf_counter()
        with torch.set_grad_enabled(backward):
            logits = model(**batch).logits
            if backward:
                (logits.float().logsumexp(-1) * batch["attention_mask"]).sum().backward()
        synchronize(device)
        times.append(time.perf_counter() - start)
    grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach().float(), grads, sorted(times[1:])[0], peak_memory_mb(device)


def check_training_attention(device, dtype, seq: int, backward: bool) -> None:
    ids = torch.randint(0, 1000, (2, seq), generator=torch.Generator().manual_seed(0)).to(device)
    mask = torch.ones_like(ids)
    mask[1, : seq // 3] = 0  # a left-padded row: whole key blocks of padding, skipped by the BlockMask
    batch = {"input_ids": ids, "attention_mask": mask}
    real = mask.bool()
    tolerance = 2e-2 if dtype != torch.float32 else 2e-4
    dms = {"window": 64, "source": "adapter", "offset": 0.0}  # logits near 0: decisions of both kinds
    cases = [("dms", dms, "train"), ("dms", dms, "infer"),
             ("trimkv", {"budget": seq // 4, "hidden": 32}, "train")]
    for kind, settings, mode in cases:
        grads_needed = backward and mode == "train"
        sdpa = attention_step(kind, settings, mode, "sdpa", batch, device, dtype, grads_needed)
        flex = attention_step(kind, settings, mode, "flex", batch, device, dtype, grads_needed)
        scale = sdpa[0][real].abs().max().item()
        diff = (sdpa[0][real] - flex[0][real]).abs().max().item() / scale
        grad_diff = max(((sdpa[1][n] - flex[1][n]).abs().max() / sdpa[1][n].abs().max().clamp(min=1e-12)).item()
                        for n in sdpa[1]) if grads_needed else 0.0
        verdict(f"flex vs sdpa, {kind} {mode}", diff < tolerance and grad_diff < 10 * tolerance,
                f"logits max rel diff {diff:.2e}, gate grads max rel diff {grad_diff:.2e} (tolerance {tolerance:g}); "
                f"step sdpa {sdpa[2] * 1e3:.1f} ms / flex {flex[2] * 1e3:.1f} ms ({sdpa[2] / flex[2]:.2f}x); "
                f"peak sdpa {sdpa[3]:.0f} MB / flex {flex[3]:.0f} MB")
    os.environ.pop("RETROKV_ATTENTION", None)


@torch.no_grad()
def check_engine(device, dtype, context: int, steps: int = 32) -> None:
    from transformers import AutoTokenizer, DynamicCache

    from eval.engine import BoundedCache
    from models import load_backbone
    from models.backbone import embedded_model_dir

    model, _ = load_backbone("smollm2-135m", dtype=dtype, device=device)
    tokenizer = AutoTokenizer.from_pretrained(embedded_model_dir())
    from data.sources import essay_text

    prompt = tokenizer(essay_text()[: context * 8], return_tensors="pt").input_ids[:, :context].to(device)
    plain = model.generate(prompt, max_new_tokens=steps, do_sample=False, output_logits=True, return_dict_in_generate=True,
                           cache=DynamicCache(config=model.config))
    with BoundedCache(model, policy="full", budget=context + steps) as cache:
        bounded = model.generate(prompt, max_new_tokens=steps, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True, cache=cache)
    same = torch.equal(plain.sequences, bounded.sequences)
    drift = max((a.float() - b.float()).abs().max().item() for a, b in zip(plain.logits, bounded.logits))
    verdict("engine = DynamicCache (budget over the sequence)", same and drift < (1e-2 if dtype != torch.float32 else 1e-3),
            f"tokens equal: {same}, max logit diff {drift:.2e}")

    budget = max(context // 4, 64)

    def decode(cache, ids, forward=model.forward) -> tuple[float, torch.Tensor]:
        """Median decode step time (the later half of the steps: a compiled forward compiles in the first ones)
        and the greedy tokens."""
        token = model(ids, cache=cache).logits[:, -1:].argmax(-1)
        times, tokens = [], []
        for _ in range(steps):
            synchronize(device)
            start = time.perf_counter()
            token = forward(token, cache=cache).logits[:, -1:].argmax(-1)
            synchronize(device)
            times.append(time.perf_counter() - start)
            tokens.append(token)
        later = sorted(times[steps // 2:])
        return later[len(later) // 2], torch.cat(tokens, 1)

    floor, _ = decode(DynamicCache(config=model.config), prompt[:, -budget:])
    eager = {}
    for policy in ("window", "tova"):
        with BoundedCache(model, policy=policy, budget=budget) as cache:
            step, eager[policy] = decode(cache, prompt)
            print(f"     decode step, {policy} budget {budget}: {step * 1e3:.2f} ms = {step / floor:.2f}x the floor "
                  f"(DynamicCache of {budget} tokens, {floor * 1e3:.2f} ms)")
    # decode steps through torch.compile (tested on CPU only), plain and with CUDA graphs: tokens as eager?
    torch._dynamo.config.recompile_limit = 64
    for mode in ("default", "reduce-overhead"):
        forward = torch.compile(model.forward, mode=mode)
        try:
            compiled_floor, _ = decode(DynamicCache(config=model.config), prompt[:, -budget:], forward)
            with BoundedCache(model, policy="tova", budget=budget) as cache:
                step, tokens = decode(cache, prompt, forward)
            verdict(f"compiled TOVA decode ({mode}) = eager", torch.equal(tokens, eager["tova"]),
                    f"{step * 1e3:.2f} ms a step = {step / compiled_floor:.2f}x the compiled floor "
                    f"({compiled_floor * 1e3:.2f} ms); tokens equal: {torch.equal(tokens, eager['tova'])}")
        except Exception as err:  # a failure to compile is a finding, not a crash of the whole check
            verdict(f"compiled TOVA decode ({mode}) = eager", False, f"{type(err).__name__}: {str(err).splitlines()[0]}")
    if device.type == "cuda":
        with BoundedCache(model, policy="tova", budget=budget) as cache:
            token = model(prompt, cache=cache).logits[:, -1:].argmax(-1)
            model(token, cache=cache)  # the first step may allocate
            try:
                torch.cuda.set_sync_debug_mode("error")
                model(token, cache=cache)
                verdict("TOVA decode step without host synchronisation", True, "set_sync_debug_mode('error') stayed quiet")
            except RuntimeError as err:
                verdict("TOVA decode step without host synchronisation", False, str(err).splitlines()[0])
            finally:
                torch.cuda.set_sync_debug_mode(0)


LOAD = """
import json, resource, sys, torch
from models import load_backbone
model, _ = load_backbone("smollm2-135m", dtype=sys.argv[2], device=sys.argv[1])
if sys.argv[3] == "then-move":
    model = model.to("cuda")
print(json.dumps({"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def check_loading(dtype_name: str) -> None:
    peaks = {}
    for how, device in (("straight onto the GPU", "cuda"), ("on the host, then moved", "cpu")):
        done = subprocess.run([sys.executable, "-c", LOAD, device, dtype_name, "then-move" if device == "cpu" else "-"],
                              capture_output=True, text=True)
        if done.returncode:
            verdict(f"load {how}", False, done.stderr[-500:])
            return
        peaks[how] = json.loads(done.stdout.strip().splitlines()[-1])["peak_rss_mb"]
        print(f"     load {how}: peak host memory {peaks[how]:.0f} MB")
    direct, moved = peaks.values()
    print(f"     straight onto the GPU holds {direct / moved:.2f}x the host memory of loading on the host first")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--context", type=int, default=1024)
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run on a GPU machine, or --device cpu for a forward-only smoke run", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype) if device.type == "cuda" else torch.float32
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"{name}, torch {torch.__version__}, {args.dtype if device.type == 'cuda' else 'float32'}")
    # FlexAttention has no CPU backward: on CPU only the forward paths are compared
    check_training_attention(device, dtype, args.seq, backward=device.type == "cuda")
    check_engine(device, dtype, args.context)
    if device.type == "cuda":
        check_loading(args.dtype)
    print("all checks passed" if not FAILED else f"FAILED: {', '.join(FAILED)}")
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
