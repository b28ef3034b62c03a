"""Why a sink-less window's streaming perplexity moves with the chunk size: the same visible sets the engine
uses, applied as masks over one full forward (so any difference from the engine would be an engine bug),
at several chunk sizes, chunk-boundary offsets, and with 4 attention sinks.

    python benchmarks/chunk_alignment.py [--documents 3] [--tokens 1024] [--budget 128] [--check-engine]

With chunk c, a query at position q in the chunk starting at s reads keys [s - budget, q] (the budget most
recent tokens held before the chunk, plus the chunk up to itself); token by token (c = 1) it reads
[q - budget, q]. `offset` shifts where chunks start.
"""

from __future__ import annotations

import argparse
import math
import types

import torch


def visible(length: int, budget: int, chunk: int, offset: int = 0, sinks: int = 0) -> torch.Tensor:
    q = torch.arange(length)[:, None]
    k = torch.arange(length)[None]
    start = torch.where(q < offset, 0, ((q - offset) // chunk) * chunk + offset)
    return (k <= q) & ((k >= start - budget) | (k < sinks))


def masked_perplexity(model, ids: torch.Tensor, allowed: torch.Tensor, score_from: int) -> float:
    mask = torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))[None, None]
    with torch.no_grad():
        logits = model(ids[None], attention_mask=mask).logits[0]
    logp = torch.log_softmax(logits.float(), -1)
    return math.exp(float(-logp[score_from:-1].gather(-1, ids[score_from + 1:, None]).mean()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--budget", type=int, default=128)
    parser.add_argument("--score-from", type=int, default=256)
    parser.add_argument("--check-engine", action="store_true", help="also stream document 0 through the engine")
    args = parser.parse_args()
    from eval.tasks import heldout_documents
    from models import load_backbone

    model, tokenizer = load_backbone("smollm2-135m")
    docs = heldout_documents(types.SimpleNamespace(source="essays", documents=args.documents, tokens=args.tokens), tokenizer)
    chunks, offsets = (1, 4, 8, 16, 32, 64), (0, 8, 16, 24)
    print(f"window, budget {args.budget}, perplexity from position {args.score_from}; masks over one full forward")
    print("doc | " + " | ".join(f"chunk {c}" for c in chunks) + " | chunk 32 at offsets " + "/".join(map(str, offsets))
          + " | 4 sinks, chunk 1 / 32")
    for n, ids in enumerate(docs):
        ppl = {c: masked_perplexity(model, ids, visible(len(ids), args.budget, c), args.score_from) for c in chunks}
        shifted = [masked_perplexity(model, ids, visible(len(ids), args.budget, 32, o), args.score_from) for o in offsets]
        sinks = [masked_perplexity(model, ids, visible(len(ids), args.budget, c, sinks=4), args.score_from) for c in (1, 32)]
        print(f"{n} | " + " | ".join(f"{ppl[c]:.2f}" for c in chunks) + " | " + "/".join(f"{v:.1f}" for v in shifted)
              + " | " + "/".join(f"{v:.1f}" for v in sinks), flush=True)
    if args.check_engine:
        from eval.streaming import reference_logprobs, stream_document

        reference = reference_logprobs(model, docs[0])
        for c in (32, 8):
            result = stream_document(model, docs[0], "window", args.budget, c, reference, args.score_from)
            print(f"engine, document 0, chunk {c}: {math.exp(float(result.nll.mean())):.2f}")


if __name__ == "__main__":
    main()
