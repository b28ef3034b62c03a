"""`python -m eval report RESULTS_DIR`: a markdown report of a sweep, with PNG plots (matplotlib).

Per task: a table of every cell; score against KV reads per query, mean KV tokens and peak KV tokens, with
each method's Pareto frontier; the integrated improvement of each learned method over each baseline on each
axis; score against CR for a CR family; and a retention heatmap (mean fraction of the text each layer x KV
head keeps) of every learned cell.
"""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from eval.analysis import improvement_at, integrated_improvement, pareto_frontier  # noqa: E402
from eval.costs import realised_mean  # noqa: E402
from eval.streaming import EvalError  # noqa: E402
from eval.sweep import load_records  # noqa: E402

# the cost axes a method is judged on: record field -> (plot label, table column)
AXES = {"reads_per_query": ("KV reads per query (per layer x KV head)", "reads/query"),
        "mean_kv_tokens": ("mean KV tokens (per KV head, over the tokens processed)", "mean KV"),
        "peak_kv_tokens": ("peak KV tokens (per KV head)", "peak KV")}


def family(record: dict) -> str:
    """Which curve a cell belongs to: the baseline policy, or the learned run (its CR family)."""
    if record["learned"]:
        return f"{record['policy']} {Path(record['snapshot']).parent.parent.name}"
    return record["policy"]


def write_report(results_dir: str | Path) -> Path:
    folder = Path(results_dir)
    records = list(load_records(folder).values())
    if not records:
        raise EvalError(f"{folder} holds no finished cells ({folder}/results.jsonl is missing or empty); run a "
                        "sweep into it first: python -m eval SUITE output_dir=" + str(folder))
    plots = folder / "plots"
    plots.mkdir(exist_ok=True)
    first = records[0]
    lines = [f"# RetroKV evaluation: {folder.name}", "",
             f"{len(records)} cells. Backbone `{first['backbone']}`, {first['dtype']} on {first['device']} "
             f"({first['machine']}); torch {first['versions']['torch']}, transformers "
             f"{first['versions']['transformers']}. Costs are per (layer, KV head) of one sequence: *reads/query* "
             "is the mean number of keys a query attends to, *mean KV* the tokens held averaged over the tokens "
             "processed, *peak KV* the most held at once. *matches* names the learned cell whose realised mean "
             "or peak KV tokens a baseline row's budget was chosen to equal.", ""]
    for task in dict.fromkeys(r["task"] for r in records):
        lines += _task_section(task, [r for r in records if r["task"] == task], plots)
    path = folder / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def _task_section(task: str, records: list[dict], plots: Path) -> list[str]:
    higher = records[0]["higher_is_better"]
    name = records[0]["score_name"]
    lines = [f"## {task}", "", f"Score: {name} ({'higher' if higher else 'lower'} is better).", ""]
    for (w, l) in sorted({(r["W"], r["L"]) for r in records}):
        group = [r for r in records if (r["W"], r["L"]) == (w, l)]
        suffix = f"_W{w}_L{l}" if task == "math" else ""
        if task == "math":
            lines += [f"### W = {w}, L = {l}", ""]
        lines += _table(group, task)
        for axis, (label, _) in AXES.items():
            png = plots / f"{task}{suffix}_{axis}.png"
            _frontier_plot(group, axis, label, higher, f"{task}: {name} vs {label}", png)
            lines += [f"![{task} {axis}](plots/{png.name})", ""]
        lines += _improvements(group, higher)
        learned_cr = [r for r in group if r["learned"] and r.get("cr") is not None]
        if len({family(r) for r in learned_cr}) and len(learned_cr) > len({family(r) for r in learned_cr}):
            png = plots / f"{task}{suffix}_cr.png"
            _cr_plot(group, name, png)
            lines += [f"![{task} score vs CR](plots/{png.name})", ""]
    for record in records:
        if record["learned"] and task in ("perplexity", "niah", "variable_tracking") and record["W"] == 1:
            png = plots / f"retention_{task}_{record['key']}.png"
            full = realised_mean(max(record["sequence_lengths"]), record["sequence_lengths"])
            _heatmap(torch.tensor(record["mean_kv_tokens_per_head"]) / full,
                     f"{record['method']} on {task}:\nmean KV tokens relative to the full cache", png)
            lines += [f"![retention {record['method']}](plots/{png.name})", ""]
    return lines


def _table(records: list[dict], task: str) -> list[str]:
    kl = task == "perplexity"
    rows = ["| method | matches | score |" + (" KL |" if kl else "") + " reads/query | read reduction | mean KV | "
            "peak KV | wall s | tokens/s |",
            "|---|---|---|" + ("---|" if kl else "") + "---|---|---|---|---|---|"]
    for r in sorted(records, key=lambda r: (not r["learned"], family(r), r["budget"], r["matches"] is not None)):
        matches = f"{r['matches']['axis'].split('_')[0]} of {r['matches']['of']}" if r["matches"] else ""
        rows.append(f"| {r['method'].split(' (')[0]} | {matches} | {r['score']:.4g} |"
                    + (f" {r['kl']:.3f} |" if kl else "")
                    + f" {r['reads_per_query']:.1f} | {r['read_reduction']:.2f}x | {r['mean_kv_tokens']:.1f} | "
                    f"{r['peak_kv_tokens']} | {r['wall_s']:.0f} | {r['tokens_per_s']:.0f} |")
    plain = [r for r in records if r.get("scores_by") and not r["matches"]]
    if not plain:
        return rows + [""]
    columns = list(dict.fromkeys(k for r in plain for k in r["scores_by"]))
    rows += ["", "Score by task coordinates:", "", "| method | " + " | ".join(columns) + " |",
             "|---|" + "---|" * len(columns)]
    rows += [f"| {r['method']} | " + " | ".join(f"{r['scores_by'].get(c, float('nan')):.2f}" for c in columns) + " |"
             for r in plain]
    return rows + [""]


def _frontiers(records: list[dict], axis: str, higher: bool) -> dict[str, list[tuple[float, float]]]:
    fams: dict[str, list[tuple[float, float]]] = {}
    for r in records:
        if r["policy"] != "full":
            fams.setdefault(family(r), []).append((float(r[axis]), float(r["score"])))
    return {f: pareto_frontier(points, higher) for f, points in fams.items()}


def _frontier_plot(records, axis, label, higher, title, png: Path) -> None:
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for i, (fam, front) in enumerate(sorted(_frontiers(records, axis, higher).items())):
        color = f"C{i % 10}"
        points = [(r[axis], r["score"]) for r in records if family(r) == fam]
        ax.scatter(*zip(*points), color=color, s=18, alpha=0.5)
        ax.plot(*zip(*front), color=color, marker="o", label=fam, linewidth=2 if "@" not in fam and " " in fam else 1.2)
    for r in records:
        if r["policy"] == "full":
            ax.axhline(r["score"], color="black", linestyle="--", linewidth=1, label="full cache")
    ax.set_xlabel(label)
    ax.set_ylabel(records[0]["score_name"])
    if not higher and all(r["score"] > 0 for r in records) and max(r["score"] for r in records) > 3 * min(r["score"] for r in records):
        ax.set_yscale("log")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def _improvements(records: list[dict], higher: bool) -> list[str]:
    learned = sorted({family(r) for r in records if r["learned"]})
    baselines = sorted({family(r) for r in records if not r["learned"] and r["policy"] != "full"})
    if not learned or not baselines:
        return []
    lines = ["Improvement of each learned method over each baseline: the mean score difference over the cost "
             "interval both Pareto frontiers cover (DMS paper); for a learned method measured at one point, the "
             "difference to the baseline's frontier at that point's cost (marked *). Positive = the learned "
             "method is better; - = no shared cost range.",
             "", "| learned | baseline | " + " | ".join(f"over {short}" for _, short in AXES.values()) + " |",
             "|---|---|" + "---|" * len(AXES)]
    fronts = {axis: _frontiers(records, axis, higher) for axis in AXES}
    for a in learned:
        for b in baselines:
            cells = []
            for axis in AXES:
                front_a, front_b = fronts[axis][a], fronts[axis][b]
                value = integrated_improvement(front_a, front_b, higher)
                if value is not None:
                    cells.append(f"{value:+.4g}")
                elif len(front_a) == 1 and (value := improvement_at(front_a[0], front_b, higher)) is not None:
                    cells.append(f"{value:+.4g}*")
                else:
                    cells.append("-")
            lines.append(f"| {a} | {b} | " + " | ".join(cells) + " |")
    return lines + [""]


def _cr_plot(records: list[dict], name: str, png: Path) -> None:
    fig, ax = plt.subplots(figsize=(5.4, 3.8))
    for fam in sorted({family(r) for r in records if r["learned"]}):
        points = sorted((r["cr"], r["score"]) for r in records if family(r) == fam and r.get("cr") is not None)
        ax.plot(*zip(*points), marker="o", label=fam)
    for r in records:
        if r["policy"] == "full":
            ax.axhline(r["score"], color="black", linestyle="--", linewidth=1, label="full cache")
    ax.set_xlabel("compression ratio the snapshot was trained to")
    ax.set_ylabel(name)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def _heatmap(kept: torch.Tensor, title: str, png: Path) -> None:
    fig, ax = plt.subplots(figsize=(3.2 + 0.5 * kept.shape[1], 0.18 * kept.shape[0] + 1.6))
    image = ax.imshow(kept.numpy(), aspect="auto", cmap="viridis", vmin=0, vmax=1)
    ax.set_xlabel("KV head")
    ax.set_ylabel("layer")
    ax.set_xticks(range(kept.shape[1]))
    ax.set_title(title, fontsize=8)
    fig.colorbar(image, ax=ax, label="of the full cache")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def retention_heatmap(snapshot: str, tokens: int, out: str | None, device: str, dtype: str | None) -> Path:
    """Stream `tokens` of held-out essay through a snapshot's own policy and plot what each head keeps."""
    from checkpoints import load_snapshot
    from eval.config import PerplexityTask
    from eval.quick import resolve_snapshot
    from eval.streaming import reference_logprobs, stream_document
    from eval.tasks import heldout_documents

    folder = resolve_snapshot(snapshot)
    model, tokenizer, meta = load_snapshot(folder, dtype=dtype, device=device)
    ids = heldout_documents(PerplexityTask(documents=1, tokens=tokens), tokenizer)[0].to(device)
    budget = int(meta.gate_settings.get("budget", tokens))  # TRIM-KV serves its trained M
    result = stream_document(model, ids, meta.gate_kind, budget, 32, reference_logprobs(model, ids), 0)
    png = Path(out) if out else folder / "eval" / "retention.png"
    png.parent.mkdir(parents=True, exist_ok=True)
    _heatmap(result.stats.mean_tokens.float() / realised_mean(tokens, [tokens]),
             f"{folder.parent.parent.name}/{folder.name}: mean KV tokens relative to the full cache\n"
             f"over {tokens} held-out tokens, "
             f"perplexity {math.exp(float(result.nll.mean())):.2f}", png)
    return png
