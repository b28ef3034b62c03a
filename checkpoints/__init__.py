"""Gate snapshots (the CR family of a run): save, list, load."""

from checkpoints.snapshot import SnapshotError, list_snapshots, load_snapshot, read_meta, save_snapshot, trained_tensors

__all__ = ["SnapshotError", "list_snapshots", "load_snapshot", "read_meta", "save_snapshot", "trained_tensors"]
