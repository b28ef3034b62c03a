"""Data sources, rendering and packing, on small fixtures made here and on the real offline corpora."""

import json
import types

import datasets
import pytest

from data import DataError, RetrofitDataModule, StepSampler, load_source, prepare
from data.config import DataConfig


def cfg(**kw):
    return DataConfig(**{"train_samples": -1, "eval_samples": 0, "max_length": 32, **kw})


@pytest.fixture
def openr1_files(tmp_path):
    rows = [
        {"problem": "What is 2+3?", "answer": "5", "generations": ["2+3 = \\boxed{5}", "I think \\boxed{6}"]},
        {"problem": "What is 10/4?", "answer": "\\frac{5}{2}", "generations": ["It is \\boxed{2.5}", "\\boxed{\\frac{5}{2}}"]},
        {"problem": "Name a prime > 10", "answer": "11", "generations": ["\\boxed{9}"]},
    ]
    path = tmp_path / "openr1.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return path


def test_openr1_keeps_only_math_verified_generations(openr1_files):
    ds = load_source(cfg(source="openr1", path=str(openr1_files)), seed=0, num_rows=-1)
    kept = sorted(ds["completion"])
    assert kept == sorted(["2+3 = \\boxed{5}", "It is \\boxed{2.5}", "\\boxed{\\frac{5}{2}}"])
    assert set(ds.column_names) == {"prompt", "completion", "answer"}


def test_openr1_filter_in_parallel_keeps_the_same_rows(openr1_files, tmp_path):
    rows = openr1_files.read_text().splitlines() * 3
    many = tmp_path / "many.jsonl"
    many.write_text("\n".join(rows))
    one = load_source(cfg(source="openr1", path=str(many)), seed=0, num_rows=-1)
    two = load_source(cfg(source="openr1", path=str(many), num_proc=2), seed=0, num_rows=-1)
    assert len(one) == 9 and one.to_list() == two.to_list()


PREPARE_ONCE = """
import sys, time
from transformers import AutoTokenizer
from data import RetrofitDataModule
from data.config import DataConfig
from models.backbone import embedded_model_dir
tok = AutoTokenizer.from_pretrained(embedded_model_dir())
module = RetrofitDataModule(DataConfig(source="gsm_symbolic", train_samples=40, eval_samples=4, max_length=64, num_proc=2),
                            tok, 0, sys.argv[1])
while time.time() < float(sys.argv[2]):  # start together
    time.sleep(0.01)
prepared = module.prepare_once()
module.setup()
print("PREPARED" if prepared else "READ", len(module.train_set), len(module.eval_set))
"""


def test_concurrent_preparers_prepare_once_and_all_read_it(tmp_path):
    """Several nodes' first processes over one shared cache: one prepares under the lock, the others wait and read."""
    import subprocess
    import sys
    import time

    start = str(time.time() + 8)
    procs = [subprocess.Popen([sys.executable, "-c", PREPARE_ONCE, str(tmp_path), start], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(3)]
    results = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in results]
    lines = sorted(out.strip().splitlines()[-1] for out, _ in results)
    assert [line.split()[0] for line in lines] == ["PREPARED", "READ", "READ"], lines
    assert len({tuple(line.split()[1:]) for line in lines}) == 1  # the same splits everywhere
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name] == []  # no staging folder left behind


def test_openr1_filter_to_nothing_is_a_clear_error(tmp_path, tokenizer):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"problem": "1+1?", "answer": "2", "generations": ["\\boxed{3}"]}))
    raw = load_source(cfg(source="openr1", path=str(path)), seed=0, num_rows=-1)
    with pytest.raises(DataError, match="has no rows"):
        prepare(raw, tokenizer, cfg(source="openr1"), "train")


def test_local_text_files_and_missing_column(tmp_path):
    (tmp_path / "a.jsonl").write_text(json.dumps({"body": "hello world"}) + "\n" + json.dumps({"body": "more"}))
    ds = load_source(cfg(source="files", path=str(tmp_path / "a.jsonl"), text_column="body"), 0, -1)
    assert ds["text"] == ["hello world", "more"]
    with pytest.raises(DataError, match=r"text_column='text' is not a column.*\['body'\]"):
        load_source(cfg(source="files", path=str(tmp_path / "a.jsonl")), 0, -1)
    (tmp_path / "b.txt").write_text("line one\nline two\n")
    txt = load_source(cfg(source="files", path=str(tmp_path / "b.txt")), 0, -1)
    assert txt["text"] == ["line one", "line two"]


@pytest.mark.parametrize("source,name,content,message", [
    ("files", "empty.jsonl", b"", r"empty.jsonl' holds no rows: the file is empty"),
    ("files", "empty.txt", b"", r"empty.txt' holds no rows: the file is empty"),
    ("files", "missing.txt", None, r"missing.txt' does not exist; data.source=files reads a local file or folder"),
    ("files", "bad.jsonl", b'{"text": "a"}\n{bad json\n', r"cannot read .*bad.jsonl as json: .*each line of a .jsonl file"),
    ("files", "binary.txt", bytes(range(128, 256)) * 20, r"cannot read .*binary.txt as text: .*must be UTF-8"),
    ("traces", "not_a_dataset", "folder", r"not_a_dataset' is a folder but not a saved dataset"),
    ("hf", "no-such-org/no-such-dataset", None, r"cannot load dataset 'no-such-org/no-such-dataset' \(split 'train'\)"),
])
def test_bad_data_paths_get_one_clear_line(tmp_path, monkeypatch, source, name, content, message):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    path = tmp_path / name if "/" not in name else name
    if content == "folder":
        (tmp_path / name).mkdir()
        (tmp_path / name / "x.bin").write_bytes(b"1")
    elif content is not None:
        (tmp_path / name).write_bytes(content)
    with pytest.raises(DataError, match=message):
        load_source(cfg(source=source, path=str(path)), seed=0, num_rows=-1)


def test_the_too_long_error_names_the_split(tokenizer):
    raw = datasets.Dataset.from_list([{"text": "word " * 80}])
    with pytest.raises(DataError, match="no rows are left in the eval split after data.too_long='drop'"):
        prepare(raw, tokenizer, cfg(source="files", packing=False, too_long="drop"), "eval")


def test_packing_joins_documents_with_eos_and_masks_prompts(tokenizer):
    raw = datasets.Dataset.from_list([{"prompt": f"Question {i}?", "completion": "Answer " * 5} for i in range(12)])
    packed = prepare(raw, tokenizer, cfg(source="hf", mask_prompt=True, max_length=48), "train")
    assert all(len(r["input_ids"]) == 48 for r in packed)
    flat = [t for r in packed for t in r["input_ids"]]
    assert flat.count(tokenizer.eos_token_id) >= 1
    counts = eval(packed.info.description)
    assert counts["rows_in"] == 12 and counts["sequences"] == len(packed)
    assert counts["tokens"] + counts["padding"] == 48 * len(packed)
    row = packed[0]
    user = tokenizer.apply_chat_template([{"role": "user", "content": "Question 0?"}], tokenize=False, add_generation_prompt=True)
    n_prompt = len(tokenizer(user, add_special_tokens=False)["input_ids"])
    assert row["loss_mask"][: n_prompt - 1] == [0] * (n_prompt - 1)  # prompt positions do not train ...
    assert row["loss_mask"][n_prompt - 1] == 1  # ... except the last, which predicts the first answer token


def test_packing_starts_every_row_at_a_document_start(tokenizer):
    """Documents of mixed lengths: no row starts mid-document, none is split, padding fills each row's end."""
    texts = [("word " * n).strip() + f" end{i}" for i, n in enumerate([3, 30, 7, 18, 2, 25, 11, 40, 5, 9])]
    raw = datasets.Dataset.from_list([{"text": t} for t in texts])
    packed = prepare(raw, tokenizer, cfg(source="hf", max_length=40, chat_template=False), "train")
    docs = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    eos = tokenizer.eos_token_id
    rebuilt = []
    for row in packed:
        real = [t for t, m in zip(row["input_ids"], row["attention_mask"]) if m]
        assert row["attention_mask"] == [1] * len(real) + [0] * (40 - len(real))  # padding only at the end
        assert all(m == 0 for m, a in zip(row["loss_mask"], row["attention_mask"]) if not a)
        assert real[-1] == eos
        pieces, current = [], []
        for t in real:
            if t == eos:
                pieces.append(current)
                current = []
            else:
                current.append(t)
        assert pieces[0] in [d[:39] for d in docs]  # the row opens with a whole (or truncated) document
        rebuilt += pieces
    assert rebuilt == [d[:39] for d in docs]  # every document once, in order, none split across rows
    counts = eval(packed.info.description)
    assert counts["truncated"] == 1 and counts["padding"] == sum(r["attention_mask"].count(0) for r in packed)


def test_padding_mode_drops_or_truncates_too_long(tokenizer):
    raw = datasets.Dataset.from_list([{"text": "short text"}, {"text": "word " * 200}])
    padded = prepare(raw, tokenizer, cfg(source="hf", packing=False, too_long="truncate"), "train")
    assert len(padded) == 2 and sum(padded[0]["attention_mask"]) < 32 and padded[0]["loss_mask"][-1] == 0
    dropped = prepare(raw, tokenizer, cfg(source="hf", packing=False, too_long="drop"), "train")
    assert len(dropped) == 1 and eval(dropped.info.description)["dropped"] == 1
    only_long = datasets.Dataset.from_list([{"text": "word " * 200}])
    with pytest.raises(DataError, match="no rows are left"):
        prepare(only_long, tokenizer, cfg(source="hf", packing=False, too_long="drop"), "train")


def test_chat_template_required_but_missing(tokenizer):
    raw = datasets.Dataset.from_list([{"prompt": "q", "completion": "a"}])
    bare = types.SimpleNamespace(chat_template=None, name_or_path="bare-tokenizer")
    with pytest.raises(DataError, match="'bare-tokenizer' has no chat template"):
        prepare(raw, bare, cfg(source="hf"), "train")


def test_step_sampler_is_deterministic_strided_and_resumable():
    full = StepSampler(10, seed=3, rank=0, world=1, batch_size=2)
    first = [i for _, i in zip(range(25), iter(full))]
    assert sorted(first[:10]) == list(range(10)) and first[:10] != first[10:20]
    resumed = StepSampler(10, seed=3, rank=0, world=1, batch_size=2, start_batches=4)
    assert [i for _, i in zip(range(17), iter(resumed))] == first[8:25]
    r0 = [i for _, i in zip(range(5), iter(StepSampler(10, 3, 0, 2, 1)))]
    r1 = [i for _, i in zip(range(5), iter(StepSampler(10, 3, 1, 2, 1)))]
    assert sorted(r0 + r1) == list(range(10))


def test_real_offline_corpora(tokenizer, tmp_path):
    gsm = load_source(cfg(source="gsm_symbolic"), seed=1, num_rows=6)
    assert len(gsm) == 6 and all("####" in c or c for c in gsm["completion"]) and gsm["answer"][0]
    essays = load_source(cfg(source="essays"), seed=0, num_rows=5)
    assert len(essays) == 5 and all(len(t) > 2000 for t in essays["text"])
    module = RetrofitDataModule(cfg(source="gsm_symbolic", train_samples=8, eval_samples=2, max_length=64), tokenizer, 0, tmp_path)
    module.setup()
    assert len(module.train_set) > 0 and len(module.eval_set) > 0
    batch = next(iter(module.val_dataloader()))
    assert batch["input_ids"].shape[1] == 64


def test_self_generated_traces_are_batched_saved_and_reused(tokenizer, tmp_path):
    from data.traces import generate_traces
    from tests.conftest import tiny_model

    model = tiny_model("llama", vocab_size=len(tokenizer))
    prompts = [f"What is {i} plus {i}?" for i in range(5)]
    out = tmp_path / "traces"
    ds = generate_traces(model, tokenizer, prompts, out, max_new_tokens=6, batch_size=2)
    assert ds["prompt"] == prompts and all(isinstance(c, str) for c in ds["completion"])
    # generation is batched with left padding: each answer equals the one generated alone
    alone = generate_traces(model, tokenizer, prompts[3:4], tmp_path / "alone", max_new_tokens=6, batch_size=1)
    assert alone["completion"][0] == ds["completion"][3]
    again = generate_traces(model, tokenizer, ["ignored"], out)  # reused, not regenerated
    assert again["prompt"] == prompts
    rows = load_source(cfg(source="traces", path=str(out)), seed=0, num_rows=-1)
    packed = prepare(rows, tokenizer, cfg(source="traces", max_length=16), "train")
    assert len(packed) >= 1
    with pytest.raises(DataError, match="must be a folder written by"):
        load_source(cfg(source="traces", path=str(tmp_path / "nope")), seed=0, num_rows=-1)


def test_essay_training_rows_never_touch_the_held_out_tenth():
    from data.sources import essay_text, essays

    train, heldout, whole = essay_text("train"), essay_text("heldout"), essay_text("all")
    assert whole.startswith(train) and whole.rstrip().endswith(heldout.rstrip())
    assert 0.08 < len(heldout) / len(whole) < 0.12
    flat = lambda text: " ".join(text.split())  # noqa: E731
    train, heldout = flat(train), flat(heldout)
    spans = [flat(p)[:200] for row in essays(-1, seed=0)["text"] for p in row.split("\n\n") if len(flat(p)) > 200]
    assert len(spans) > 100 and all(span in train and span not in heldout for span in spans)
    with pytest.raises(ValueError, match="essay split 'test' is invalid"):
        essay_text("test")


def test_essay_documents_fill_long_rows(tokenizer):
    """Every essay document fills a 1024-token row, so long-row recipes train on full rows, not padding."""
    from data.sources import essays

    short, long = essays(-1, seed=0), essays(-1, seed=0, max_length=1024)
    assert len(long) < len(short)
    lengths = [len(tokenizer(text)["input_ids"]) for text in long.select(range(40))["text"]]
    assert min(lengths) >= 1024, min(lengths)
