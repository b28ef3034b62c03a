"""Recipes and the CLI: every shipped recipe resolves and dry-runs offline; bad input is named."""

import json

import pytest

from recipes import RecipeError, available_recipes
from train.__main__ import main as train_main
from train.config import load_recipe, total_steps

SCALE_RECIPES = ["dms_qwen7b_cr8", "dms_llama1b_cr4", "trimkv_qwen3_4b_m512"]
CPU_RECIPES = ["dms_smollm2_cr4", "trimkv_smollm2_m128", "dms_smollm2_long", "dms_smollm2_long_cr4", "trimkv_smollm2_long",
               "dms_smollm2_traces"]


def dry_run_report(args: list[str], capsys) -> dict:
    """The JSON report `python -m train ARGS --dry-run` prints."""
    assert train_main([*args, "--dry-run"]) == 0
    out = capsys.readouterr().out
    return json.loads(out[out.index("{\n") : out.rindex("}") + 1])


def test_shipped_recipes():
    assert {*CPU_RECIPES, *SCALE_RECIPES} <= set(available_recipes())


@pytest.mark.parametrize("name", CPU_RECIPES)
def test_cpu_recipes_dry_run_on_the_embedded_model(name, capsys):
    report = dry_run_report([f"recipe={name}"], capsys)
    assert report["gate_parameters"] > 0 and report["steps"] == total_steps(load_recipe(name))


def test_every_recipe_opens_with_the_command_that_runs_it():
    from recipes import RECIPES_DIR

    for path in [*RECIPES_DIR.glob("*.yaml"), *RECIPES_DIR.glob("eval/*.yaml")]:
        first = path.read_text().splitlines()[0]
        runner = "train recipe=" + path.stem if path.parent == RECIPES_DIR else "eval " + path.stem
        assert first.startswith(f"# python -m {runner}"), (path, first)


@pytest.mark.parametrize("name", SCALE_RECIPES)
def test_scale_recipes_dry_run_without_downloading(name, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    report = dry_run_report([f"recipe={name}"], capsys)
    cfg = load_recipe(name)
    assert report["family"] == cfg.model.architecture.model_type
    assert report["gate_parameters"] + report["repurposed_query_neurons"] > 0 and report["backbone_parameters"] > 1e8
    if cfg.gate.kind == "dms" and cfg.gate.dms.source == "query_neuron":
        arch = cfg.model.architecture
        assert report["repurposed_query_neurons"] == arch.num_hidden_layers * arch.num_key_value_heads
    assert report["strategy"] == "DeepSpeedStrategy" or report["strategy"] == "CPUDeepSpeedStrategy"


@pytest.mark.parametrize("nodes,accumulate", [(1, 128), (2, 64), (4, 32)])
def test_global_batch_stays_fixed_as_nodes_are_added(nodes, accumulate):
    """The 7B recipe states 1024 sequences per optimizer step; accumulation absorbs devices x nodes."""
    from train.run import batch_figures, dry_run

    cfg = load_recipe("dms_qwen7b_cr8", [f"trainer.num_nodes={nodes}"])
    figures = batch_figures(cfg, 8)
    assert figures == {"ranks": 8 * nodes, "micro_batch_per_rank": 1, "accumulate_grad_batches": accumulate,
                       "global_batch_sequences": 1024, "tokens_per_step": 1024 * 8192}
    if nodes == 2:
        report = dry_run(cfg)
        assert report["tokens_per_step"] == 8_388_608 and report["accumulate_grad_batches"] == 64
        memory = report["memory_per_rank"]  # full fine-tune, bf16, ZeRO-2 over 16 ranks
        params = report["backbone_parameters"]
        assert memory["weights_gb"] == memory["teacher_gb"] == round(2 * params / 1e9, 2)
        assert memory["optimizer_gb"] == pytest.approx(12 * params / 16 / 1e9, abs=0.02)
        assert memory["gradients_gb"] == pytest.approx(2 * params / 16 / 1e9, abs=0.02)


def test_memory_per_rank_follows_the_zero_stage():
    from train.run import memory_per_rank

    def total(*overrides):
        cfg = load_recipe("dms_qwen7b_cr8", list(overrides))
        return memory_per_rank(cfg, params_total=1_000_000_000, params_trained=1_000_000_000, ranks=10)

    assert total("strategy.name=ddp")["total_gb"] == 2 + 2 + 12 + 2
    assert total("strategy.zero_stage=1")["total_gb"] == 2 + 2 + 1.2 + 2
    assert total("strategy.zero_stage=2")["total_gb"] == 2 + 0.2 + 1.2 + 2
    assert total("strategy.zero_stage=3")["total_gb"] == 0.2 + 0.2 + 1.2 + 0.2  # the teacher is partitioned too
    assert total("strategy.zero_stage=2", "strategy.offload_optimizer=true")["optimizer_gb"] == 0
    frozen = memory_per_rank(load_recipe("dms_smollm2_cr4"), params_total=10**9, params_trained=10**6, ranks=1)
    assert frozen["teacher_gb"] == 0 and frozen["weights_gb"] == 4 and frozen["optimizer_gb"] == 0.01


def test_devices_per_node_reads_every_form_lightning_accepts():
    from train.config import devices_per_node

    def count(devices):
        return devices_per_node(load_recipe("dms_smollm2_cr4", [f"trainer.devices={devices}", "trainer.accelerator=cpu"]))

    assert [count("3"), count("[0,2]"), count("'0,1,2'"), count("'1,'"), count("auto")] == [3, 2, 3, 1, 1]


def test_paper_numbers_in_the_qwen7b_recipe():
    cfg = load_recipe("dms_qwen7b_cr8")
    assert cfg.model.backbone == "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B"
    assert (cfg.data.max_length, cfg.gate.dms.window, cfg.schedule.cr_final, cfg.schedule.steps_per_cr) == (8192, 256, 8, 100)
    assert cfg.optim.lr == 3e-5 and cfg.trainer.precision.startswith("bf16")
    assert cfg.trainer.devices == 8 and cfg.strategy.name == "deepspeed"
    assert total_steps(cfg) >= 700


def test_default_recipe_and_overrides():
    cfg = load_recipe("dms_smollm2_cr4", ["trainer.max_steps=7", "gate.dms.window=8", "optim.betas=[0.8,0.9]"])
    assert cfg.recipe == "dms_smollm2_cr4" and cfg.model.backbone == "smollm2-135m"
    assert (cfg.trainer.max_steps, cfg.gate.dms.window, cfg.optim.betas) == (7, 8, [0.8, 0.9])
    assert cfg.output_dir == "outputs/dms_smollm2_cr4"


@pytest.mark.parametrize("args,message", [
    (["recipe=nope"], r"unknown recipe 'nope'; available recipes: .*dms_smollm2_cr4"),
    (["optim.lrr=1"], r"unknown key 'optim.lrr'; did you mean 'lr'\? valid keys here: .*betas"),
    (["trainer.max_steps=ten"], r"trainer.max_steps.*ten"),
    (["gate.dms.window=-1"], r"gate.dms.window=-1 is invalid"),
    (["schedule.cr_final=0.5"], r"schedule.cr_final=0.5 is invalid; a compression ratio is >= 1"),
    (["gate.dms.window=300"], r"gate.dms.window=300 leaves nothing to evict.*max_length=256"),
    (["gate.kind=h2o"], r"gate.kind='h2o' is invalid; valid: 'dms', 'trimkv'"),
    (["strategy.zero_stage=4"], r"strategy.zero_stage=4 is invalid"),
    (["recipe=trimkv_smollm2_m128", "gate.trimkv.budget=0"], r"budget=0 is invalid"),
    (["trainer.max_steps"], r"not key=value"),
    (["trainer.max_steps=0"], r"trainer.max_steps=0 is invalid; valid: -1 .* or a step count >= 1"),
    (["trainer.max_steps=-7"], r"trainer.max_steps=-7 is invalid"),
    (["schedule.hold_steps=-100"], r"schedule.hold_steps=-100 is invalid; it must be >= 0"),
    (["optim.grad_clip=-1"], r"optim.grad_clip=-1.0 is invalid; it must be >= 0"),
    (["recipe=trimkv_smollm2_m128", "gate.trimkv.budget=4096"], r"budget=4096 leaves nothing to evict.*max_length=512"),
    (["loss.chunk_tokens=0"], r"loss.chunk_tokens=0 is invalid; it must be >= 1"),
    (["trainer.global_batch_size=0"], r"trainer.global_batch_size=0 is invalid; it must be >= 1"),
    (["trainer.global_batch_size=3", "trainer.devices=2"], r"global_batch_size=3 is not a multiple of devices \(2\) x "
     r"trainer.num_nodes \(1\) x data.batch_size \(1\) = 2; valid nearby: 2 or 4"),
    (["--local_rank=x"], r"'--local_rank=x': the local rank must be a non-negative integer"),
    (["trainer.devices=0"], r"trainer.devices=0 is invalid; valid: a count >= 1"),
    (["data.eval_samples=-1"], r"data.eval_samples=-1 is invalid; it must be >= 0"),
    (["loss.temperature=0"], r"loss.temperature=0.0 is invalid; it must be > 0"),
    (["--fast"], r"unknown option"),
])
def test_bad_input_is_named(args, message, capsys):
    assert train_main(args) == 2
    import re

    assert re.search(message, capsys.readouterr().err), args


@pytest.mark.parametrize("text,message", [
    ("optim: [1,\n lr", r"bad.yaml is not valid YAML: .*line 1"),
    ("- 1\n- 2\n", r"bad.yaml holds a YAML list; a recipe is a mapping"),
    ("", r"bad.yaml is empty"),
])
def test_broken_recipe_files_are_named(tmp_path, text, message):
    from recipes import load_structured
    from train.config import RunConfig

    (tmp_path / "bad.yaml").write_text(text)
    with pytest.raises(RecipeError, match=message):
        load_structured(RunConfig, tmp_path, "bad")


def test_help_lists_recipes(capsys):
    assert train_main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "dms_qwen7b_cr8" in out and "--dry-run" in out


def test_other_clis_have_help():
    import subprocess
    import sys

    for module, word in (("eval", "quick"), ("checkpoints", "list")):
        done = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True)
        assert done.returncode == 0 and word in done.stdout


def test_resolved_config_round_trips():
    from omegaconf import OmegaConf

    from train.config import RunConfig, to_yaml

    cfg = load_recipe("trimkv_smollm2_m128")
    again = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RunConfig), OmegaConf.create(to_yaml(cfg))))
    assert again == cfg


def test_impossible_backbone_length_is_caught_by_dry_run():
    from train.run import dry_run

    cfg = load_recipe("dms_llama1b_cr4", ["data.max_length=200000"])
    with pytest.raises(RecipeError, match="max_position_embeddings"):
        dry_run(cfg)
