"""kvpress's streaming TOVA, stepped token by token from another process (benchmarks/streaming_speed.py
--kvpress-python), so that kvpress runs in its own environment (it needs transformers < 5.3) while the two
streams still take turns on the same CPU.

Imports only torch, transformers and kvpress. Protocol on stdin / stdout, one JSON object per line: first
{"model": folder, "ids": [[...], ...], "budget": n, "threads": n, "compile": bool}, answered with {"ready":
versions} (with "compile", after a first pass over budget + 3 tokens through torch.compile(model.forward)); then
"step" lines, each answered with {"seconds": forward time, "nll": [per sequence]} for the next token.

    /path/to/kvpress-env/bin/python benchmarks/kvpress_worker.py   (started by streaming_speed.py)
"""

from __future__ import annotations

import json
import sys
import time
from importlib.metadata import version

import torch
import transformers
from kvpress import DecodingPress, TOVAPress
from transformers import AutoModelForCausalLM, DynamicCache


def reply(message: dict) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


@torch.no_grad()
def main() -> None:
    setup = json.loads(sys.stdin.readline())
    torch.set_num_threads(setup["threads"])
    transformers.utils.logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(setup["model"], dtype=torch.float32, attn_implementation="sdpa")
    model.eval()
    ids = torch.tensor(setup["ids"])
    # compress after every decoded token down to the budget: streaming TOVA (kvpress keeps the newest token)
    press = DecodingPress(base_press=TOVAPress(), compression_interval=1, target_size=setup["budget"],
                          hidden_states_buffer_size=1)
    forward = torch.compile(model.forward) if setup.get("compile") else model

    def step(cache, t):
        position = torch.full((ids.shape[0], 1), t, dtype=torch.long)
        return forward(input_ids=ids[:, t:t + 1], position_ids=position, cache_position=torch.tensor([t]),
                       past_key_values=cache, use_cache=True).logits[:, -1].float()

    with press(model):
        if setup.get("compile"):  # compile every graph the timed stream meets (filling, then full) before it
            warm = DynamicCache(config=model.config)
            for t in range(min(setup["budget"] + 3, ids.shape[1] - 1)):
                step(warm, t)
        cache = DynamicCache(config=model.config)
        reply({"ready": {name: version(name) for name in ("torch", "transformers", "kvpress")}})
        for t in range(ids.shape[1] - 1):
            if sys.stdin.readline().strip() != "step":
                return
            start = time.perf_counter()
            logits = step(cache, t)
            seconds = time.perf_counter() - start
            nll = torch.nn.functional.cross_entropy(logits, ids[:, t + 1], reduction="none")
            reply({"seconds": seconds, "nll": nll.tolist(), "held": cache.layers[0].keys.shape[2]})


if __name__ == "__main__":
    main()
