"""Exported Hugging Face folders: exact round trips for every gate source and backbone mode, remote code
that loads without RetroKV, gates-only exports, the Hub push (offline, through a fake HfApi), and errors."""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import models
from checkpoints import SnapshotMeta, export_run, export_snapshot, load_snapshot, save_snapshot, trained_tensors
from checkpoints.__main__ import main
from checkpoints.hub import push
from checkpoints.standalone import generate_without_retrokv
from eval.engine import BoundedCache
from models import GateError, GateMode
from models.pretrained import GATES_FILE
from tests.test_train import overrides, tiny_backbone  # noqa: F401 (a fixture)
from train.config import load_recipe
from train.run import train

GATES = {
    "dms_adapter": ("dms", {"source": "adapter", "window": 3, "sinks": 1}),
    "dms_neuron": ("dms", {"source": "query_neuron", "window": 3, "sinks": 1}),
    "trimkv": ("trimkv", {"budget": 8, "sinks": 1}),
}
LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}


def make_snapshot(backbone: str, folder: Path, gate: str, mode: str = "frozen", seed: int = 0) -> Path:
    """A snapshot as training writes it, with every trained tensor moved off its initial value so that
    the decisions are non-trivial and a load that dropped a tensor could not pass."""
    kind, settings = GATES[gate]
    model, _ = models.build_gated_model(backbone, kind, settings, backbone_mode=mode, lora=LORA if mode == "lora" else None)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=generator) * (0.3 if "kv_gate" in name else 0.02))
    meta = SnapshotMeta(backbone=backbone, gate_kind=kind, gate_settings=settings, backbone_mode=mode,
                        lora=LORA if mode == "lora" else None, cr=3.0, step=6, recipe="test",
                        backbone_fingerprint=model.config.retrokv["backbone_fingerprint"])
    return save_snapshot(trained_tensors(model), folder, meta)


def gated_outputs(model, ids):
    """Logits and every gate's per-position values (the eviction logits / retention scores) of one forward."""
    models.set_gate_mode(model, GateMode.INFER)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    return logits, [g.current_values.clone() for g in models.model_gates(model)]


IDS = torch.randint(0, 200, (2, 24), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("gate,mode,lora", [
    ("dms_adapter", "frozen", None), ("dms_neuron", "frozen", None), ("trimkv", "frozen", None),
    ("dms_adapter", "lora", "merged"), ("dms_neuron", "lora", "merged"), ("dms_neuron", "lora", "separate"),
    ("trimkv", "lora", "separate"), ("dms_adapter", "full", None), ("trimkv", "full", None)])
def test_export_and_load_give_the_same_logits_and_decisions(tiny_backbone, tmp_path, gate, mode, lora):  # noqa: F811
    snapshot = make_snapshot(tiny_backbone, tmp_path / "snap", gate, mode)
    before, _, _ = load_snapshot(snapshot)
    logits, values = gated_outputs(before, IDS)
    out = export_snapshot(snapshot, tmp_path / "export", lora=lora or "merged")
    after = models.from_pretrained(str(out))
    assert type(after).__name__ == "RetroKVLlamaForCausalLM" and models.gate_state(after).mode is GateMode.INFER
    logits2, values2 = gated_outputs(after, IDS)
    if lora == "merged":  # folded into the weights: equal up to the rounding of W + BA
        torch.testing.assert_close(logits2, logits, atol=2e-5, rtol=1e-5)
        for v, w in zip(values, values2):
            torch.testing.assert_close(w, v, atol=1e-4, rtol=1e-5)
            assert torch.equal(w > 0, v > 0)  # the same eviction decisions
    else:
        assert torch.equal(logits2, logits)
        for v, w in zip(values, values2):
            assert torch.equal(w, v)
    section = json.loads((out / "config.json").read_text())
    assert section["auto_map"] == {"AutoModelForCausalLM": "modeling_retrokv.RetroKVLlamaForCausalLM"}
    assert section["retrokv"]["cr"] == 3.0
    assert section["retrokv"]["weights"] == ("gates_only" if lora == "separate" else "full")
    assert (out / "lora" / "adapter_config.json").is_file() == (lora == "separate")


def test_gates_only_export_loads_its_base_and_refuses_other_weights(tiny_backbone, tmp_path):  # noqa: F811
    snapshot = make_snapshot(tiny_backbone, tmp_path / "snap", "dms_adapter")
    before, _, _ = load_snapshot(snapshot)
    logits, _ = gated_outputs(before, IDS)
    out = export_snapshot(snapshot, tmp_path / "gates", gates_only=True)
    assert not list(out.glob("model*.safetensors")) and (out / GATES_FILE).is_file()
    assert all("kv_gate" in name for name in load_file(out / GATES_FILE))
    after = models.from_pretrained(str(out))
    assert torch.equal(gated_outputs(after, IDS)[0], logits)
    other = tmp_path / "other"  # same architecture, other weights
    models.load_backbone(tiny_backbone)[0].apply(lambda m: torch.nn.init.normal_(m.weight) if isinstance(m, torch.nn.Linear) else None).save_pretrained(other)
    with pytest.raises(GateError, match="fingerprint"):
        models.from_pretrained(str(out), base_model=str(other))
    full = make_snapshot(tiny_backbone, tmp_path / "full", "dms_adapter", "full")
    with pytest.raises(ValueError, match="needs a frozen backbone"):
        export_snapshot(full, tmp_path / "g2", gates_only=True)
    with pytest.raises(ValueError, match="--lora separate applies to LoRA snapshots"):
        export_snapshot(full, tmp_path / "g3", lora="separate")


def test_the_bounded_engine_serves_a_loaded_export(tiny_backbone, tmp_path):  # noqa: F811
    snapshot = make_snapshot(tiny_backbone, tmp_path / "snap", "dms_adapter")
    before, _, _ = load_snapshot(snapshot)
    after = models.from_pretrained(str(export_snapshot(snapshot, tmp_path / "export")))
    runs = []
    for model in (before, after):
        with BoundedCache(model, policy="dms", budget=16) as cache:
            out = model.generate(IDS[:1], attention_mask=torch.ones_like(IDS[:1]), max_new_tokens=12, do_sample=False,
                                 cache=cache)
            runs.append((out, cache.stats().kv_reads))
    assert torch.equal(runs[0][0], runs[1][0]) and runs[0][1] == runs[1][1]


@pytest.mark.ci
@pytest.mark.parametrize("gate,mode,export", [("dms_neuron", "frozen", {}), ("trimkv", "frozen", {"gates_only": True}),
                                              ("dms_neuron", "lora", {"lora": "separate"})])
def test_transformers_loads_an_export_without_retrokv(tiny_backbone, tmp_path, gate, mode, export):  # noqa: F811
    """AutoModelForCausalLM with trust_remote_code, in a process where RetroKV cannot be imported, generates what
    the gated model generates (greedy, DynamicCache) and computes its logits on the completion."""
    snapshot = make_snapshot(tiny_backbone, tmp_path / "snap", gate, mode)
    model, _, _ = load_snapshot(snapshot)
    models.set_gate_mode(model, GateMode.INFER)
    ids = IDS[:1, :10]
    expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False)
    with torch.no_grad():
        gated = model(expected).logits
        with models.gate_mode(model, GateMode.OFF):
            ungated = model(expected).logits
    assert (gated - ungated).abs().max() > 1e-3  # the gates matter here, so the comparison below can fail
    out = export_snapshot(snapshot, tmp_path / "export", **export)
    logits = tmp_path / "logits.pt"
    result = generate_without_retrokv(out, ids.tolist(), 16, logits, tmp_path / "modules")
    assert result["class"] == "RetroKVLlamaForCausalLM"
    assert result["tokens"] == expected.tolist()
    assert torch.equal(torch.load(logits), gated)


@pytest.fixture(scope="module")
def tiny_run(tiny_backbone, tmp_path_factory):  # noqa: F811
    out = tmp_path_factory.mktemp("run") / "run"
    train(load_recipe("dms_smollm2_cr4", overrides(tiny_backbone, out, **{"trainer.max_steps": 5})))
    return out


def test_the_cli_exports_a_run_family_with_cards_and_pushes_it_as_branches(tiny_run, tmp_path, capsys, monkeypatch):
    assert main(["export", str(tiny_run), "--out", str(tmp_path / "family"), "--all"]) == 0
    names = sorted(p.name for p in (tmp_path / "family").iterdir())
    assert names == ["cr2", "cr3", "final"], names
    card = (tmp_path / "family" / "final" / "README.md").read_text()
    assert "library_name: transformers" in card and "evict_fraction" in card and "branch `crK`" in card
    assert main(["export", str(tiny_run), "--out", str(tmp_path / "cr2"), "--cr", "2"]) == 0
    assert json.loads((tmp_path / "cr2" / "config.json").read_text())["retrokv"]["cr"] == 2.0
    capsys.readouterr()
    assert main(["push", str(tmp_path / "family"), "--repo-id", "org/tiny", "--dry-run"]) == 0
    listing = capsys.readouterr().out
    assert "org/tiny@main <- " in listing and "org/tiny@cr2 <- " in listing and "model.safetensors" in listing

    class FakeApi:
        def __init__(self):
            self.calls = []

        def create_repo(self, repo_id, **kw):
            self.calls.append(("create_repo", repo_id, kw["private"]))

        def create_branch(self, repo_id, branch, **kw):
            self.calls.append(("create_branch", branch))

        def upload_folder(self, repo_id, folder_path, revision, **kw):
            self.calls.append(("upload", Path(folder_path).name, revision, sorted(os.listdir(folder_path))))
            return f"https://hub/{repo_id}/commit/{revision}"

    monkeypatch.setenv("HF_TOKEN", "hf_secret_token_value")
    api = FakeApi()
    urls = push(tmp_path / "family", "org/tiny", private=True, api=api)
    assert urls == ["https://hub/org/tiny/commit/cr2", "https://hub/org/tiny/commit/cr3", "https://hub/org/tiny/commit/main"]
    assert api.calls[0] == ("create_repo", "org/tiny", True)
    uploads = [c for c in api.calls if c[0] == "upload"]
    assert [(c[1], c[2]) for c in uploads] == [("cr2", "cr2"), ("cr3", "cr3"), ("final", "main")]
    assert "config.json" in uploads[0][3] and "modeling_retrokv.py" in uploads[0][3]
    assert ("create_branch", "main") not in api.calls
    one = FakeApi()
    push(tmp_path / "cr2", "org/tiny", revision="v1", api=one)
    assert one.calls[1] == ("create_branch", "v1") and one.calls[2][2] == "v1"
    assert "hf_secret_token_value" not in capsys.readouterr().out


def test_export_errors_are_one_clear_line(tiny_run, tiny_backbone, tmp_path, capsys):  # noqa: F811
    def error(argv):
        assert main(argv) == 2
        return capsys.readouterr().err.strip()

    empty = tmp_path / "empty_run"
    empty.mkdir()
    assert "holds no snapshots" in error(["export", str(empty), "--out", str(tmp_path / "x")])
    assert "has no snapshot 'cr9'" in error(["export", str(tiny_run), "--out", str(tmp_path / "x"), "--cr", "9"])
    (tmp_path / "taken").mkdir()
    assert "already exists" in error(["export", str(tiny_run), "--out", str(tmp_path / "taken")])
    assert "ORG/NAME" in error(["push", str(tmp_path), "--repo-id", "noslash"])
    assert "neither an exported model" in error(["push", str(empty), "--repo-id", "a/b", "--dry-run"])
    assert not (tmp_path / "x").exists()

    out = export_run(tiny_run, tmp_path / "good")[0]
    config = json.loads((out / "config.json").read_text())
    newer = shutil.copytree(out, tmp_path / "newer")
    (newer / "config.json").write_text(json.dumps({**config, "retrokv": {**config["retrokv"], "format_version": 99}}))
    with pytest.raises(GateError, match="format_version=99 is newer than this code reads"):
        models.from_pretrained(str(newer))

    missing = shutil.copytree(out, tmp_path / "missing")
    tensors = load_file(missing / "model.safetensors")
    dropped = next(name for name in tensors if "kv_gate" in name)
    save_file({k: v for k, v in tensors.items() if k != dropped}, missing / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(GateError, match="lacks 1 of the model's tensors"):
        models.from_pretrained(str(missing))

    truncated = shutil.copytree(out, tmp_path / "truncated")
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(GateError, match="corrupt or truncated"):
        models.from_pretrained(str(truncated))

    snapshot = shutil.copytree(tiny_run / "snapshots" / "final", tmp_path / "corrupt_snapshot")
    weights = snapshot / "trainable.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    assert "is corrupt or missing" in error(["export", str(snapshot), "--out", str(tmp_path / "y")])
    assert not (tmp_path / "y").exists() and not list(tmp_path.glob(".y-*"))

    gates_only = export_snapshot(tiny_run / "snapshots" / "final", tmp_path / "gates", gates_only=True)
    (gates_only / GATES_FILE).write_bytes((gates_only / GATES_FILE).read_bytes()[:64])
    with pytest.raises(GateError, match="missing or corrupt"):
        models.from_pretrained(str(gates_only))
