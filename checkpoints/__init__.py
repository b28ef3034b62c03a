"""Gate snapshots (the CR family of a run): save, list, load."""

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

__all__ = ["SnapshotError", "SnapshotMeta", "list_snapshots", "load_snapshot", "read_meta", "recover_snapshots", "save_snapshot", "trained_tensors"]
