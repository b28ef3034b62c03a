"""python -m eval <command> ...: evaluate gate snapshots and eviction policies.

    python -m eval SUITE [key=value ...] [--device D] [--dtype T]   a sweep from recipes/eval/SUITE.yaml
    python -m eval report RESULTS_DIR                               markdown report + PNG plots of a sweep
    python -m eval retention SNAPSHOT [--tokens N]                  what a snapshot keeps, per layer x head
    python -m eval quick RUN_OR_SNAPSHOT [--device D] [--dtype T]   teacher-forced check on the run's own split
"""

from __future__ import annotations

import argparse
import json
import sys

from recipes import RecipeError


def main(argv: list[str] | None = None) -> int:
    from eval.config import available_eval_recipes

    suites = available_eval_recipes()
    parser = argparse.ArgumentParser(prog="python -m eval", description="Evaluate RetroKV snapshots and eviction "
                                     "policies through the bounded-memory engine.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="command")
    for suite in suites:
        p = sub.add_parser(suite, help=f"run recipes/eval/{suite}.yaml (key=value overrides)")
        p.add_argument("overrides", nargs="*", help="key=value, e.g. budgets=[64,128] snapshots=[outputs/RUN]")
        _device_flags(p)
    report = sub.add_parser("report", help="markdown report with Pareto plots of a results folder")
    report.add_argument("results_dir")
    retention = sub.add_parser("retention", help="heatmap of the tokens a snapshot keeps per layer x KV head")
    retention.add_argument("snapshot")
    retention.add_argument("--tokens", type=int, default=1024, help="held-out essay tokens streamed (default 1024)")
    retention.add_argument("--out", default=None, help="PNG path (default SNAPSHOT/eval/retention.png)")
    _device_flags(retention)
    quick = sub.add_parser("quick", help="teacher-forced KL, perplexity and KV reads of a snapshot on its held-out split")
    quick.add_argument("path", help="a snapshot folder or a run's output_dir (uses its final snapshot)")
    quick.add_argument("--max-batches", type=int, default=None, help="evaluate at most this many batches")
    _device_flags(quick)
    args, rest = parser.parse_known_args(argv)
    stray = [r for r in rest if "=" not in r or r.startswith("-") or args.command not in suites]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if args.command in suites:
        args.overrides += rest  # key=value given after a flag

    from checkpoints.snapshot import SnapshotError
    from eval.streaming import EvalError

    try:
        if args.command == "quick":
            from eval.quick import quick_eval

            result = quick_eval(args.path, args.max_batches, device=_device(args.device), dtype=args.dtype)
        elif args.command == "report":
            from eval.report import write_report

            result = {"report": str(write_report(args.results_dir))}
        elif args.command == "retention":
            from eval.report import retention_heatmap

            result = {"heatmap": str(retention_heatmap(args.snapshot, args.tokens, args.out, _device(args.device),
                                                       args.dtype))}
        else:
            from eval.config import load_eval_recipe
            from eval.sweep import Sweep

            overrides = list(args.overrides)
            overrides += [f"device={args.device}"] if args.device else []
            overrides += [f"dtype={args.dtype}"] if args.dtype else []
            cfg = load_eval_recipe(args.command, overrides)
            records = Sweep(cfg).run()
            result = {"results": cfg.output_dir, "cells": len(records),
                      "next": f"python -m eval report {cfg.output_dir}"}
    except (FileNotFoundError, RecipeError, EvalError, SnapshotError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2))
    return 0


def _device_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default=None, help="auto (CUDA when present), cpu, cuda or cuda:N")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])


def _device(name: str | None) -> str:
    from eval.sweep import resolve_device

    return resolve_device(name or "auto")


if __name__ == "__main__":
    sys.exit(main())
