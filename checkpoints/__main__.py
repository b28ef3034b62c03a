"""python -m checkpoints <command> ...: inspect a run's gate snapshots (its CR family), export them as
Hugging Face folders, push those to the Hub."""

from __future__ import annotations

import argparse
import json
import sys
import time

from checkpoints.snapshot import SnapshotError, list_snapshots, read_meta


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m checkpoints", description="Inspect, export and push RetroKV gate snapshots.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="command")
    listing = sub.add_parser("list", help="the snapshots of a run (one per integer CR reached, and final)")
    listing.add_argument("run_dir")
    show = sub.add_parser("show", help="the metadata of one snapshot")
    show.add_argument("snapshot")
    export = sub.add_parser("export", help="write a snapshot (or a run's CR family) as Hugging Face model folders")
    export.add_argument("source", help="a run folder (with snapshots/) or one snapshot folder")
    export.add_argument("--out", required=True, help="the folder to create (with --all: one subfolder per snapshot)")
    which = export.add_mutually_exclusive_group()
    which.add_argument("--cr", type=int, help="a run's snapshot at this CR (default: its final snapshot)")
    which.add_argument("--all", action="store_true", help="every snapshot of the run")
    export.add_argument("--gates-only", action="store_true",
                        help="store the trained tensors and a reference to the base model (frozen backbones)")
    export.add_argument("--lora", choices=("merged", "separate"), default="merged",
                        help="a LoRA snapshot's adapters: merged into the weights (default), or a separate peft adapter "
                             "beside the gates and a base reference")
    export.add_argument("--max-shard-size", default="5GB", help="safetensors shard size (default 5GB)")
    push = sub.add_parser("push", help="upload an exported folder (or a CR family folder) to the Hugging Face Hub")
    push.add_argument("folder")
    push.add_argument("--repo-id", required=True, help="ORG/NAME")
    push.add_argument("--private", action="store_true")
    push.add_argument("--revision", help="branch for a single export (default main; a family uses crK branches)")
    push.add_argument("--dry-run", action="store_true", help="list what would be uploaded, with sizes, and stop")
    args = parser.parse_args(argv)
    try:
        if args.command == "list":
            family = list_snapshots(args.run_dir)
            if not family:
                print(f"error: no snapshots under {args.run_dir}/snapshots", file=sys.stderr)
                return 2
            for folder, meta in family:
                print(f"{folder}\tcr={meta.cr:.2f}\tstep={meta.step}\tgate={meta.gate_kind}\tbackbone={meta.backbone}")
        elif args.command == "show":
            shown = read_meta(args.snapshot).to_json()
            shown.pop("config")
            print(json.dumps(shown, indent=2))
        elif args.command == "export":
            from checkpoints.export import export_run, folder_size

            start = time.perf_counter()
            written = export_run(args.source, args.out, cr=args.cr, every=args.all, gates_only=args.gates_only,
                                 lora=args.lora, max_shard_size=args.max_shard_size)
            for folder in written:
                print(f"{folder}\t{folder_size(folder) / 1e6:.1f} MB")
            print(f"exported {len(written)} folder(s) in {time.perf_counter() - start:.1f} s")
        else:
            from checkpoints.hub import describe, plan_uploads
            from checkpoints.hub import push as upload

            if args.dry_run:
                print(describe(plan_uploads(args.folder, args.revision), args.repo_id))
                print("dry run: nothing uploaded")
            else:
                for url in upload(args.folder, args.repo_id, private=args.private, revision=args.revision):
                    print(url)
    except (SnapshotError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
