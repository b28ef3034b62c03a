"""Sweeps: methods x tasks x W x L, one JSONL record per cell, resumable.

A method is a training-free policy at a budget (`tova@128`), the full cache, or a learned snapshot (its
own DMS decisions or TRIM-KV top-M). Learned cells run first; then, with `match_memory`, every baseline is
also run at the budget whose realised mean KV tokens equal each learned cell's, and at its peak, so each
comparison can be read at equal memory. A record is appended (one write, fsync) only when its cell is
finished, and finished cells are skipped on the next run, so a killed sweep loses and repeats nothing
but the cell it was in.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import math
import os
import platform
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf
from tqdm import tqdm

from assets import retrokv_version
from eval import tasks as T
from eval.config import EvalConfig
from eval.costs import CostMeter, matched_budget
from eval.engine import Quest
from eval.streaming import EvalError, reference_logprobs, stream_document

RESULTS = "results.jsonl"
HIGHER_IS_BETTER = {"perplexity": False, "niah": True, "variable_tracking": True, "math": True}


@dataclasses.dataclass(frozen=True)
class Method:
    label: str
    policy: str  # a baseline name, or the learned kind ("dms" | "trimkv")
    budget: int | None = None  # None: full = the whole context; learned = `learned_budget` or its own setting
    snapshot: str | None = None
    cr: float | None = None
    matches: tuple | None = None  # (axis, label of the learned cell, target value)


def resolve_device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise EvalError(f"device={name!r} but CUDA is not available here; valid: 'cpu' or 'auto'")
    return name


def learned_methods(cfg: EvalConfig) -> list[Method]:
    """One method per snapshot (a run folder: its final snapshot, or with `family` its whole CR family)."""
    from checkpoints import list_snapshots
    from checkpoints.snapshot import SnapshotError, read_meta
    from eval.quick import resolve_snapshot

    methods = []
    for entry in cfg.snapshots:
        try:
            folders = ([f for f, _ in list_snapshots(entry)] if cfg.family and not (Path(entry) / "retrokv.json").is_file()
                       else [resolve_snapshot(entry)])
            if not folders:
                raise FileNotFoundError(f"{entry} has no snapshots/")
            for folder in folders:
                meta = read_meta(folder)
                if meta.backbone != cfg.backbone:
                    raise EvalError(f"snapshot {folder} was trained on backbone {meta.backbone!r}, but the baseline "
                                    f"rows run on backbone={cfg.backbone!r}; set backbone={meta.backbone} or "
                                    "evaluate snapshots of one base model per sweep")
                kind = meta.gate_kind
                methods.append(Method(label=f"{kind} {folder.parent.parent.name}/{folder.name}", policy=kind,
                                      budget=cfg.learned_budget, snapshot=str(folder), cr=meta.cr))
        except (FileNotFoundError, SnapshotError) as err:
            raise EvalError(f"snapshots item {entry!r}: {err}") from None
    return methods


def baseline_methods(cfg: EvalConfig) -> list[Method]:
    methods = [Method("full", "full")] if "full" in cfg.policies else []
    return methods + [Method(f"{p}@{b}", p, b) for p in cfg.policies if p != "full" for b in cfg.budgets]


def matched_methods(cfg: EvalConfig, record: dict) -> list[Method]:
    """Each baseline at the learned record's realised mean KV tokens, and at its peak."""
    mean_budget = matched_budget(record["mean_kv_tokens"], record["sequence_lengths"])
    out = []
    for policy in cfg.policies:
        if policy == "full":
            continue
        for axis, budget, target in (("mean_kv_tokens", mean_budget, record["mean_kv_tokens"]),
                                     ("peak_kv_tokens", record["peak_kv_tokens"], record["peak_kv_tokens"])):
            if policy == "sink" and budget <= 4:
                continue  # StreamingLLM's 4 sinks need a budget above them
            out.append(Method(f"{policy}@{budget} ({axis.split('_')[0]} of {record['method']})", policy, budget,
                              matches=(axis, record["method"], target)))
    return out


class Sweep:
    def __init__(self, cfg: EvalConfig):
        self.cfg = cfg
        self.out = Path(cfg.output_dir)
        self.device = resolve_device(cfg.device)
        self.records: dict[str, dict] = {}
        self._models: dict[str | None, tuple] = {}
        self._references: dict[int, torch.Tensor] = {}  # full-cache log-probs per document, computed once
        self._docs: list[torch.Tensor] | None = None
        self._task_examples: dict[str, list[T.Example]] = {}

    # --- results folder ---------------------------------------------------------------------------------
    def run(self) -> list[dict]:
        self.out.mkdir(parents=True, exist_ok=True)
        with self._lock():
            self.records = load_records(self.out, repair=True)
            self._write_config()
            learned = learned_methods(self.cfg)  # checks the snapshots before any cell runs
            for task in self.cfg.tasks:
                self._run_task(task, learned)
        return list(self.records.values())

    @contextlib.contextmanager
    def _lock(self):
        with open(self.out / ".lock", "w") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise EvalError(f"another sweep is writing to {self.out}; wait for it or choose another output_dir") from None
            yield

    def _write_config(self) -> None:
        text = OmegaConf.to_yaml(OmegaConf.structured(self.cfg))
        path = self.out / "config.yaml"
        n = 1
        while path.exists() and path.read_text() != text:  # a changed sweep into the same folder: keep both
            n += 1
            path = self.out / f"config.{n}.yaml"
        _atomic_write(path, text.encode())

    # --- cells ------------------------------------------------------------------------------------------
    def _run_task(self, task: str, learned: list[Method]) -> None:
        grid = ([(w, l) for w in self.cfg.samples_w for l in self.cfg.max_length_l] if task == "math"
                else [(1, getattr(self.cfg, task).max_new_tokens if task != "perplexity" else 0)])
        for w, l in grid:
            learned_records = [self._cell(task, m, w, l) for m in learned]
            for method in baseline_methods(self.cfg):
                self._cell(task, method, w, l)
            if self.cfg.match_memory:
                for record in learned_records:
                    for method in matched_methods(self.cfg, record):
                        self._cell(task, method, w, l)

    def _cell(self, task: str, method: Method, w: int, l: int) -> dict:
        settings = dataclasses.asdict(getattr(self.cfg, task))
        identity = {"task": task, "settings": settings, "method": dataclasses.asdict(method), "W": w, "L": l,
                    "seed": self.cfg.seed, "backbone": self.cfg.backbone, "dtype": self.cfg.dtype}
        key = hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:16]
        if key in self.records:
            return self.records[key]
        matches = dict(zip(("axis", "of", "target"), method.matches)) if method.matches else None
        twin = self._same_baseline_cell(task, method, w, l, settings)
        if twin is not None:  # a matched budget that a plain baseline row already ran: same cell, new label
            record = {**twin, "key": key, "method": method.label, "matches": matches, "reused_from": twin["key"]}
            _append(self.out / RESULTS, record)
            self.records[key] = record
            return record
        model, tokenizer = self._model(method.snapshot)
        start = time.perf_counter()
        if task == "perplexity":
            result = self._perplexity(model, tokenizer, method, key)
        else:
            result = self._generation(task, model, tokenizer, method, w, l)
        wall = time.perf_counter() - start
        record = {"key": key, "task": task, "method": method.label, "policy": method.policy, "snapshot": method.snapshot,
                  "cr": method.cr, "learned": method.snapshot is not None, "matches": matches,
                  "W": w, "L": l, "higher_is_better": HIGHER_IS_BETTER[task], **result, "wall_s": round(wall, 2),
                  "tokens_per_s": round(result["tokens_processed"] / wall, 2), "device": self.device,
                  "dtype": self.cfg.dtype, "backbone": self.cfg.backbone, "settings": settings,
                  "versions": _versions(), "machine": f"{platform.machine()} {os.cpu_count()} cores"}
        _append(self.out / RESULTS, record)
        self.records[key] = record
        tqdm.write(f"{task:<17} {method.label:<48} score {record['score']:.4g}  mean KV {record['mean_kv_tokens']:.1f}  "
                   f"peak {record['peak_kv_tokens']}  reads/query {record['reads_per_query']:.1f}  {wall:.0f} s")
        return record

    def _same_baseline_cell(self, task: str, method: Method, w: int, l: int, settings: dict) -> dict | None:
        if method.matches is None:
            return None
        return next((r for r in self.records.values() if r["task"] == task and r["policy"] == method.policy
                     and not r["learned"] and r["budget"] == method.budget and (r["W"], r["L"]) == (w, l)
                     and r["settings"] == settings and r.get("reused_from") is None), None)

    def _model(self, snapshot: str | None):
        if snapshot not in self._models:
            from checkpoints import load_snapshot
            from models import load_backbone

            if snapshot is None:
                self._models[None] = load_backbone(self.cfg.backbone, dtype=self.cfg.dtype, device=self.device)
            else:
                for other in [k for k in self._models if k is not None]:
                    del self._models[other]  # one learned model in memory at a time
                model, tokenizer, _ = load_snapshot(snapshot, dtype=self.cfg.dtype, device=self.device)
                self._models[snapshot] = (model, tokenizer)
        return self._models[snapshot]

    def _budget(self, method: Method, model, context: int) -> int:
        if method.budget is not None:
            if method.snapshot is None and method.matches is None and method.budget >= context:
                raise EvalError(f"budget {method.budget} is not below the longest text ({context} tokens), so "
                                f"{method.policy} would evict nothing; valid budgets: 1 to {context - 1}")
            return method.budget
        if method.policy == "trimkv":
            return int(model.config.retrokv["budget"])
        return context  # full, and DMS without a cap: room for everything

    def _policy(self, method: Method, context: int):
        return Quest(max_length=context) if method.policy == "quest" else method.policy

    def _perplexity(self, model, tokenizer, method: Method, key: str) -> dict:
        cfg = self.cfg.perplexity
        docs = self._documents(tokenizer)
        base, _ = self._model(None)
        meter, nll, kl = CostMeter(), [], []
        budget = self._budget(method, model, cfg.tokens)
        for i, ids in enumerate(tqdm(docs, desc=f"perplexity {method.label}", leave=False)):
            if i not in self._references:
                self._references[i] = reference_logprobs(base, ids.to(self.device))
            result = stream_document(model, ids.to(self.device), self._policy(method, cfg.tokens), budget,
                                     cfg.chunk_size, self._references[i], cfg.score_from)
            meter.add(result.stats, [len(ids)])
            nll.append(result.nll)
            kl.append(result.kl)
        folder = self.out / "per_token"
        folder.mkdir(exist_ok=True)
        with _staged(folder / f"{key}.pt") as tmp:
            torch.save({"nll": nll, "kl": kl, "score_from": cfg.score_from}, tmp)
        mean_nll = float(torch.cat(nll).mean())
        return {"score": math.exp(mean_nll), "score_name": "perplexity", "nll": mean_nll,
                "kl": float(torch.cat(kl).mean()), "budget": budget, "n": len(docs), "per_token": f"per_token/{key}.pt",
                "tokens_processed": sum(len(d) for d in docs), **meter.summary()}

    def _documents(self, tokenizer):
        if self._docs is None:
            self._docs = T.heldout_documents(self.cfg.perplexity, tokenizer)
        return self._docs

    def _examples(self, task: str, tokenizer) -> list[T.Example]:
        cache = self._task_examples
        if task not in cache:
            build = {"niah": T.niah_examples, "variable_tracking": T.variable_tracking_examples, "math": T.math_examples}
            cache[task] = build[task](getattr(self.cfg, task), tokenizer, self.cfg.seed)
        return cache[task]

    def _generation(self, task: str, model, tokenizer, method: Method, w: int, l: int) -> dict:
        from eval.generation import generate

        examples = self._examples(task, tokenizer)
        lengths = [len(tokenizer(e.prompt, add_special_tokens=False).input_ids) for e in examples]
        context = max(lengths) + l
        budget = self._budget(method, model, context)
        sample = task == "math" and w > 1
        outputs, meter, generated = generate(
            model, tokenizer, [e.prompt for e in examples], self._policy(method, context), budget, l,
            samples=w, temperature=self.cfg.math.temperature if sample else 0.0, seed=self.cfg.seed,
            batch_size=self.cfg.batch_size, desc=f"{task} {method.label}")
        scores = []
        for example, outs in zip(examples, outputs):
            if task == "niah":
                scores.append(T.niah_score(outs[0], example.answers))
            elif task == "variable_tracking":
                scores.append(T.contains_all(outs[0], example.answers))
            else:
                scores.append(float(T.math_correct(example.answers[0], T.majority_answer(outs))))
        by = {}
        for example, score in zip(examples, scores):
            key = ", ".join(f"{k}={v}" for k, v in example.meta.items() if k not in ("sample", "index"))
            by.setdefault(key, []).append(score)
        return {"score": sum(scores) / len(scores), "score_name": "accuracy", "budget": budget, "n": len(examples),
                "scores_by": {k: sum(v) / len(v) for k, v in by.items()},
                "outputs": [{"answers": e.answers, "generated": o[:w]} for e, o in zip(examples, outputs)],
                "tokens_processed": sum(lengths) * w + generated, "tokens_generated": generated, **meter.summary()}


# --- the results file -------------------------------------------------------------------------------------
def load_records(folder: str | Path, repair: bool = False) -> dict[str, dict]:
    """Records by key. A last line cut short by a kill is dropped (and, with `repair`, cut from the file)."""
    path = Path(folder) / RESULTS
    if not Path(folder).is_dir():
        raise EvalError(f"{folder} is not a results folder (no such directory)")
    if not path.is_file():
        return {}
    raw = path.read_bytes()
    records, good_end = {}, 0
    for number, line in enumerate(raw.split(b"\n"), 1):
        if not line.strip():
            good_end += len(line) + 1
            continue
        try:
            record = json.loads(line)
            records[record["key"]] = record
        except (json.JSONDecodeError, KeyError, TypeError):
            if good_end + len(line) < len(raw):  # not the last line: the file is corrupt, not just cut short
                raise EvalError(f"{path} line {number} is not a result record; the file is corrupt "
                                "(remove that line or the folder to start over)") from None
            if repair:
                with open(path, "r+b") as handle:
                    handle.truncate(good_end)
            break
        good_end += len(line) + 1
    return records


def _append(path: Path, record: dict) -> None:
    line = (json.dumps(record, default=_json_default) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
        os.fsync(fd)
    finally:
        os.close(fd)


def _json_default(value):
    if isinstance(value, torch.Tensor):
        return value.tolist()
    return str(value)


@contextlib.contextmanager
def _staged(path: Path):
    tmp = path.with_name(f".{path.name}.tmp")
    yield tmp
    os.replace(tmp, path)


def _atomic_write(path: Path, data: bytes) -> None:
    with _staged(path) as tmp:
        tmp.write_bytes(data)


def _versions() -> dict:
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__, "retrokv": retrokv_version()}

