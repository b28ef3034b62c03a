"""Faults and bad input a careless user produces: each must stop with one clear line, lose nothing, and never
train, load or evaluate something silently wrong."""

import json
import os
import shutil
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from checkpoints import SnapshotError, SnapshotMeta, load_snapshot, recover_snapshots, save_snapshot
from recipes import RecipeError
from tests.test_train import overrides, tiny_backbone  # noqa: F401 (a fixture)
from train.config import load_recipe
from train.errors import NonFiniteLossError
from train.run import train


@pytest.fixture(scope="module")
def tiny_run(tiny_backbone, tmp_path_factory):  # noqa: F811
    """A finished 4-step DMS run of the tiny backbone: Lightning checkpoints, snapshots, config."""
    out = tmp_path_factory.mktemp("run") / "run"
    train(load_recipe("dms_smollm2_cr4", overrides(tiny_backbone, out, **{"trainer.max_steps": 4})))
    return out


def copy_of(run: Path, tmp_path: Path) -> Path:
    target = tmp_path / "copy"
    shutil.copytree(run, target)
    return target


# --- 1. a NaN run ----------------------------------------------------------------------------------------------
def test_a_non_finite_loss_stops_the_run_and_writes_no_snapshot(tiny_backbone, tmp_path):  # noqa: F811
    out = tmp_path / "nan"
    cfg = load_recipe("dms_smollm2_cr4", overrides(tiny_backbone, out, **{"trainer.max_steps": 3, "loss.temperature": 1e-40}))
    with pytest.raises(NonFiniteLossError, match=r"step 0: the loss is not finite \(kl"):
        train(cfg)
    assert not (out / "snapshots").exists()
    from train.__main__ import main

    assert main([*overrides(tiny_backbone, tmp_path / "cli", **{"trainer.max_steps": 3, "loss.temperature": 1e-40})]) == 1


def test_non_finite_tensors_are_neither_written_nor_loaded(tiny_run, tmp_path):
    run = copy_of(tiny_run, tmp_path)
    final = run / "snapshots" / "final"
    tensors = load_file(str(final / "trainable.safetensors"))
    name = sorted(tensors)[0]
    tensors[name] = tensors[name].clone().fill_(float("nan"))
    meta = SnapshotMeta(backbone="b", gate_kind="dms", gate_settings={})
    with pytest.raises(SnapshotError, match="refusing to write .*NaN or infinite"):
        save_snapshot(tensors, tmp_path / "nan_snapshot", meta)
    assert not (tmp_path / "nan_snapshot").exists()
    save_file(tensors, str(final / "trainable.safetensors"))  # as a diverged run of older code would have
    with pytest.raises(SnapshotError, match="NaN or infinite values in 1 tensor"):
        load_snapshot(final)
    from eval.__main__ import main

    assert main(["quick", str(run)]) == 2


# --- 2. incomplete snapshots and a different backbone ------------------------------------------------------------
def test_a_snapshot_missing_tensors_is_refused(tiny_run, tmp_path):
    final = copy_of(tiny_run, tmp_path) / "snapshots" / "final"
    tensors = load_file(str(final / "trainable.safetensors"))
    kept = dict(sorted(tensors.items())[: len(tensors) // 2])
    save_file(kept, str(final / "trainable.safetensors"))
    with pytest.raises(SnapshotError, match=f"lacks {len(tensors) - len(kept)} of the {len(tensors)} tensors"):
        load_snapshot(final)


def test_a_snapshot_on_a_different_backbone_with_the_same_shapes_is_refused(tiny_run, tiny_backbone, tmp_path):  # noqa: F811
    final = copy_of(tiny_run, tmp_path) / "snapshots" / "final"
    model, _, meta = load_snapshot(final)  # the original backbone loads
    assert meta.backbone_fingerprint and len(meta.backbone_fingerprint) == 16
    other = tmp_path / "other-llama"
    config = LlamaConfig.from_pretrained(tiny_backbone)
    torch.manual_seed(1)
    LlamaForCausalLM(config).save_pretrained(other)
    for name in os.listdir(tiny_backbone):
        if "token" in name or name.endswith(".jinja"):
            shutil.copy(Path(tiny_backbone) / name, other / name)
    values = json.loads((final / "retrokv.json").read_text())
    (final / "retrokv.json").write_text(json.dumps({**values, "backbone": str(other)}))
    with pytest.raises(SnapshotError, match="different model or revision"):
        load_snapshot(final)


# --- 3. stale prepared data --------------------------------------------------------------------------------------
def test_editing_a_data_file_prepares_the_data_again(tokenizer, tmp_path):
    from data import RetrofitDataModule
    from data.config import DataConfig

    text = tmp_path / "corpus.txt"
    text.write_text("\n".join(f"the first version of line {i}" for i in range(20)))
    cfg = DataConfig(source="files", path=str(text), train_samples=-1, eval_samples=0, max_length=32, chat_template=False)

    def first_row():
        data = RetrofitDataModule(cfg, tokenizer, 0, tmp_path / "cache")
        data.setup()
        return tokenizer.decode(data.train_set[0]["input_ids"])

    before = first_row()
    text.write_text("\n".join(f"a second version of line {i}" for i in range(20)))
    after = first_row()
    assert "first version" in before and "second version" in after


# --- 4. resume=auto with another config ------------------------------------------------------------------------
def test_resume_with_a_changed_config_is_refused_and_the_config_kept(tiny_run, tiny_backbone, tmp_path):  # noqa: F811
    run = copy_of(tiny_run, tmp_path)
    saved = (run / "config.yaml").read_text()
    changed = overrides(tiny_backbone, run, **{"trainer.max_steps": 6, "resume": "auto", "optim.lr": 0.5,
                                               "gate.dms.window": 6})
    with pytest.raises(RecipeError, match=r"different config \(gate.dms.window: 4 -> 6; optim.lr: 0.01 -> 0.5\)"):
        train(load_recipe("dms_smollm2_cr4", changed))
    assert (run / "config.yaml").read_text() == saved
    longer = overrides(tiny_backbone, run, **{"trainer.max_steps": 6, "resume": "auto"})
    assert train(load_recipe("dms_smollm2_cr4", longer))["steps"] == 6  # running longer is allowed
    assert (run / "config.yaml").read_text() == saved


# --- 5. two runs preparing the same data at once -----------------------------------------------------------------
def test_two_processes_preparing_the_same_data_both_succeed(tokenizer, tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text("\n".join(f"line {i} of a small corpus" for i in range(40)))
    tokenizer.save_pretrained(tmp_path / "tok")
    script = textwrap.dedent(f"""
        import time
        import data.module
        from transformers import AutoTokenizer
        from data.config import DataConfig
        slow = data.module.prepare
        data.module.prepare = lambda *a: (time.sleep(1.5), slow(*a))[1]  # both runs are inside prepare at once
        cfg = DataConfig(source="files", path={str(text)!r}, train_samples=-1, eval_samples=2, max_length=32,
                         chat_template=False)
        module = data.module.RetrofitDataModule(cfg, AutoTokenizer.from_pretrained({str(tmp_path / "tok")!r}), 0,
                                                {str(tmp_path / "cache")!r})
        module.setup()
        print(len(module.train_set))
    """)
    procs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              cwd=Path(__file__).parent.parent) for _ in range(2)]
    results = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in results]
    assert results[0][0] == results[1][0]
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [p.name for p in (tmp_path / "cache").iterdir()
                                                                 if ".tmp" not in p.name]


# --- 6. checks that used to exist only in --dry-run --------------------------------------------------------------
def test_a_real_run_checks_the_backbone_length_before_training(tiny_backbone, tmp_path):  # noqa: F811
    cfg = load_recipe("dms_smollm2_cr4", overrides(tiny_backbone, tmp_path / "long", **{"data.max_length": 300}))
    with pytest.raises(RecipeError, match="data.max_length=300 exceeds the backbone's max_position_embeddings=256"):
        train(cfg)
    assert not (tmp_path / "long").exists()


# --- 9. unsafe checkpoints -------------------------------------------------------------------------------------
class Payload:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_planted_checkpoint_runs_no_code_even_when_torch_is_told_to_trust_it(tiny_run, tiny_backbone, tmp_path,  # noqa: F811
                                                                            monkeypatch):
    run = copy_of(tiny_run, tmp_path)
    marker = tmp_path / "pwned"
    torch.save({"state_dict": Payload(str(marker))}, run / "resume_state" / "last.ckpt")
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    resumed = overrides(tiny_backbone, run, **{"trainer.max_steps": 6, "resume": "auto"})
    with pytest.raises(RecipeError, match="last.ckpt holds objects other than tensors") as err:
        train(load_recipe("dms_smollm2_cr4", resumed))
    assert "weights_only=False" not in str(err.value)
    assert not marker.exists()


def test_a_corrupt_last_checkpoint_falls_back_to_the_newest_intact_one(tiny_run, tiny_backbone, tmp_path, caplog):  # noqa: F811
    run = copy_of(tiny_run, tmp_path)
    last = run / "resume_state" / "last.ckpt"
    last.write_bytes(last.read_bytes()[:1000])  # truncated, as by a full disk
    resumed = overrides(tiny_backbone, run, **{"trainer.max_steps": 6, "resume": "auto"})
    assert train(load_recipe("dms_smollm2_cr4", resumed))["steps"] == 6
    assert "last.ckpt is corrupt" in caplog.text and "resuming from" in caplog.text and "step000004.ckpt" in caplog.text
    for path in (run / "resume_state").glob("*.ckpt"):
        path.write_bytes(b"")
    with pytest.raises(RecipeError, match=r"last.ckpt is corrupt .* no intact step\*.ckpt"):
        train(load_recipe("dms_smollm2_cr4", resumed))


# --- 10. replacing a snapshot -----------------------------------------------------------------------------------
def test_a_kill_while_replacing_a_snapshot_loses_neither(tmp_path, monkeypatch):
    meta = SnapshotMeta(backbone="b", gate_kind="dms", gate_settings={})
    folder = save_snapshot({"w": torch.zeros(2)}, tmp_path / "snapshots" / "final", meta)
    real_replace, calls = os.replace, []

    def killed_after_moving_the_old_one_aside(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise KeyboardInterrupt  # the process dies between the two renames
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", killed_after_moving_the_old_one_aside)
    with pytest.raises(KeyboardInterrupt):
        save_snapshot({"w": torch.ones(2)}, folder, meta)
    monkeypatch.undo()
    assert not folder.exists()
    recover_snapshots(folder.parent)  # what the next run does first
    assert load_file(str(folder / "trainable.safetensors"))["w"].sum() == 0
    assert [p.name for p in folder.parent.iterdir()] == ["final"]


def test_snapshot_folders_and_files_follow_the_umask(tmp_path):
    previous = os.umask(0o022)
    try:
        folder = save_snapshot({"w": torch.zeros(2)}, tmp_path / "s", SnapshotMeta(backbone="b", gate_kind="dms",
                                                                                  gate_settings={}))
    finally:
        os.umask(previous)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o755
    assert {stat.S_IMODE(p.stat().st_mode) for p in folder.iterdir()} == {0o644}
