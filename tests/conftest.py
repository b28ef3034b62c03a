"""Shared fixtures: tiny random GQA models of every supported family, and the real SmolLM2 (slow)."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach a hub; set before transformers is imported

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import (  # noqa: E402
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

TINY = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=False)

FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 16}),
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": None}),
}


def tiny_model(family: str = "llama", seed: int = 0, **overrides):
    config_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(seed)
    config = config_cls(**{**TINY, **extra, **overrides})
    config._attn_implementation = "sdpa"
    return model_cls(config).eval()


@pytest.fixture(params=sorted(FAMILIES))
def family(request):
    return request.param


@pytest.fixture(scope="session")
def smollm2():
    from models import load_backbone

    return load_backbone("smollm2-135m")


@pytest.fixture(scope="session")
def tokenizer():
    """SmolLM2's real tokenizer (with its chat template), from the embedded model's cache folder."""
    from transformers import AutoTokenizer

    from models.backbone import embedded_model_dir

    tok = AutoTokenizer.from_pretrained(embedded_model_dir())
    tok.pad_token = tok.pad_token or tok.eos_token
    return tok
