"""The data section of a recipe: where training text comes from and how it becomes rows."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from omegaconf import OmegaConf


@dataclass
class DataConfig:
    """Training data (the `data` section of a recipe)."""

    source: str = "gsm_symbolic"
    """gsm_symbolic | essays | openr1 | hf | files | traces."""
    path: Optional[str] = None
    """Dataset name or local path (openr1, hf, files, traces)."""
    split: str = "train"
    """The datasets split to read (hf, openr1)."""
    text_column: str = "text"
    """Column holding the text (hf, files)."""
    train_samples: int = 256
    """Rows drawn from the source before packing (-1: all)."""
    eval_samples: int = 16
    """Rows set aside, never trained on: the held-out split of `eval quick` and `perplexity.source=run`."""
    max_length: int = 256
    """Tokens per training row."""
    packing: bool = True
    """Pack whole documents into rows (each row starts at a document start) instead of padding one per row."""
    chat_template: bool = True
    """Render prompt/answer sources through the tokenizer's chat template."""
    mask_prompt: bool = False
    """Distil only the answer tokens of prompt/answer sources."""
    too_long: str = "truncate"
    """A document longer than max_length: 'truncate' it or 'drop' it."""
    streaming: bool = False
    """Read hf/openr1 sources as a stream instead of downloading them whole."""
    batch_size: int = 1
    """Micro-batch per device."""
    num_workers: int = 0
    """DataLoader worker processes."""
    num_proc: int = 1
    """Processes for preparing the data (the OpenR1 math-verify filter, rendering, tokenising); 1: this one."""

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "DataConfig":
        """The typed config from a stored dict (a snapshot's run config), defaults filling missing keys."""
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(cls), values))
