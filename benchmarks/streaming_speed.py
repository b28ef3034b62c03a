"""Token-by-token streaming through the engine against a plain loop over transformers' DynamicCache that
evicts by the same rule, in one invocation, one token of each in turn (the cost of a streaming-perplexity
sweep on CPU), and against the floor: a DynamicCache that only slides at the budget (what a plain cache of
that size costs, with no eviction choice to make).

The plain loop is what a user would write without the engine: eager attention returns each layer's
attention row of the new token; the token with the lowest mean attention over all query heads (TOVA) is
cut out of the DynamicCache layer once it holds more than `budget` tokens. Both read the same text from
the held-out essays, one row per sequence of the batch, and their per-token NLLs are compared.

With --kvpress-python, kvpress's `DecodingPress(TOVAPress)` (compressing to the budget after every token)
runs as a further stream in its own environment (benchmarks/kvpress_worker.py: kvpress needs transformers <
5.3), taking turns with the others, 128 tokens each (see `interleaved`). Its rule differs in one point: it
never evicts the newest token. With --compile, kvpress runs twice, eager and compiled, and the engine's
speed-up is judged against the faster of the two.

    python benchmarks/streaming_speed.py [--tokens 2048] [--budget 128] [--batches 1 8]
        [--kvpress-python /path/to/kvpress-env/bin/python] [--turn N]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from eval.config import PerplexityTask
from eval.engine import BoundedCache
from eval.engine.cache import ENGINE_ATTENTION, register_engine_attention
from eval.tasks import heldout_documents
from models import load_backbone
from models.backbone import embedded_model_dir

KVPRESS_COMPILED = "kvpress, compiled"


def engine_stream(model, ids: torch.Tensor, budget: int, forward=None):
    """Yields (seconds, NLL [B]) per token, streaming through the engine's TOVA (each token a decode step of
    `forward`, by default the model's own)."""
    forward = forward or model
    cache = BoundedCache(model, policy="tova", budget=budget, chunk_size=1)
    for t in range(ids.shape[1] - 1):
        start = time.perf_counter()
        logits = forward(input_ids=ids[:, t:t + 1], cache=cache, use_cache=True).logits[:, -1].float()
        yield time.perf_counter() - start, torch.nn.functional.cross_entropy(logits, ids[:, t + 1], reduction="none")


def plain_stream(model, ids: torch.Tensor, budget: int):
    """Yields (seconds, NLL [B]) per token from a DynamicCache loop that evicts by TOVA's rule by hand."""
    cache = DynamicCache(config=model.config)
    batch = ids.shape[0]
    for t in range(ids.shape[1] - 1):
        start = time.perf_counter()
        position = torch.full((batch, 1), t, dtype=torch.long)
        out = model(input_ids=ids[:, t:t + 1], position_ids=position, past_key_values=cache, use_cache=True,
                    output_attentions=True)
        nll = torch.nn.functional.cross_entropy(out.logits[:, -1].float(), ids[:, t + 1], reduction="none")
        for layer, attention in zip(cache.layers, out.attentions):
            held = layer.keys.shape[2]
            if held > budget:  # drop the token the new query attends to least, mean over all query heads
                victim = attention[:, :, -1].mean(1).argmin(-1)  # [B]
                keep = torch.arange(held)[None].expand(batch, -1)
                keep = keep[keep != victim[:, None]].view(batch, held - 1)
                index = keep[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[-1])
                layer.keys, layer.values = layer.keys.gather(2, index), layer.values.gather(2, index)
        yield time.perf_counter() - start, nll


def floor_stream(model, ids: torch.Tensor, budget: int, forward=None):
    """Yields (seconds, NLL [B]) per token from a DynamicCache that keeps its last `budget` tokens by slicing off
    the oldest: what a plain cache of the budget's size costs with no eviction choice (the floor; its NLLs are a
    sliding window's, not TOVA's)."""
    forward = forward or model
    cache = DynamicCache(config=model.config)
    batch = ids.shape[0]
    for t in range(ids.shape[1] - 1):
        start = time.perf_counter()
        position = torch.full((batch, 1), t, dtype=torch.long)
        logits = forward(input_ids=ids[:, t:t + 1], position_ids=position, cache=cache, use_cache=True).logits[:, -1]
        for layer in cache.layers:
            if layer.keys.shape[2] > budget:
                layer.keys, layer.values = layer.keys[:, :, 1:], layer.values[:, :, 1:]
        yield time.perf_counter() - start, torch.nn.functional.cross_entropy(logits.float(), ids[:, t + 1], reduction="none")


def kvpress_stream(python: str, ids: torch.Tensor, budget: int, compiled: bool = False):
    """Yields (seconds, NLL [B]) per token from kvpress's streaming TOVA in a worker process of `python`."""
    worker = subprocess.Popen([python, str(Path(__file__).with_name("kvpress_worker.py"))], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)

    def ask(message: str) -> dict:
        worker.stdin.write(message + "\n")
        worker.stdin.flush()
        line = worker.stdout.readline()
        if not line:
            raise RuntimeError(f"the kvpress worker ({python}) exited with {worker.wait()}; see its error above")
        return json.loads(line)

    try:
        versions = ask(json.dumps({"model": str(embedded_model_dir()), "ids": ids.tolist(), "budget": budget,
                                   "threads": torch.get_num_threads(), "compile": compiled}))["ready"]
        print(f"kvpress worker: {versions}", flush=True)
        for _ in range(ids.shape[1] - 1):
            step = ask("step")
            yield step["seconds"], torch.tensor(step["nll"])
    finally:
        worker.stdin.close()
        worker.wait()


@torch.no_grad()
def interleaved(model, ids: torch.Tensor, budget: int, kvpress_python: str | None = None, turn: int = 1,
                compiled: bool = False) -> dict[str, tuple[float, torch.Tensor]]:
    """The streams take turns, `turn` tokens each (each under its attention implementation, switched outside
    the timed part), so that a machine whose speed drifts slows all alike. With kvpress in another process, take
    long turns: a process's OpenMP threads keep spinning for a while after its step, so a token-by-token
    switch between processes makes each pay for the other's spin (both about twice as slow as alone).
    `compiled`: the engine and the floor step through `torch.compile(model.forward)`, compiled on a first pass
    over `budget + 3` tokens that is not timed (the plain loop, which reads attention rows, stays eager), and
    kvpress runs twice, eager and compiled the same way.
    Returns name -> (seconds, NLL [B, T-1])."""
    register_engine_attention()
    forward = torch.compile(model.forward) if compiled else None
    if compiled:  # the cache filling, then full and sliding: every graph a timed stream will meet
        for attention, stream in ((ENGINE_ATTENTION, engine_stream), ("sdpa", floor_stream)):
            model.set_attn_implementation(attention)
            for _ in stream(model, ids[:, :budget + 4], budget, forward):
                pass
    streams = {"plain": ("eager", plain_stream(model, ids, budget)),
               "engine": (ENGINE_ATTENTION, engine_stream(model, ids, budget, forward)),
               "floor": ("sdpa", floor_stream(model, ids, budget, forward))}
    if kvpress_python:  # kvpress as its users run it; compiled too when the engine is, and judged by its faster
        streams["kvpress"] = (None, kvpress_stream(kvpress_python, ids, budget))
        if compiled:
            streams[KVPRESS_COMPILED] = (None, kvpress_stream(kvpress_python, ids, budget, compiled=True))
    totals = {name: [0.0, []] for name in streams}
    tokens = ids.shape[1] - 1
    for start in range(0, tokens, turn):
        for name, (attention, stream) in streams.items():
            if attention and model.config._attn_implementation != attention:
                model.set_attn_implementation(attention)
            for _ in range(min(turn, tokens - start)):
                seconds, nll = next(stream)
                totals[name][0] += seconds
                totals[name][1].append(nll)
    return {name: (seconds, torch.stack(nll, 1)) for name, (seconds, nll) in totals.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--budget", type=int, default=128)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--kvpress-python", help="python of an environment with kvpress (and transformers < 5.3)")
    parser.add_argument("--turn", type=int, help="tokens each stream decodes before the next takes its turn "
                        "(default: 1, or 128 with --kvpress-python, whose stream runs in another process)")
    parser.add_argument("--compile", action="store_true", help="the engine and floor streams through "
                        "torch.compile(model.forward), compiled before the timed run; kvpress runs both eager and "
                        "compiled, and the engine is judged against the faster")
    args = parser.parse_args()
    model, tokenizer = load_backbone("smollm2-135m")
    docs = heldout_documents(PerplexityTask(documents=max(args.batches), tokens=args.tokens), tokenizer)
    turn = args.turn if args.turn is not None else 128 if args.kvpress_python else 1
    if turn < 1:
        raise SystemExit(f"--turn {turn} is invalid; it must be >= 1")
    print(f"SmolLM2-135M, TOVA budget {args.budget}, {args.tokens} tokens one at a time, "
          f"{torch.get_num_threads()} threads, streams taking turns every {turn} tokens"
          + (", engine and floor compiled, kvpress eager and compiled" if args.compile else ""))
    for batch in args.batches:
        ids = torch.stack(docs[:batch])
        results = interleaved(model, ids, args.budget, args.kvpress_python, turn, args.compile)
        (plain_s, plain_nll), (engine_s, engine_nll) = results["plain"], results["engine"]
        print(f"batch {batch}: plain DynamicCache loop {plain_s:7.1f} s, engine {engine_s:7.1f} s, "
              f"engine speed-up x{plain_s / engine_s:.2f} (target >= 1 at batch 1, > 1 at batch 8); per-token NLL "
              f"max |diff| {float((plain_nll - engine_nll).abs().max()):.2e}, perplexity plain "
              f"{float(plain_nll.mean().exp()):.3f} engine {float(engine_nll.mean().exp()):.3f}", flush=True)
        floor_s = results["floor"][0]
        print(f"batch {batch}: floor (DynamicCache sliding at the budget, no eviction choice) {floor_s:7.1f} s, "
              f"engine x{engine_s / floor_s:.2f} of the floor", flush=True)
        presses = [name for name in ("kvpress", KVPRESS_COMPILED) if name in results]
        for name in presses:
            press_s, press_nll = results[name]
            print(f"batch {batch}: {name} DecodingPress(TOVAPress) {press_s:7.1f} s, engine speed-up "
                  f"x{press_s / engine_s:.2f} (an engine as cheap as the floor: x{press_s / floor_s:.2f}); per-token "
                  f"NLL max |diff| to the engine {float((press_nll - engine_nll).abs().max()):.2e} "
                  f"(mean {float((press_nll - engine_nll).abs().mean()):.2e}), perplexity "
                  f"{float(press_nll.mean().exp()):.3f}", flush=True)
        if presses:
            best = min(presses, key=lambda name: results[name][0])
            print(f"batch {batch}: engine speed-up over kvpress at its fastest ({best}): "
                  f"x{results[best][0] / engine_s:.2f} (target >= 1.2 at batch 1)", flush=True)


if __name__ == "__main__":
    main()
