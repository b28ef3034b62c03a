"""Decode cost of the bounded-memory engine against transformers' full DynamicCache, in one invocation.

SmolLM2 reads a long essay prompt, then decodes greedily. For every policy and batch size it reports the
median decode step time and its ratio to the full cache and to the floor (a plain `DynamicCache` holding
only `--budget` tokens: what an ideal bounded cache would cost), KV memory allocated and its ratio, the KV
reads saved and the host readbacks per decode step (tensor -> Python value: a GPU stall each); then TOVA's
step time over the window's (the cost of choosing what to evict); then each cache's prefill against the
plain cache's prefill of the same prompt, for a prompt that fits the budget and for the whole context in
chunks of the budget; then, for a KV memory cap, the largest batch each cache fits and its decode tokens/s
(TOVA paper, Table 1 style).

Rows of a batch share one prefilled prompt (the batch-1 cache is repeated), so the CPU benchmark spends
its minutes on decode steps, the thing measured, rather than on identical prefills.

With --compile, every cache's decode steps run through `torch.compile(model.forward)` (the floor's too, and an
eager floor beside it), and only the step table is printed.

    python benchmarks/engine_decode.py [--context 4096] [--decode 128] [--budget 512] [--batches 1 8]
        [--policies window sink h2o tova] [--snapshot outputs/RUN ...]  # adds each run's learned policy
        [--compile]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import AutoTokenizer, DynamicCache

from eval.engine import BoundedCache
from eval.engine.syncs import count_host_syncs

FULL = "full (DynamicCache)"
FLOOR = "floor (DynamicCache)"
EAGER_FLOOR = "floor, eager"  # with --compile: the floor without compilation, what compiling gains
FLOORS = (FLOOR, EAGER_FLOOR)  # decode-only rows: left out of the prefill and throughput tables


def essay_prompt(tokenizer, length: int) -> torch.Tensor:
    from data.sources import essay_text

    ids = tokenizer(essay_text()[: length * 8], return_tensors="pt").input_ids[:, :length]
    if ids.shape[1] < length:
        raise SystemExit(f"the essay text gave only {ids.shape[1]} tokens; lower --context")
    return ids


class Decoder:
    """One cache being measured: prefill one row, repeat it to `batch` rows, then decode a token per call
    (through `torch.compile(model.forward)` with `compiled`: the prefill stays eager)."""

    def __init__(self, model, make_cache, prompt: torch.Tensor, batch: int, compiled: bool = False):
        self.model, self.cache = model, make_cache()
        self.forward = torch.compile(model.forward) if compiled else model.forward
        self.attention = model.config._attn_implementation  # what this cache runs under (shared models switch)
        start = time.perf_counter()
        logits = self.model(prompt, cache=self.cache).logits[:, -1]
        self.prefill_s = time.perf_counter() - start
        self.cache.batch_repeat_interleave(batch)
        self.token = logits.argmax(-1, keepdim=True).repeat_interleave(batch, 0)
        self.batch, self.times = batch, []

    def step(self, timed: bool = True) -> None:
        if self.model.config._attn_implementation != self.attention:
            self.model.set_attn_implementation(self.attention)
        start = time.perf_counter()
        self.token = self.forward(self.token, cache=self.cache).logits[:, -1].argmax(-1, keepdim=True)
        if timed:
            self.times.append(time.perf_counter() - start)

    def result(self) -> dict:
        with count_host_syncs() as syncs:
            for _ in range(2):
                self.step(timed=False)
        step = statistics.median(self.times[2:] if len(self.times) > 4 else self.times)
        result = {"prefill_s": self.prefill_s, "step_s": step, "tokens_per_s": self.batch / step,
                  "syncs": syncs["count"] / 2}
        if isinstance(self.cache, BoundedCache):
            stats = self.cache.stats()
            result["kv_bytes"] = stats.bytes_allocated
            result["read_reduction"] = stats.read_reduction
            result["capacity_evictions"] = stats.capacity_evictions if self.cache.policy.name == "dms" else None
        else:
            result["kv_bytes"] = sum(layer.keys.nbytes + layer.values.nbytes for layer in self.cache.layers)
        return result


@torch.no_grad()
def run_interleaved(specs: dict, batch: int, steps: int, compiled: bool = False) -> dict:
    """Decode `steps` tokens with every cache, one step of each in turn, so that a machine whose speed drifts
    (a shared CPU) slows every cache alike and the ratios hold. specs: name -> (model, make_cache, prompt)."""
    decoders = {name: Decoder(model, make, prompt, batch, compiled and name != EAGER_FLOOR)
                for name, (model, make, prompt) in specs.items()}
    for _ in range(steps):
        for decoder in decoders.values():
            decoder.step()
    return {name: decoder.result() for name, decoder in decoders.items()}


@torch.no_grad()
def prefill_ratios(caches: dict, prompt: torch.Tensor, budget: int, repeats: int) -> None:
    """Prefill time of each cache against the plain cache's prefill of the same prompt, twice: a prompt that fits
    the budget (one chunk), and the whole prompt (chunks of the budget against one plain pass). Caches take
    turns within each repeat; the median over repeats is kept."""
    prompts = {"fits": prompt[:, -budget:], "chunked": prompt}
    times: dict = {}
    for _ in range(repeats):
        for case, ids in prompts.items():
            for name, (net, make) in caches.items():
                if name in FLOORS:  # the plain cache is FULL's; the floor differs only in decode
                    continue
                cache = make()
                start = time.perf_counter()
                net(ids, cache=cache)
                times.setdefault((case, name), []).append(time.perf_counter() - start)
                if isinstance(cache, BoundedCache):
                    cache.close()
    print(f"\nprefill (median of {repeats}), against the plain DynamicCache prefill of the same prompt")
    for case, target in (("fits", 1.2), ("chunked", 1.5)):
        base = statistics.median(times[case, FULL])
        label = f"{prompts[case].shape[1]} tokens" + (" (fits the budget)" if case == "fits" else f" in chunks of {budget}")
        print(f"  {label}: plain {base:.2f} s; target <= {target}x")
        for (c, name), values in times.items():
            if c == case and name != FULL:
                print(f"    {name:<20} {statistics.median(values):6.2f} s  x{statistics.median(values) / base:5.2f}")


@torch.no_grad()
def run(model, make_cache, prompt: torch.Tensor, batch: int, steps: int) -> dict:
    """One cache alone (the throughput table, where each batch size differs)."""
    return run_interleaved({"one": (model, make_cache, prompt)}, batch, steps)["one"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--decode", type=int, default=128)
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--policies", nargs="+", default=["window", "sink", "h2o", "tova"])
    parser.add_argument("--snapshot", action="append", default=[],
                        help="a trained run or snapshot: adds its learned policy (dms or trimkv); repeatable")
    parser.add_argument("--memory-cap-mb", type=float, help="KV memory cap for the throughput table "
                        "(default: what two full-cache sequences need)")
    parser.add_argument("--cap-steps", type=int, default=16, help="decode steps timed per throughput row")
    parser.add_argument("--prefill-repeats", type=int, default=2, help="timed prefills per cache and prompt")
    parser.add_argument("--compile", action="store_true", help="decode steps of the step table through "
                        "torch.compile(model.forward), every cache's (full and floor too); the first two steps of "
                        "each compile and are not counted; an eager floor row shows what compiling gains. The "
                        "prefill and throughput tables, which are eager, are left out")
    args = parser.parse_args()
    if args.compile:
        torch._dynamo.config.recompile_limit = 64  # two graphs per cache, all under one forward's code object

    from models import load_backbone
    from models.backbone import embedded_model_dir

    torch.manual_seed(0)
    model, _ = load_backbone("smollm2-135m")
    tokenizer = AutoTokenizer.from_pretrained(embedded_model_dir())
    prompt = essay_prompt(tokenizer, args.context)
    total = args.context + args.decode
    if total > model.config.max_position_embeddings:
        raise SystemExit(f"--context + --decode = {total} exceeds the model's {model.config.max_position_embeddings}")

    def plain():
        model.set_attn_implementation("sdpa")
        return DynamicCache(config=model.config)

    caches = {FULL: (model, plain), FLOOR: (model, plain)}
    prompts = {FULL: prompt, FLOOR: prompt[:, -args.budget:]}  # the floor holds as many tokens as the budget
    if args.compile:
        caches[EAGER_FLOOR], prompts[EAGER_FLOOR] = caches[FLOOR], prompts[FLOOR]
    for name in args.policies:
        caches[name] = (model, lambda name=name: BoundedCache(model, policy=name, budget=args.budget))
    for snapshot in args.snapshot:
        from checkpoints import load_snapshot
        from eval.quick import resolve_snapshot

        learned, _, meta = load_snapshot(resolve_snapshot(snapshot))
        kind = meta.gate_kind
        caches[kind] = (learned, lambda learned=learned, kind=kind: BoundedCache(learned, policy=kind, budget=args.budget))

    print(f"SmolLM2-135M, context {args.context}, decode {args.decode}, budget {args.budget}, "
          f"{torch.get_num_threads()} threads" + (", decode steps compiled" if args.compile else ""))
    rows = {}
    for batch in args.batches:
        specs = {name: (net, make, prompts.get(name, prompt)) for name, (net, make) in caches.items()}
        results = run_interleaved(specs, batch, args.decode, args.compile)
        full, floor = results[FULL], results[FLOOR]
        for name, result in results.items():
            rows[name, batch] = result
            print(f"batch {batch:>2} {name:<20} step {1000 * result['step_s']:8.1f} ms  "
                  f"x{result['step_s'] / full['step_s']:5.2f} of full  x{result['step_s'] / floor['step_s']:5.2f} of floor  "
                  f"readbacks/step {result['syncs']:4.0f}  KV {result['kv_bytes'] / 2**20:8.1f} MiB  "
                  f"x{result['kv_bytes'] / full['kv_bytes']:6.3f}  reads /{result.get('read_reduction', 1.0):5.2f}  "
                  f"prefill {result['prefill_s']:6.1f} s"
                  + (f"  capacity evictions {result['capacity_evictions']}" if result.get("capacity_evictions") is not None else ""),
                  flush=True)
    print("targets: decode step <= 1.10x of floor (training-free), <= 1.15x (learned); KV memory <= 1/8 of full "
          "(+ window for DMS)")
    for batch in args.batches:
        if ("tova", batch) in rows and ("window", batch) in rows:
            ratio = rows["tova", batch]["step_s"] / rows["window", batch]["step_s"]
            print(f"TOVA / window step time, batch {batch}: {ratio:.3f} (target <= 1.2)")

    if args.compile:
        return
    prefill_ratios(caches, prompt, args.budget, args.prefill_repeats)

    first = args.batches[0]
    cap = args.memory_cap_mb * 2**20 if args.memory_cap_mb else 2 * rows[FULL, first]["kv_bytes"] / first
    print(f"\nthroughput at a KV memory cap of {cap / 2**20:.0f} MiB ({args.cap_steps} decode steps each)")
    for name, (net, make) in caches.items():
        if name in FLOORS:
            continue
        per_sequence = rows[name, first]["kv_bytes"] / first
        fits = int(cap // per_sequence)
        if fits < 1:
            print(f"{name:<20} does not fit one sequence ({per_sequence / 2**20:.0f} MiB each)")
            continue
        result = run(net, make, prompt, fits, args.cap_steps)
        print(f"{name:<20} batch {fits:>3}  {result['tokens_per_s']:7.1f} tokens/s", flush=True)


if __name__ == "__main__":
    main()
