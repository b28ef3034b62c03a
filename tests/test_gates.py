"""Gates on whole models: exactness with gates off, gradients, limiting cases, cached generation, errors."""

import pytest
import torch
from transformers import BertConfig, BertForMaskedLM

import models
from models import (
    GateError,
    attach_gates,
    configure_backbone,
    gate_mode,
    gate_outputs,
    set_gate_mode,
)
from models.gates.dms import uncertain_share
from tests.conftest import tiny_model


def batch_with_left_padding(vocab=97, length=24):
    torch.manual_seed(1)
    ids = torch.randint(0, vocab, (2, length))
    mask = torch.ones_like(ids)
    mask[0, :6] = 0
    return ids, mask


@pytest.mark.parametrize("kind", ["dms", "trimkv"])
def test_gates_off_reproduce_the_original_model(family, kind):
    model = tiny_model(family)
    ids, mask = batch_with_left_padding()
    with torch.no_grad():
        before = model(ids, attention_mask=mask).logits
        attach_gates(model, kind, window=4) if kind == "dms" else attach_gates(model, kind, hidden=16, bias_init=1.0)
        after = model(ids, attention_mask=mask).logits
        set_gate_mode(model, "train")
        trained = model(ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(after[real], before[real], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(trained[real], before[real], atol=1e-3), "training mode must change attention"


@pytest.mark.slow
@pytest.mark.ci
def test_gates_off_reproduce_smollm2(smollm2):
    model, tokenizer = smollm2
    ids = tokenizer(["The capital of France is", "Once upon a time, in a land far away, there"], return_tensors="pt", padding=True)
    with torch.no_grad():
        before = model(**ids).logits
        attach_gates(model, "dms", window=8)
        try:
            after = model(**ids).logits
        finally:  # the session-scoped model is shared: take the gates out again
            for layer in models.gating.decoder_layers(model):
                layer.self_attn.kv_gate.install_hooks(layer)
                for handle in layer.self_attn.kv_gate._hooks:
                    handle.remove()
                del layer.self_attn.kv_gate
            model.set_attn_implementation("sdpa")
            del model.config.retrokv
    real = ids["attention_mask"].bool()
    torch.testing.assert_close(after[real], before[real], atol=1e-4, rtol=1e-4)


def test_gradients_reach_gates_and_neuron_rows_only():
    model = tiny_model("qwen2")
    attach_gates(model, "dms", window=2)
    model = configure_backbone(model, "frozen")
    set_gate_mode(model, "train")
    gate_state = models.gate_state(model)
    gate_state.neuron_keep = 0.0
    ids, mask = batch_with_left_padding()
    out = model(ids, attention_mask=mask)
    hard = torch.stack([o["evict_hard"] for o in gate_outputs(model)])
    (out.logits.float().pow(2).mean() + hard.mean()).backward()
    for layer in models.gating.decoder_layers(model):
        gate = layer.self_attn.kv_gate
        q = layer.self_attn.q_proj
        rows = gate.neuron_indices
        assert q.weight.grad is not None and q.weight.grad[rows].abs().sum() > 0
        others = torch.ones(q.weight.shape[0], dtype=torch.bool)
        others[rows] = False
        assert q.weight.grad[others].abs().sum() == 0
        assert q.bias.grad[rows].abs().sum() > 0  # qwen2 has a q bias
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    assert frozen and all(p.grad is None for n, p in model.named_parameters() if not p.requires_grad)


@pytest.mark.parametrize("kind,settings", [("dms", {"source": "adapter", "window": 3}), ("trimkv", {"hidden": 8})])
def test_gradients_reach_gate_parameters_with_frozen_and_lora_backbones(kind, settings):
    for mode in ("frozen", "lora"):
        model = configure_backbone(attach_gates(tiny_model("llama"), kind, **settings), mode)
        set_gate_mode(model, "train")
        ids, mask = batch_with_left_padding()
        logits = model(input_ids=ids, attention_mask=mask).logits
        side = gate_outputs(model)[0]
        extra = side["evict_hard"].mean() if kind == "dms" else side["occupancy"].mean()
        (logits.pow(2).mean() + extra).backward()
        gate_params = {n: p for n, p in model.named_parameters() if "kv_gate" in n}
        assert gate_params and all(p.grad is not None for p in gate_params.values()), mode
        # the adapter's projection starts at zero, so only its own weight has a non-zero gradient at step 0
        moving = [n for n in gate_params if n.endswith(("proj.weight", "down.weight", "up.weight", "head_bias"))]
        assert moving and all(gate_params[n].grad.abs().sum() > 0 for n in moving), mode
        for name, param in model.named_parameters():
            if not param.requires_grad:
                assert param.grad is None, name
        if mode == "lora":
            assert any("lora_" in n and p.grad is not None for n, p in model.named_parameters())


def test_lora_teacher_is_the_original_model():
    base = tiny_model("llama")
    ids, mask = batch_with_left_padding()
    with torch.no_grad():
        original = base(ids, attention_mask=mask).logits
    model = configure_backbone(attach_gates(base, "dms", window=3, source="adapter"), "lora")
    for name, param in model.named_parameters():  # make the adapter matter
        if "lora_B" in name:
            torch.nn.init.normal_(param)
    with torch.no_grad(), model.disable_adapter(), gate_mode(model, "off"):
        teacher = model(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(teacher[real], original[real], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [0, 3, 7])
def test_all_evicted_is_sliding_window_and_none_evicted_is_full_attention(window):
    ids, mask = batch_with_left_padding(length=30)
    mask[:] = 1
    reference = tiny_model("mistral", sliding_window=window + 1)  # Mistral keeps keys with t - i < sliding_window
    full = tiny_model("mistral")
    with torch.no_grad():
        windowed = reference(ids, attention_mask=mask).logits
        causal = full(ids, attention_mask=mask).logits
        for offset, expected in ((-1e4, windowed), (1e4, causal)):  # a fresh adapter gives logit = -offset
            gated = attach_gates(tiny_model("mistral"), "dms", window=window, source="adapter", offset=offset, sinks=0)
            for mode in ("infer", "train"):  # hard decisions, and soft ones saturated by the forced logit
                with gate_mode(gated, mode):
                    got = gated(ids, attention_mask=mask).logits
                torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(windowed, causal, atol=1e-3)


@pytest.mark.parametrize("offset,expected", [(2.0, 1.0), (5.0, 0.0)])
def test_uncertain_share_counts_decisions_within_the_noise_margin(offset, expected):
    """A fresh adapter gives every decision logit -offset: all within |logit| < 3, or none."""
    model = attach_gates(tiny_model("llama"), "dms", window=2, source="adapter", offset=offset, sinks=2)
    ids, mask = batch_with_left_padding(length=12)
    with torch.no_grad(), gate_mode(model, "train"):
        model(ids, attention_mask=mask)
        assert float(uncertain_share(gate_outputs(model), mask)) == expected


def test_sinks_stay_visible_when_every_other_key_is_evicted():
    """Everything evicted + k sinks = a sliding window that also reads the first k real tokens of each row."""
    ids, mask = batch_with_left_padding(length=30)
    window, sinks = 3, 2
    gated = attach_gates(tiny_model("llama"), "dms", window=window, source="adapter", offset=-1e4, sinks=sinks)
    plain = tiny_model("llama")
    length = ids.shape[1]
    first_real = (mask == 0).sum(-1)
    t, i = torch.arange(length)[:, None], torch.arange(length)[None]
    allowed = torch.zeros(2, length, length, dtype=torch.bool)
    for b in range(2):
        is_sink = (i >= first_real[b]) & (i < first_real[b] + sinks)
        allowed[b] = (i <= t) & ((t - i <= window) | is_sink) & (i >= first_real[b])
    bias = torch.zeros(2, 1, length, length).masked_fill(~allowed[:, None], torch.finfo(torch.float32).min)
    with torch.no_grad(), gate_mode(gated, "infer"):
        got = gated(ids, attention_mask=mask).logits
        expected = plain(ids, attention_mask=bias).logits
    real = mask.bool()
    torch.testing.assert_close(got[real], expected[real], atol=1e-5, rtol=1e-5)


def test_dms_adapter_at_inference_reads_the_layer_norm_output_and_matches_float64():
    """The inference shortcut (the adapter as one matmul on the layer's normed input) gives the adapter's logits:
    against a float64 RMSNorm + projection, after a parameter changes in place, and on the full path it falls back
    to when the layer norm's weight holds a zero."""
    model = attach_gates(tiny_model("llama"), "dms", window=2, source="adapter")
    torch.manual_seed(3)
    layer, gate = model.model.layers[1], model.model.layers[1].self_attn.kv_gate
    with torch.no_grad():
        for p in (layer.input_layernorm.weight, gate.norm.weight, gate.proj.weight, gate.proj.bias):
            p.copy_(torch.randn_like(p) * 0.5 + (1.0 if p.dim() == 1 and p is not gate.proj.bias else 0.0))
    residual = torch.randn(2, 5, model.config.hidden_size) * 3

    def reference():
        x = residual.double()
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + gate.norm.eps) * gate.norm.weight.double()
        raw = normed @ gate.proj.weight.double().T + gate.proj.bias.double()
        return (gate.settings.alpha_scale * raw - gate.settings.offset).transpose(1, 2)

    def inferred():
        with torch.no_grad():
            return gate.compute(residual, layer.input_layernorm(residual), layer.input_layernorm).double()

    set_gate_mode(model, "infer")
    torch.testing.assert_close(inferred(), reference(), atol=1e-3, rtol=1e-5)
    assert gate._fold[1] is not None, "the shortcut must be the path taken here"
    with torch.no_grad():
        gate.proj.weight.mul_(-2)
    torch.testing.assert_close(inferred(), reference(), atol=1e-3, rtol=1e-5)
    with torch.no_grad():
        layer.input_layernorm.weight[7] = 0.0
    torch.testing.assert_close(inferred(), reference(), atol=1e-3, rtol=1e-5)
    assert gate._fold[1] is None


@pytest.mark.parametrize("kind", ["dms", "trimkv"])
def test_cached_generation_matches_one_forward_in_inference_mode(kind):
    settings = {"window": 2, "alpha_scale": 3.0, "offset": 0.0} if kind == "dms" else {"hidden": 8, "budget": 6, "bias_init": 0.0}
    model = attach_gates(tiny_model("llama"), kind, **settings)
    set_gate_mode(model, "infer")
    ids, mask = batch_with_left_padding(length=12)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, output_logits=True,
                         return_dict_in_generate=True, pad_token_id=0)
    full_mask = torch.cat([mask, torch.ones(2, 10, dtype=mask.dtype)], dim=1)
    with torch.no_grad():
        forward = model(out.sequences, attention_mask=full_mask).logits
    stepped = torch.stack(out.logits, dim=1)
    torch.testing.assert_close(stepped, forward[:, 11:-1], atol=1e-4, rtol=1e-4)
    evicted = torch.stack([o["evict_hard"] for o in gate_outputs(model)]) if kind == "dms" else None
    if evicted is not None:
        assert 0 < evicted.mean() < 1, "the test must exercise evictions"


def test_unsupported_architecture_and_bad_settings_are_named():
    bert = BertForMaskedLM(BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32))
    with pytest.raises(GateError, match=r"'bert'.*llama"):
        attach_gates(bert, "dms")
    with pytest.raises(GateError, match=r"unknown gate kind 'h2o'.*dms"):
        attach_gates(tiny_model(), "h2o")
    with pytest.raises(GateError, match=r"wndow.*window"):
        attach_gates(tiny_model(), "dms", wndow=3)
    with pytest.raises(GateError, match=r"window=-1"):
        attach_gates(tiny_model(), "dms", window=-1)
    with pytest.raises(GateError, match=r"neuron_channel=99"):
        attach_gates(tiny_model(), "dms", neuron_channel=99)
    with pytest.raises(GateError, match=r"decay='cubic'"):
        attach_gates(tiny_model(), "trimkv", decay="cubic")
    with pytest.raises(GateError, match=r"unknown gate mode 'soft'"):
        set_gate_mode(attach_gates(tiny_model(), "dms"), "soft")


def test_gate_statistics_shapes_and_padding():
    model = attach_gates(tiny_model("qwen3"), "trimkv", hidden=8)
    set_gate_mode(model, "train")
    ids, mask = batch_with_left_padding()
    model(ids, attention_mask=mask)
    stats = models.gate_statistics(model, mask)
    assert set(stats) == {"retention", "occupancy"}
    assert stats["retention"].shape == (2, 2)
    assert torch.all((stats["retention"] > 0.99) & (stats["retention"] <= 1))  # bias 8: sigmoid(8) ~ 0.9997

    dms = attach_gates(tiny_model("llama"), "dms", window=2, per_layer=True)
    set_gate_mode(dms, "train")
    dms(ids, attention_mask=mask)
    frac = models.gate_statistics(dms, mask)["evict_fraction"]
    assert frac.shape == (2, 1) and torch.all((frac >= 0) & (frac <= 1))


@pytest.mark.parametrize("kind,settings", [("dms", {"window": 2, "alpha_scale": 3.0, "offset": 0.0, "sinks": 2}),
                                           ("trimkv", {"hidden": 8, "budget": 4, "bias_init": 0.0, "sinks": 1})])
def test_packed_sequences_attend_only_within_their_document(kind, settings):
    """Two documents packed in one row (positions restart) give the logits of running each alone."""
    model = attach_gates(tiny_model("qwen2"), kind, **settings)
    torch.manual_seed(3)
    a, b = torch.randint(0, 97, (1, 9)), torch.randint(0, 97, (1, 7))
    packed = torch.cat([a, b], dim=1)
    positions = torch.cat([torch.arange(9), torch.arange(7)])[None]
    for mode in ("train", "infer"):
        with torch.no_grad(), gate_mode(model, mode):
            models.gate_state(model).noise_seed = 0
            together = model(packed, position_ids=positions, use_cache=False).logits
            if mode == "train":  # noise is drawn per position, so compare the deterministic mode only
                continue
            alone_a = model(a).logits
            alone_b = model(b).logits
        torch.testing.assert_close(together[:, :9], alone_a, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(together[:, 9:], alone_b, atol=1e-5, rtol=1e-5)


def test_activation_checkpointing_gives_the_same_gradients():
    grads = []
    for checkpointing in (False, True):
        model = configure_backbone(attach_gates(tiny_model("llama"), "dms", window=2, source="adapter"), "frozen")
        torch.nn.init.normal_(model.model.layers[0].self_attn.kv_gate.proj.weight, std=0.05)
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        set_gate_mode(model, "train")
        ids, mask = batch_with_left_padding()
        logits = model(ids, attention_mask=mask, use_cache=False).logits
        hard = torch.stack([o["evict_hard"] for o in gate_outputs(model)])
        (logits.pow(2).mean() + hard.mean()).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=1e-6, rtol=1e-5)
