"""Gate snapshots (the CR family of a run): save, list, load; export them as Hugging Face folders and push
those to the Hub."""

from checkpoints.export import ExportError, export_run, export_snapshot
from checkpoints.snapshot import (
    SnapshotError,
    SnapshotMeta,
    list_snapshots,
    load_snapshot,
    read_meta,
    recover_snapshots,
    save_snapshot,
    trained_tensors,
)

__all__ = ["ExportError", "SnapshotError", "SnapshotMeta", "export_run", "export_snapshot", "list_snapshots",
           "load_snapshot", "read_meta", "recover_snapshots", "save_snapshot", "trained_tensors"]
