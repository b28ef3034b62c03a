"""Batched generation through the bounded-memory engine: left-padded prompts, `model.generate` with a
`BoundedCache` per batch, W samples per prompt, costs added up over batches."""

from __future__ import annotations

import torch
from tqdm import tqdm

from eval.costs import CostMeter
from eval.engine import BoundedCache


@torch.no_grad()
def generate(model, tokenizer, prompts: list[str], policy, budget: int, max_new_tokens: int, samples: int = 1,
             temperature: float = 0.0, seed: int = 0, batch_size: int = 4, desc: str = "generate"):
    """Returns (outputs: per prompt a list of `samples` decoded continuations, CostMeter, tokens generated).

    Prompts are batched by length (less padding); with `samples` > 1 every prompt is repeated and sampled at
    `temperature` (greedy when it is 0).
    """
    device = next(model.parameters()).device
    tokenizer.padding_side = "left"
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    outputs: list[list[str]] = [[] for _ in prompts]
    meter, generated = CostMeter(), 0
    per_batch = max(1, batch_size // samples) if samples > 1 else batch_size
    generator_seed = seed
    for start in tqdm(range(0, len(order), per_batch), desc=desc, leave=False):
        index = order[start:start + per_batch]
        batch = tokenizer([prompts[i] for i in index], return_tensors="pt", padding=True, add_special_tokens=False)
        ids = batch.input_ids.repeat_interleave(samples, 0).to(device)
        mask = batch.attention_mask.repeat_interleave(samples, 0).to(device)
        torch.manual_seed(generator_seed)
        generator_seed += 1
        sampling = {"do_sample": True, "temperature": temperature, "top_p": 1.0, "top_k": 0} if temperature > 0 \
            else {"do_sample": False}
        with BoundedCache(model, policy=policy, budget=budget) as cache:
            out = model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=max_new_tokens,
                                 pad_token_id=tokenizer.pad_token_id, **sampling)
        new = out[:, ids.shape[1]:]
        finished = (new == tokenizer.eos_token_id).long().cumsum(-1) == 0  # tokens before the first EOS
        generated += int(finished.sum())
        texts = tokenizer.batch_decode(new, skip_special_tokens=True)
        for row, i in enumerate(index):
            outputs[i] = texts[row * samples:(row + 1) * samples]
        lengths = (mask.sum(-1) + finished.sum(-1)).tolist()
        meter.add(cache.stats(), lengths)
    return outputs, meter, generated
