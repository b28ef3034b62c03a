"""The LightningDataModule the trainer uses: prepared once, cached on disk, deterministic order."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import datasets
import lightning as L
import torch
from torch.utils.data import DataLoader, Sampler

from data.prepare import prepare
from data.sources import load_source

log = logging.getLogger(__name__)

PREPARED_FORMAT = 5  # bump when data.prepare changes its output, so cached preparations are rebuilt


class StepSampler(Sampler[int]):
    """Endless, seeded order over the dataset, strided over ranks, started at a given global offset.

    A fresh permutation per pass (seed + pass). Starting at `start` (micro-batches already consumed)
    makes a resumed run see exactly the batches an uninterrupted run would have seen next.
    """

    def __init__(self, size: int, seed: int, rank: int, world: int, batch_size: int, start_batches: int = 0):
        self.size, self.seed, self.rank, self.world = size, seed, rank, world
        self.batch_size, self.start = batch_size, start_batches * batch_size * world

    def __iter__(self):
        position = self.start
        while True:
            epoch, offset = divmod(position, self.size)
            order = torch.randperm(self.size, generator=torch.Generator().manual_seed(self.seed + epoch)).tolist()
            for index in range(offset, self.size):
                if index % self.world == self.rank:
                    yield order[index]
            position = (epoch + 1) * self.size


def collate(rows: list[dict]) -> dict[str, torch.Tensor]:
    return {key: torch.tensor([r[key] for r in rows]) for key in ("input_ids", "attention_mask", "loss_mask")}


def local_content_fingerprint(path: str | None) -> str | None:
    """A hash of the bytes (and names) of a local data file or folder, so that editing a file prepares the
    data again; None for dataset names and packaged sources."""
    if not path or not Path(path).exists():
        return None
    root = Path(path)
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    digest = hashlib.sha256()
    for file in files:
        digest.update(str(file.relative_to(root) if file != root else file.name).encode())
        with open(file, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()[:16]


class RetrofitDataModule(L.LightningDataModule):
    def __init__(self, data_cfg, tokenizer, seed: int, cache_dir: str | Path):
        super().__init__()
        self.cfg, self.tokenizer, self.seed = data_cfg, tokenizer, seed
        self.cache_dir = Path(cache_dir)
        self.train_set: datasets.Dataset | None = None
        self.eval_set: datasets.Dataset | None = None

    def cache_key(self) -> str:
        """The prepared data's folder name: a hash of everything that changes what preparation produces."""
        fields = {k: getattr(self.cfg, k) for k in ("source", "path", "split", "text_column", "train_samples",
                                                     "eval_samples", "max_length", "packing", "chat_template",
                                                     "mask_prompt", "too_long")}
        blob = json.dumps({**fields, "seed": self.seed, "tokenizer": self.tokenizer.name_or_path,
                           "format": PREPARED_FORMAT, "content": local_content_fingerprint(self.cfg.path)},
                          sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def prepare_data(self) -> None:
        """Lightning calls this on each node's first process; `prepare_once` makes it once per filesystem."""
        self.prepare_once()

    def prepare_once(self) -> bool:
        """Prepare the splits into the cache unless they are there; True if this process prepared them.

        A lock file beside the cache folder serialises preparers: on a filesystem shared by several nodes the
        first node prepares and the others wait, then read what it wrote; node-local caches each prepare
        their own. The work is staged in a private folder and renamed into place, so a killed preparation
        leaves nothing half-written under the key.
        """
        from filelock import FileLock, Timeout

        folder = self.cache_dir / self.cache_key()
        if (folder / "train").is_dir():
            return False
        folder.parent.mkdir(parents=True, exist_ok=True)
        lock = FileLock(str(folder) + ".lock")
        try:
            lock.acquire(timeout=0)
        except Timeout:
            log.info("waiting for another process preparing %s (lock %s)", folder, lock.lock_file)
            lock.acquire()
        try:
            if (folder / "train").is_dir():  # prepared while this process waited
                return False
            self._prepare_into(folder)
            return True
        finally:
            lock.release()

    def _prepare_into(self, folder: Path) -> None:
        total = self.cfg.train_samples + self.cfg.eval_samples if self.cfg.train_samples > 0 else -1
        raw = load_source(self.cfg, self.seed, total)
        n_eval = min(self.cfg.eval_samples, max(len(raw) - 1, 0))
        splits = {"eval": raw.select(range(n_eval)), "train": raw.select(range(n_eval, len(raw)))}
        staging = Path(tempfile.mkdtemp(prefix=f"{folder.name}.tmp-", dir=folder.parent))
        try:
            for name in ("eval", "train"):
                if len(splits[name]) or name == "train":
                    prepare(splits[name], self.tokenizer, self.cfg, name).save_to_disk(str(staging / name))
            try:
                os.rename(staging, folder)
            except OSError:  # a filesystem whose locks do not hold across nodes: the first rename wins
                if not (folder / "train").is_dir():
                    raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    def setup(self, stage: str | None = None) -> None:
        folder = self.cache_dir / self.cache_key()
        if not (folder / "train").is_dir():  # another node's cache, or prepare_data was not called
            self.prepare_once()
        self.train_set = datasets.load_from_disk(str(folder / "train"))
        self.eval_set = datasets.load_from_disk(str(folder / "eval")) if (folder / "eval").is_dir() else None

    def train_dataloader(self) -> DataLoader:
        trainer = self.trainer
        rank, world = (trainer.global_rank, trainer.world_size) if trainer else (0, 1)
        consumed = trainer.global_step * trainer.accumulate_grad_batches if trainer else 0
        sampler = StepSampler(len(self.train_set), self.seed, rank, world, self.cfg.batch_size, consumed)
        return DataLoader(self.train_set, batch_size=self.cfg.batch_size, sampler=sampler, collate_fn=collate,
                          num_workers=self.cfg.num_workers)

    def val_dataloader(self) -> DataLoader | list:
        if not self.eval_set:
            return []
        return DataLoader(self.eval_set, batch_size=self.cfg.batch_size, collate_fn=collate)
