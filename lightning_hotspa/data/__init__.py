"""Data side of HotSPa: offline sources, tokenizers, the token cache and token-budget mini-batches.

Nothing here imports torch, pyarrow, tokenizers or datasets at import time; the optional
packages are imported when the feature that needs them is used. The DataModule (which needs torch
and Lightning) is exported lazily for the same reason.
"""

from typing import Any

from .cache import CorpusStats, TokenizedCorpus, cache_key, default_cache_dir
from .errors import DataError, MissingDependencyError
from .lengths import LENGTH_PROFILES, LengthGenerator, fit_lognormal, length_summary
from .minibatches import ChunkRef, MiniBatchSampler, chunk_tokens, split_into_chunks
from .sources import (
    SOURCE_KINDS,
    DocumentSource,
    HFDiskSource,
    JsonlSource,
    ParquetSource,
    SourceStats,
    StdlibCorpusSource,
    SyntheticSource,
    TextFolderSource,
    build_source,
)
from .tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, build_tokenizer

__all__ = [
    "LENGTH_PROFILES",
    "SOURCE_KINDS",
    "ByteTokenizer",
    "ChunkRef",
    "CorpusStats",
    "DataError",
    "DocumentSource",
    "HFDiskSource",
    "HotSPaDataModule",
    "HFTokenizer",
    "JsonlSource",
    "LengthGenerator",
    "MiniBatchSampler",
    "MissingDependencyError",
    "ParquetSource",
    "PlanDataLoader",
    "SourceStats",
    "StdlibCorpusSource",
    "StepPlanDataset",
    "SyntheticSource",
    "TextFolderSource",
    "TokenizedCorpus",
    "Tokenizer",
    "build_source",
    "build_tokenizer",
    "cache_key",
    "chunk_tokens",
    "default_cache_dir",
    "fit_lognormal",
    "length_summary",
    "pin_rank_plan",
    "split_into_chunks",
]

_LAZY = {"HotSPaDataModule", "PlanDataLoader", "StepPlanDataset", "pin_rank_plan"}


def __getattr__(name: str) -> Any:
    """Import the DataModule (torch, Lightning) only when it is asked for."""
    if name in _LAZY:
        from . import datamodule

        return getattr(datamodule, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
