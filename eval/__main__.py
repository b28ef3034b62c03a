"""python -m eval <command> ...: evaluate gate snapshots."""

from __future__ import annotations

import argparse
import json
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eval", description="Evaluate RetroKV gate snapshots.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="command")
    quick = sub.add_parser("quick", help="teacher-forced KL, perplexity and KV reads of a snapshot on its held-out split")
    quick.add_argument("path", help="a snapshot folder or a run's output_dir (uses its final snapshot)")
    quick.add_argument("--max-batches", type=int, default=None, help="evaluate at most this many batches")
    args = parser.parse_args(argv)
    try:
        if args.command == "quick":
            from eval.quick import quick_eval

            result = quick_eval(args.path, args.max_batches)
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
