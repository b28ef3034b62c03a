"""The retrofit trainer end to end on a tiny random Llama with SmolLM2's tokenizer."""

import glob
import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from transformers import LlamaConfig, LlamaForCausalLM

from train.config import load_recipe
from train.run import train


@pytest.fixture(scope="module")
def tiny_backbone(tmp_path_factory, tokenizer):
    folder = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=True)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def overrides(backbone, out, **extra):
    base = {"model.backbone": backbone, "output_dir": str(out), "data.max_length": 48, "data.train_samples": 24,
            "data.eval_samples": 4, "schedule.steps_per_cr": 2, "schedule.hold_steps": 1, "trainer.max_steps": -1,
            "trainer.checkpoint_every_n_steps": 2, "trainer.enable_progress_bar": "false", "trainer.val_check_interval": 7,
            "gate.dms.window": 4, "optim.lr": 1e-2}
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def scalars(out, tag):
    values = {}
    for path in sorted(glob.glob(f"{out}/tensorboard/events*")):
        acc = EventAccumulator(path)
        acc.Reload()
        if tag in acc.Tags()["scalars"]:
            values.update({e.step: e.value for e in acc.Scalars(tag)})
    return values


@pytest.mark.ci
def test_default_recipe_trains_and_writes_the_cr_family(tiny_backbone, tmp_path):
    cfg = load_recipe("dms_smollm2_cr4", overrides(tiny_backbone, tmp_path / "run"))
    summary = train(cfg)
    out = tmp_path / "run"
    assert summary["steps"] == 7  # (4 - 1) * 2 ramp + 1 hold
    assert (out / "config.yaml").is_file() and (out / "summary.json").is_file()
    checkpoints = sorted(p.name for p in (out / "resume_state").iterdir())
    assert "last.ckpt" in checkpoints and "step000006.ckpt" in checkpoints
    assert not [name for name in checkpoints if name.endswith(".partial")]
    assert sorted(p.name for p in (out / "snapshots").iterdir()) == ["cr2", "cr3", "cr4", "final"]
    meta = json.loads((out / "snapshots" / "cr3" / "retrokv.json").read_text())
    assert meta["cr"] == 3.0 and meta["gate_kind"] == "dms" and meta["step"] == 5
    cr = scalars(out, "train/cr")
    assert cr[0] == pytest.approx(1.0) and cr[6] == pytest.approx(4.0)
    assert {"train/kl", "train/capacity", "train/evict", "layers/evict_fraction_00", "val/kl", "train/uncertain",
            "train/saturated_heads"} <= set(EventAccumulator(glob.glob(f"{out}/tensorboard/events*")[0]).Reload().Tags()["scalars"])
    assert all(0 <= v <= 1 for v in scalars(out, "train/uncertain").values())
    assert all(v in (0, 1, 2, 3, 4) for v in scalars(out, "train/saturated_heads").values())  # 2 layers x 2 KV heads
    table = json.loads((out / "summary.json").read_text())["gates_last_step"]["evict_fraction"]
    assert len(table) == 2 and all(len(row) == 2 and all(0 <= v <= 1 for v in row) for row in table)
    assert summary["train/saturated_heads"] == sum(v > 0.98 for row in table for v in row)
    # the quick evaluation reads the final snapshot back and reports on the held-out split
    from eval.quick import quick_eval

    result = quick_eval(out)
    assert result["kv_reads_gated"] <= result["kv_reads_full"] and result["ppl_full"] > 1
    # a second run into the same folder is refused rather than overwriting it
    from train.config import RecipeError

    with pytest.raises(RecipeError, match="resume=auto"):
        train(cfg)


def test_trimkv_and_lora_recipes_train(tiny_backbone, tmp_path):
    cfg = load_recipe("trimkv_smollm2_m128", overrides(tiny_backbone, tmp_path / "t", **{
        "trainer.max_steps": 3, "gate.trimkv.budget": 8, "gate.trimkv.hidden": 16, "data.chat_template": "false",
        "trainer.snapshot_every_n_steps": 2, "trainer.checkpoint_every_n_steps": 1, "trainer.keep_checkpoints": 1}))
    assert train(cfg)["steps"] == 3
    occupancy = scalars(tmp_path / "t", "train/occupancy")
    assert len(occupancy) == 3 and all(v > 0 for v in occupancy.values())
    # TRIM-KV has no CR family: scheduled snapshots; and only the newest Lightning checkpoint is kept
    assert sorted(p.name for p in (tmp_path / "t" / "snapshots").iterdir()) == ["final", "step000002"]
    assert sorted(p.name for p in (tmp_path / "t" / "resume_state").iterdir()) == ["last.ckpt", "step000003.ckpt"]
    lora = load_recipe("dms_smollm2_cr4", overrides(tiny_backbone, tmp_path / "l", **{
        "model.backbone_mode": "lora", "trainer.max_steps": 2, "model.lora.target_modules": "[q_proj,v_proj]"}))
    assert train(lora)["steps"] == 2
    from checkpoints import load_snapshot

    model, _, meta = load_snapshot(tmp_path / "l" / "snapshots" / "final")
    assert meta.backbone_mode == "lora" and any("lora_A" in n for n, _ in model.named_parameters())


def test_killed_run_resumes_with_identical_losses(tiny_backbone, tmp_path):
    """SIGKILL a run once it has a checkpoint; resume=auto must reproduce the uninterrupted losses."""
    steps = 10
    straight = tmp_path / "straight"
    train(load_recipe("dms_smollm2_cr4", overrides(tiny_backbone, straight, **{"trainer.max_steps": steps})))
    killed = tmp_path / "killed"
    cmd = [sys.executable, "-m", "train", *overrides(tiny_backbone, killed, **{"trainer.max_steps": 200})]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while not list((killed / "resume_state").glob("step*.ckpt")) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    done_before = int(sorted((killed / "resume_state").glob("step*.ckpt"))[-1].stem[4:])
    assert done_before < steps, "the run must be killed part-way"
    train(load_recipe("dms_smollm2_cr4", overrides(tiny_backbone, killed, **{"trainer.max_steps": steps, "resume": "auto"})))
    expected, resumed = scalars(straight, "train/loss"), scalars(killed, "train/loss")
    after = [s for s in range(done_before, steps)]
    assert after and all(resumed[s] == pytest.approx(expected[s], rel=1e-5, abs=1e-6) for s in after), (expected, resumed)


def test_two_process_ddp_matches_one_process_on_the_same_global_batch(tiny_backbone, tmp_path):
    """2 CPU processes (gloo), micro-batch 1 each == 1 process, batch 2: same data, noise and losses."""
    common = {"trainer.max_steps": 4, "trainer.accelerator": "cpu", "trainer.val_check_interval": 100}
    single = tmp_path / "single"
    train(load_recipe("dms_smollm2_cr4", overrides(tiny_backbone, single, **common, **{"data.batch_size": 2})))
    ddp = tmp_path / "ddp"
    args = overrides(tiny_backbone, ddp, **common, **{"data.batch_size": 1, "trainer.devices": 2, "strategy.name": "ddp"})
    done = subprocess.run([sys.executable, "-m", "train", *args], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    one, two = scalars(single, "train/loss"), scalars(ddp, "train/loss")
    assert sorted(one) == sorted(two) == [0, 1, 2, 3]
    for step in one:
        assert two[step] == pytest.approx(one[step], rel=1e-4, abs=1e-5), (one, two)


OFFLOAD_OPTIMIZER = {"strategy.offload_optimizer": True}
OFFLOAD_ALL = {**OFFLOAD_OPTIMIZER, "strategy.offload_parameters": True}


@pytest.mark.parametrize("stage,backbone_mode,offload", [
    (2, "frozen", {}), (3, "full", {}),
    # ZeRO-Offload steps with DeepSpeedCPUAdam, which compiles on first use (about 2.5 min here)
    pytest.param(2, "frozen", OFFLOAD_OPTIMIZER, marks=pytest.mark.slow),
    pytest.param(3, "full", OFFLOAD_ALL, marks=pytest.mark.slow),
])
def test_deepspeed_zero_on_two_cpu_processes_matches_one_process(tiny_backbone, tmp_path, stage, backbone_mode, offload):
    """DeepSpeed ZeRO-2 (frozen backbone), ZeRO-3 (full fine-tune, separate teacher outside the engine), and
    both with ZeRO-Offload (optimizer state, and for ZeRO-3 the parameters, in host memory)."""
    common = {"trainer.max_steps": 3, "trainer.accelerator": "cpu", "trainer.val_check_interval": 100,
              "model.backbone_mode": backbone_mode, "optim.lr": 1e-3}
    single = tmp_path / "single"
    train(load_recipe("dms_smollm2_cr4", overrides(tiny_backbone, single, **common, **{"data.batch_size": 2})))
    zero = tmp_path / "zero"
    args = overrides(tiny_backbone, zero, **common, **{"data.batch_size": 1, "trainer.devices": 2,
                                                         "strategy.name": "deepspeed", "strategy.zero_stage": stage,
                                                         **offload})
    done = subprocess.run([sys.executable, "-m", "train", *args], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    one, two = scalars(single, "train/loss"), scalars(zero, "train/loss")
    assert sorted(one) == sorted(two) == [0, 1, 2]
    for step in one:
        assert two[step] == pytest.approx(one[step], rel=1e-4, abs=1e-5), (one, two)
    # snapshots hold full tensors even when ZeRO-3 partitioned the parameters
    from checkpoints import load_snapshot

    model, _, meta = load_snapshot(zero / "snapshots" / "final")
    single_model, _, _ = load_snapshot(single / "snapshots" / "final")
    for (name, p), (_, q) in zip(model.named_parameters(), single_model.named_parameters()):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-4, msg=name)
    # and export as Hugging Face folders that load back to the same gated model
    import models
    from checkpoints import export_snapshot

    exported = models.from_pretrained(str(export_snapshot(zero / "snapshots" / "final", tmp_path / "export")))
    ids = torch.randint(0, 100, (1, 40), generator=torch.Generator().manual_seed(0))
    models.set_gate_mode(model, "infer")
    with torch.no_grad():
        assert torch.equal(exported(ids).logits, model(ids).logits)


# train/loss of the first steps of the tiny runs below, recorded on 2026-11-30 with the code before the gate
# kinds moved to models/gates/ (and unchanged by that move). Runs are compared with each other elsewhere
# (resume, DDP, ZeRO); these numbers catch a change that shifts every run alike.
RECORDED_LOSSES = {
    "dms": [1.4922942170869646e-07, 0.25887924432754517, 0.27130475640296936],
    "trimkv": [11.337300300598145, 11.360944747924805, 11.321527481079102],
}


@pytest.mark.parametrize("kind", ["dms", "trimkv"])
def test_first_losses_match_the_recorded_values(kind, tiny_backbone, tmp_path):
    recipe = {"dms": "dms_smollm2_cr4", "trimkv": "trimkv_smollm2_m128"}[kind]
    extra = {"trainer.max_steps": 3, "trainer.val_check_interval": 3}
    if kind == "trimkv":
        extra.update({"gate.trimkv.budget": 8, "gate.trimkv.hidden": 16, "data.chat_template": "false"})
    train(load_recipe(recipe, overrides(tiny_backbone, tmp_path / "run", **extra)))
    losses = scalars(tmp_path / "run", "train/loss")
    assert [losses[step] for step in range(3)] == pytest.approx(RECORDED_LOSSES[kind], rel=1e-4, abs=1e-6)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_node_torchrun(args: list[str]) -> list[subprocess.Popen]:
    """Two torchrun launches on localhost, one per simulated node (`--node-rank 0|1`, gloo), each in its own
    process group so a test can kill a node with everything it started."""
    port = _free_port()
    return [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                              "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port),
                              "-m", "train", *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
            for node in (0, 1)]


def _kill_launch(proc: subprocess.Popen) -> list[psutil.Process]:
    """SIGKILL a torchrun launch and every process it started: its workers run in sessions of their own, so
    killing the launch's process group alone leaves them training (and writing checkpoints) after the test."""
    try:
        family = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        family = []
    os.killpg(proc.pid, signal.SIGKILL)
    for child in family:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
    proc.wait()
    psutil.wait_procs(family, timeout=60)
    return family


@pytest.mark.slow
@pytest.mark.ci
def test_two_torchrun_nodes_match_one_process_and_resume_after_kill(tiny_backbone, tmp_path):
    """`torchrun --nnodes 2 --node-rank 0|1` on localhost computes what one process computes for the same global
    batch (4 sequences: accumulation 2 x batch 2 in one process, accumulation 2 x 2 nodes x micro-batch 1), and a
    run whose two nodes are killed resumes to the same losses."""
    steps = 6
    common = {"trainer.max_steps": steps, "trainer.accelerator": "cpu", "trainer.val_check_interval": 100,
              "trainer.global_batch_size": 4}
    single = tmp_path / "single"
    train(load_recipe("dms_smollm2_cr4", overrides(tiny_backbone, single, **common, **{"data.batch_size": 2})))
    nodes = {"data.batch_size": 1, "trainer.devices": 1, "trainer.num_nodes": 2, "strategy.name": "ddp"}
    two = tmp_path / "two_nodes"
    procs = _two_node_torchrun(overrides(tiny_backbone, two, **common, **nodes))
    for proc in procs:
        assert proc.wait(timeout=600) == 0, proc.stderr.read()[-3000:]
    one, both = scalars(single, "train/loss"), scalars(two, "train/loss")
    assert sorted(one) == sorted(both) == list(range(steps))
    for step in one:
        assert both[step] == pytest.approx(one[step], rel=1e-4, abs=1e-5), (one, both)

    # kill both nodes once a checkpoint exists, then resume both with resume=auto
    killed = tmp_path / "killed"
    procs = _two_node_torchrun(overrides(tiny_backbone, killed, **{**common, **nodes, "trainer.max_steps": 200}))
    deadline = time.time() + 300
    while not list((killed / "resume_state").glob("step*.ckpt")) and time.time() < deadline \
            and all(p.poll() is None for p in procs):
        time.sleep(0.05)
    family = [child for proc in procs for child in _kill_launch(proc)]
    assert family and not any(child.is_running() and child.status() != psutil.STATUS_ZOMBIE for child in family)
    done_before = int(sorted((killed / "resume_state").glob("step*.ckpt"))[-1].stem[4:])
    assert done_before < steps, "the run must be killed part-way"
    procs = _two_node_torchrun(overrides(tiny_backbone, killed, **common, **nodes, **{"resume": "auto"}))
    for proc in procs:
        assert proc.wait(timeout=600) == 0, proc.stderr.read()[-3000:]
    resumed = scalars(killed, "train/loss")
    assert all(resumed[s] == pytest.approx(one[s], rel=1e-4, abs=1e-5) for s in range(done_before, steps)), (one, resumed)
