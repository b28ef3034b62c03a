"""The evaluation suite: scorers, frontiers, matched memory, streaming perplexity against a plain forward,
a tiny end-to-end sweep with report, resume after a kill, and the errors a user meets."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import TINY, tiny_model

from eval.analysis import integrated_improvement, pareto_frontier
from eval.costs import matched_budget, realised_mean
from eval.engine import BoundedCache
from eval.streaming import EvalError, reference_logprobs, stream_document
from eval.tasks import contains_all, majority_answer, math_correct, niah_score

ROOT = Path(__file__).resolve().parent.parent


# --- scorers -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("gold, output, ok", [
    ("0.5", "so the answer is \\boxed{\\frac{1}{2}}", True),
    ("1/2", "The answer is $0.5$.", True),
    ("42", "We get \\boxed{42}.", True),
    ("42", "We get \\boxed{41}.", False),
    ("7", "no number given", False),
])
def test_math_verify_grading(gold, output, ok):
    assert math_correct(gold, majority_answer([output])) is ok


def test_majority_vote_takes_the_most_common_answer():
    outputs = ["\\boxed{3}", "\\boxed{5}", "so \\boxed{5}", "nothing"]
    assert math_correct("5", majority_answer(outputs))
    assert not math_correct("3", majority_answer(outputs))
    assert majority_answer(["no answer here", "none"]) is None


def test_niah_exact_match_needs_the_whole_number():
    assert niah_score(" 1234567.", ["1234567"]) == 1.0
    assert niah_score(" 12345678", ["1234567"]) == 0.0  # inside a longer number is not a match
    assert niah_score("1234567 and 7654321", ["7654321", "1111111"]) == 0.5


def test_variable_tracking_counts_each_name():
    assert contains_all("they are: ABCDE, FGHIJ", ["ABCDE", "FGHIJ", "KLMNO"]) == pytest.approx(2 / 3)


# --- frontiers and integrals -------------------------------------------------------------------------------
def test_pareto_frontier_keeps_undominated_points():
    points = [(1, 0.2), (2, 0.1), (2, 0.5), (3, 0.4), (4, 0.9), (4, 0.6)]
    assert pareto_frontier(points) == [(1, 0.2), (2, 0.5), (4, 0.9)]
    # lower is better (perplexity): a point must be lower than every cheaper one
    assert pareto_frontier([(1, 30.0), (2, 20.0), (3, 25.0), (4, 10.0)], higher_is_better=False) == [
        (1, 30.0), (2, 20.0), (4, 10.0)]


def test_integrated_improvement_on_known_frontiers():
    a = [(0.0, 1.0), (2.0, 1.0)]
    b = [(0.0, 0.0), (2.0, 2.0)]  # crosses a at x = 1: the mean difference over [0, 2] is 0
    assert integrated_improvement(a, b) == pytest.approx(0.0)
    c = [(1.0, 0.0), (3.0, 0.0)]  # shared interval [1, 2]: a - c = 1 everywhere
    assert integrated_improvement(a, c) == pytest.approx(1.0)
    assert integrated_improvement(c, a) == pytest.approx(-1.0)
    # b over c on [1, 2]: b goes 1 -> 2, mean 1.5; lower-is-better flips the sign
    assert integrated_improvement(b, c) == pytest.approx(1.5)
    assert integrated_improvement(b, c, higher_is_better=False) == pytest.approx(-1.5)
    assert integrated_improvement(a, [(5.0, 1.0), (6.0, 1.0)]) is None


# --- matched memory ----------------------------------------------------------------------------------------
def test_realised_mean_and_matched_budget():
    # 4 tokens, budget 2: held 1, 2, 2, 2 -> 1.75
    assert realised_mean(2, [4]) == pytest.approx(1.75)
    assert realised_mean(10, [4, 2]) == pytest.approx((1 + 2 + 3 + 4 + 1 + 2) / 6)
    assert matched_budget(1.75, [4]) == 2
    assert matched_budget(1.8, [4]) == 3
    assert matched_budget(0.1, [4]) == 1
    lengths = [300, 500]
    for target in (20.0, 63.5, 200.0):
        b = matched_budget(target, lengths)
        assert realised_mean(b, lengths) >= target > realised_mean(b - 1, lengths) if b > 1 else True


@pytest.mark.parametrize("log", [256, 3])
def test_engine_counts_reads_and_mean_tokens_of_a_window(log, monkeypatch):
    """Chunk size 1: query number t reads min(t, budget + 1) keys and leaves min(t, budget) held; the same
    whether the decode steps' counts are folded in at the end or every 3 steps."""
    import eval.engine.layer

    monkeypatch.setattr(eval.engine.layer, "DECODE_LOG", log)
    model = tiny_model("llama")
    ids = torch.randint(1, 97, (1, 20), generator=torch.Generator().manual_seed(3))
    cache = BoundedCache(model, policy="window", budget=5, chunk_size=1)
    with torch.no_grad():
        for t in range(20):
            model(input_ids=ids[:, t:t + 1], cache=cache, use_cache=True)
    stats = cache.stats()
    heads = TINY["num_hidden_layers"] * TINY["num_key_value_heads"]
    assert stats.query_reads == stats.kv_reads == heads * sum(min(t, 6) for t in range(1, 21))
    assert stats.query_full_reads == heads * sum(range(1, 21))
    assert stats.full_cache_reads == heads * sum(range(1, 21))  # every one-token forward is a decode step
    assert stats.capacity_evictions == heads * (20 - 5) and int(stats.peak_tokens.max()) == 5
    assert float(stats.mean_tokens.mean()) == pytest.approx(realised_mean(5, [20]))


# --- streaming perplexity ----------------------------------------------------------------------------------
@pytest.mark.parametrize("policy, chunk", [("full", 1), ("full", 7), ("window", 4), ("tova", 1)])
def test_streaming_with_room_for_everything_equals_a_plain_forward(policy, chunk):
    model = tiny_model("qwen2")
    ids = torch.randint(1, 97, (40,), generator=torch.Generator().manual_seed(5))
    reference = reference_logprobs(model, ids)
    result = stream_document(model, ids, policy, 64, chunk, reference, score_from=3)
    plain = -reference[3:39].gather(-1, ids[4:40, None])[:, 0]
    torch.testing.assert_close(result.nll, plain, atol=1e-5, rtol=1e-5)
    assert float(result.kl.abs().max()) < 1e-5


def test_streaming_with_eviction_differs_and_too_short_text_is_refused():
    model = tiny_model("llama")
    ids = torch.randint(1, 97, (40,), generator=torch.Generator().manual_seed(5))
    reference = reference_logprobs(model, ids)
    evicting = stream_document(model, ids, "window", 4, 1, reference, score_from=3)
    assert float(evicting.kl.mean()) > 1e-4
    with pytest.raises(EvalError, match="too short"):
        stream_document(model, ids[:10], "window", 4, 1, reference, score_from=9)


# --- end to end on a tiny model with SmolLM2's tokenizer ---------------------------------------------------
@pytest.fixture(scope="module")
def tiny_backbone(tmp_path_factory, tokenizer):
    """A tiny random Llama with SmolLM2's tokenizer, saved as a from_pretrained folder."""
    folder = tmp_path_factory.mktemp("tiny_backbone")
    model = tiny_model("llama", vocab_size=len(tokenizer), max_position_embeddings=2048)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def tiny_snapshot(tmp_path_factory, tiny_backbone):
    """A DMS snapshot of the tiny backbone whose random adapter evicts about half the keys."""
    from checkpoints.snapshot import SnapshotMeta, save_snapshot, trained_tensors
    from models import attach_gates, configure_backbone, load_backbone, model_gates

    model, _ = load_backbone(tiny_backbone)
    attach_gates(model, "dms", source="adapter", window=4)
    model = configure_backbone(model, "frozen")
    generator = torch.Generator().manual_seed(1)
    for gate in model_gates(model):
        gate.proj.weight.data = torch.randn(gate.proj.weight.shape, generator=generator) * 0.3
    run = tmp_path_factory.mktemp("run")
    meta = SnapshotMeta(backbone=tiny_backbone, gate_kind="dms", gate_settings={"source": "adapter", "window": 4},
                        backbone_mode="frozen", cr=2.0, step=10, dtype="float32")
    save_snapshot(trained_tensors(model), run / "snapshots" / "final", meta)
    return str(run)


def sweep_args(tiny_backbone, out, *extra):
    return ["sweep", f"output_dir={out}", f"backbone={tiny_backbone}", "policies=[full,window,tova]", "budgets=[24]",
            "perplexity.documents=1", "perplexity.tokens=64", "perplexity.score_from=8", "perplexity.chunk_size=8",
            "niah.context_lengths=[160]", "niah.depths=[0.5]", "niah.samples=2", "niah.max_new_tokens=4",
            "variable_tracking.context_lengths=[300]", "variable_tracking.samples=2",
            "variable_tracking.max_new_tokens=4", "batch_size=2", "--device", "cpu", *extra]


def test_tiny_sweep_and_report(tmp_path, tiny_backbone, tiny_snapshot):
    from eval.__main__ import main
    from eval.sweep import load_records

    out = tmp_path / "sweep"
    args = sweep_args(tiny_backbone, out, f"snapshots=[{tiny_snapshot}]",
                      "tasks=[perplexity,niah,variable_tracking,math]", "math.samples=2", "samples_w=[1,2]",
                      "max_length_l=[6]")
    assert main(args) == 0
    records = list(load_records(out).values())
    tasks = {r["task"] for r in records}
    assert tasks == {"perplexity", "niah", "variable_tracking", "math"}
    learned = [r for r in records if r["learned"]]
    matched = [r for r in records if r["matches"]]
    assert learned and matched
    for r in matched:  # each matched row was chosen from its learned cell's realised memory
        of = next(x for x in learned if x["method"] == r["matches"]["of"] and x["task"] == r["task"]
                  and x["W"] == r["W"])
        if r["matches"]["axis"] == "mean_kv_tokens":
            assert r["budget"] == matched_budget(of["mean_kv_tokens"], of["sequence_lengths"])
        else:
            assert r["budget"] == of["peak_kv_tokens"]
    for r in records:
        assert r["kv_reads"] <= r["kv_reads_full"]
        assert {"score", "W", "L", "wall_s", "tokens_per_s", "peak_kv_tokens", "mean_kv_tokens", "versions"} <= set(r)
    assert {r["W"] for r in records if r["task"] == "math"} == {1, 2}
    full = next(r for r in records if r["task"] == "perplexity" and r["policy"] == "full")
    assert full["kl"] < 1e-5 and full["read_reduction"] == pytest.approx(1.0)
    # a second run finds every cell done and runs nothing
    before = (out / "results.jsonl").read_text()
    assert main(args) == 0
    assert (out / "results.jsonl").read_text() == before

    assert main(["report", str(out)]) == 0
    report = (out / "report.md").read_text()
    pngs = sorted((out / "plots").glob("*.png"))
    assert pngs and all(p.stat().st_size > 1000 for p in pngs)
    for png in pngs:
        assert f"plots/{png.name}" in report
    assert "Improvement of each learned method" in report and "retention" in report
    assert "| over reads/query | over mean KV | over peak KV |" in report
    assert (out / "plots" / "perplexity_mean_kv_tokens.png").is_file()


def test_resume_after_kill_loses_and_duplicates_nothing(tmp_path, tiny_backbone):
    from eval.sweep import load_records

    out = tmp_path / "killed"
    args = sweep_args(tiny_backbone, out, "tasks=[perplexity]", "budgets=[8,12,16,20,24]")
    command = [sys.executable, "-m", "eval", *args]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    results = out / "results.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and (not results.exists() or results.read_text().count("\n") < 2):
        time.sleep(0.2)
    process.send_signal(signal.SIGKILL)
    process.wait()
    done_before = load_records(out)
    assert 2 <= len(done_before) < 11, "the kill should land mid-sweep"
    with open(results, "ab") as handle:  # a record cut short by the kill
        handle.write(b'{"key": "abc", "task": "perpl')
    assert subprocess.run(command, cwd=ROOT, env=env, capture_output=True).returncode == 0
    lines = [json.loads(line) for line in results.read_text().splitlines()]
    keys = [r["key"] for r in lines]
    assert len(keys) == len(set(keys)) == 11  # full + 2 policies x 5 budgets, each exactly once
    for key, record in done_before.items():  # finished cells were kept, not rerun
        assert next(r for r in lines if r["key"] == key)["wall_s"] == record["wall_s"]


# --- errors ------------------------------------------------------------------------------------------------
def run_main(args, capsys):
    from eval.__main__ import main

    code = main(args)
    return code, capsys.readouterr().err


@pytest.mark.parametrize("override, message", [
    ("tasks=[nope]", "tasks item='nope' is invalid"),
    ("policies=[lru]", "policies item 'lru' is invalid"),
    ("budgets=[0]", "budgets item 0 is invalid"),
    ("perplexity.score_from=5000", "perplexity.score_from=5000"),
    ("device=tpu", "device='tpu' is invalid"),
    ("bogus=1", "unknown key 'bogus'"),
])
def test_bad_settings_are_one_clear_line(override, message, capsys, tmp_path):
    code, err = run_main(["perplexity", override, f"output_dir={tmp_path}/x"], capsys)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "x").exists()


def test_budget_over_the_text_and_short_texts(capsys, tmp_path, tiny_backbone):
    code, err = run_main(sweep_args(tiny_backbone, tmp_path / "a", "tasks=[perplexity]", "budgets=[64]"), capsys)
    assert code == 2 and "budget 64 is not below the longest text (64 tokens)" in err
    short = tmp_path / "short.txt"
    short.write_text("just a few words\n")
    code, err = run_main(sweep_args(tiny_backbone, tmp_path / "b", "tasks=[perplexity]", "perplexity.source=files",
                                    f"perplexity.path={short}"), capsys)
    assert code == 2 and "fewer than perplexity.documents=1" in err


def test_snapshot_of_another_base_model_is_refused(capsys, tmp_path, tiny_snapshot):
    code, err = run_main(["perplexity", f"snapshots=[{tiny_snapshot}]", f"output_dir={tmp_path}/x"], capsys)
    assert code == 2 and "was trained on backbone" in err and "backbone='smollm2-135m'" in err


def test_unreadable_results_folder(capsys, tmp_path):
    code, err = run_main(["report", str(tmp_path / "missing")], capsys)
    assert code == 2 and "not a results folder" in err
    code, err = run_main(["report", str(tmp_path)], capsys)
    assert code == 2 and "holds no finished cells" in err
    (tmp_path / "results.jsonl").write_text('{"key": "a"}\nnot json\n{"key": "b"}\n')
    code, err = run_main(["report", str(tmp_path)], capsys)
    assert code == 2 and "line 2 is not a result record" in err


def test_math_loaders_read_local_gsm8k_and_math500_files(tmp_path, tokenizer):
    from eval.config import MathTask
    from eval.tasks import math_examples

    gsm = tmp_path / "gsm8k.jsonl"
    gsm.write_text(json.dumps({"question": "Tom has 3 apples and buys 4. How many?", "answer": "3 + 4 = 7\n#### 7"})
                   + "\n" + json.dumps({"question": "Big sum?", "answer": "#### 1,200"}) + "\n")
    examples = math_examples(MathTask(source="gsm8k", path=str(gsm), samples=5), tokenizer, 0)
    assert [e.answers for e in examples] == [["7"], ["1200"]]
    assert "Tom has 3 apples" in examples[0].prompt and "\\boxed" in examples[0].prompt
    math500 = tmp_path / "math500"
    math500.mkdir()
    (math500 / "test.jsonl").write_text(json.dumps({"problem": "Half of one?", "answer": "\\frac{1}{2}"}) + "\n")
    (example,) = math_examples(MathTask(source="math500", path=str(math500)), tokenizer, 0)
    assert math_correct(example.answers[0], majority_answer(["it is \\boxed{0.5}"]))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "no question here"}) + "\n")
    with pytest.raises(EvalError, match="need a question/problem column"):
        math_examples(MathTask(source="files", path=str(bad)), tokenizer, 0)
    with pytest.raises(EvalError, match="cannot be loaded"):
        math_examples(MathTask(source="aime", path=str(tmp_path / "missing.jsonl")), tokenizer, 0)


def test_retention_heatmap_of_a_snapshot(tmp_path, tiny_snapshot):
    from eval.__main__ import main

    png = tmp_path / "retention.png"
    assert main(["retention", tiny_snapshot, "--tokens", "64", "--out", str(png), "--device", "cpu"]) == 0
    assert png.stat().st_size > 1000


def test_improvement_of_a_single_point():
    from eval.analysis import improvement_at

    front = [(1.0, 0.0), (3.0, 1.0)]
    assert improvement_at((2.0, 1.0), front) == pytest.approx(0.5)
    assert improvement_at((5.0, 1.0), front) == pytest.approx(0.0)  # past B's last point B keeps its best
    assert improvement_at((0.5, 1.0), front) is None
    assert improvement_at((2.0, 20.0), [(1.0, 30.0), (3.0, 10.0)], higher_is_better=False) == pytest.approx(0.0)


def test_a_runs_heldout_rows_are_documents_that_start_at_a_document_start(tmp_path, tiny_snapshot, tokenizer):
    """perplexity.source=run reads the held-out split the run set aside, one row per document."""
    import shutil

    from eval.config import PerplexityTask
    from eval.tasks import heldout_documents

    run = tmp_path / "run"
    shutil.copytree(Path(tiny_snapshot) / "snapshots", run / "snapshots")
    meta_path = run / "snapshots" / "final" / "retrokv.json"
    meta = json.loads(meta_path.read_text())
    meta["config"] = {"data": {"train_samples": 6, "eval_samples": 3, "max_length": 96}}
    meta_path.write_text(json.dumps(meta))
    docs = heldout_documents(PerplexityTask(source="run", path=str(run), documents=3, tokens=96, score_from=0), tokenizer)
    start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert len(docs) == 3 and all(2 <= len(d) <= 96 and int(d[0]) == start for d in docs)
    with pytest.raises(EvalError, match="fewer than perplexity.documents=9"):
        heldout_documents(PerplexityTask(source="run", path=str(run), documents=9, tokens=96, score_from=0), tokenizer)
    with pytest.raises(EvalError, match="not a training run"):
        heldout_documents(PerplexityTask(source="run", path=str(tmp_path / "nothing"), documents=1), tokenizer)
