"""Retrofitting data: sources (HF datasets, offline corpora, teacher traces), packing, the DataModule."""

from data.module import RetrofitDataModule, StepSampler, collate
from data.prepare import prepare
from data.sources import DataError, load_source

__all__ = ["RetrofitDataModule", "StepSampler", "collate", "prepare", "DataError", "load_source"]
