"""Load an exported folder the way a transformers user without RetroKV does: in a fresh Python process in
which RetroKV's packages cannot be imported, through `AutoModelForCausalLM(..., trust_remote_code=True)`.
Used by the export tests and benchmarks/export_roundtrip.py to show that an export stands on its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

PROJECT_PACKAGES = ("models", "checkpoints", "train", "eval", "data", "assets", "recipes")

_SCRIPT = """
import json, sys
BLOCKED = set(json.loads(sys.argv[1]))
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(name + " is blocked: this process must not see RetroKV")
sys.meta_path.insert(0, Block())
try:
    import models
    sys.exit("RetroKV is importable")
except ImportError:
    pass
import torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[2], trust_remote_code=True)
ids = torch.tensor(json.loads(sys.argv[3]))
out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=int(sys.argv[4]), do_sample=False)
with torch.no_grad():
    torch.save(model(out).logits, sys.argv[5])
print(json.dumps({"class": type(model).__name__, "tokens": out.tolist()}))
"""


def generate_without_retrokv(folder: str | Path, ids: list[list[int]], max_new_tokens: int, logits_out: str | Path,
                             modules_cache: str | Path, timeout: float = 600) -> dict:
    """Greedy tokens (and, in `logits_out`, the logits over them) of the export at `folder`, computed in a
    process that cannot import RetroKV. Returns {"class": the loaded class name, "tokens": [[...]]}."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["HF_MODULES_CACHE"] = str(modules_cache)  # transformers copies the remote code here
    args = [json.dumps(PROJECT_PACKAGES), str(folder), json.dumps(ids), str(max_new_tokens), str(logits_out)]
    done = subprocess.run([sys.executable, "-I", "-c", _SCRIPT, *args], capture_output=True, text=True,
                          cwd=Path(modules_cache).parent, env=env, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"loading {folder} without RetroKV failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])
