"""python -m checkpoints <command> ...: inspect a run's gate snapshots (its CR family)."""

from __future__ import annotations

import argparse
import json
import sys

from checkpoints.snapshot import SnapshotError, list_snapshots, read_meta


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m checkpoints", description="Inspect RetroKV gate snapshots.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="command")
    listing = sub.add_parser("list", help="the snapshots of a run (one per integer CR reached, and final)")
    listing.add_argument("run_dir")
    show = sub.add_parser("show", help="the metadata of one snapshot")
    show.add_argument("snapshot")
    args = parser.parse_args(argv)
    try:
        if args.command == "list":
            family = list_snapshots(args.run_dir)
            if not family:
                print(f"error: no snapshots under {args.run_dir}/snapshots", file=sys.stderr)
                return 2
            for folder, meta in family:
                print(f"{folder}\tcr={meta.cr:.2f}\tstep={meta.step}\tgate={meta.gate_kind}\tbackbone={meta.backbone}")
        else:
            shown = read_meta(args.snapshot).to_json()
            shown.pop("config")
            print(json.dumps(shown, indent=2))
    except SnapshotError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
