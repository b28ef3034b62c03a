"""python -m data traces ...: generate self-distillation traces with a backbone."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m data", description="RetroKV data tools.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="command")
    traces = sub.add_parser("traces", help="the backbone answers prompts; its outputs become training text")
    traces.add_argument("--backbone", default="smollm2-135m", help="embedded name, Hub id or local folder")
    traces.add_argument("--source", default="gsm_symbolic", choices=["gsm_symbolic", "openr1", "hf", "files"],
                        help="where the prompts come from (default: reasoning-gym GSM-style problems)")
    traces.add_argument("--path", default=None, help="dataset name or local file for openr1 / hf / files")
    traces.add_argument("--prompt-column", default="prompt", help="prompt column for hf / files sources")
    traces.add_argument("--num", type=int, default=64, help="number of prompts")
    traces.add_argument("--seed", type=int, default=0)
    traces.add_argument("--max-new-tokens", type=int, default=256)
    traces.add_argument("--batch-size", type=int, default=8)
    traces.add_argument("--dtype", default="float32")
    traces.add_argument("--out", required=True, help="output folder (a datasets folder; reused if present)")
    traces.add_argument("--overwrite", action="store_true")
    args = parser.parse_args(argv)

    import datasets

    from data.sources import DataError, gsm_symbolic, openr1
    from data.traces import generate_traces
    from models import load_backbone

    try:
        if args.source == "gsm_symbolic":
            prompts = gsm_symbolic(args.num, args.seed)["prompt"]
        elif args.source == "openr1":
            prompts = openr1(args.path, "train", False, args.num)["prompt"][: args.num]
        else:
            if not args.path:
                raise DataError("--path is required for --source hf/files")
            ds = datasets.load_dataset("json", data_files=args.path, split="train") if args.source == "files" \
                else datasets.load_dataset(args.path, split="train")
            if args.prompt_column not in ds.column_names:
                raise DataError(f"--prompt-column {args.prompt_column!r} is not a column; columns: {ds.column_names}")
            prompts = ds[args.prompt_column][: args.num]
        model, tokenizer = load_backbone(args.backbone, dtype=args.dtype)
        ds = generate_traces(model, tokenizer, list(prompts), args.out, args.max_new_tokens, args.batch_size, args.overwrite)
    except (DataError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"traces: {len(ds)} rows in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
