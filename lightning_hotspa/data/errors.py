"""Exceptions of the data side, so callers can catch data problems apart from bugs."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Literal

BadRecordPolicy = Literal["raise", "skip"]
BAD_RECORD_POLICIES: tuple[str, ...] = ("raise", "skip")


class DataError(ValueError):
    """Bad input data or data configuration; the message names the file, line, row or value."""


class MissingDependencyError(ImportError):
    """An optional package (pyarrow, tokenizers, datasets) is needed for the requested feature."""


def check_policy(policy: str) -> BadRecordPolicy:
    """Validate an ``on_bad_record`` value early, so a typo is not discovered mid-corpus."""
    if policy not in BAD_RECORD_POLICIES:
        raise DataError(f"on_bad_record must be one of {BAD_RECORD_POLICIES}, got {policy!r}")
    return policy  # type: ignore[return-value]


def require(module: str, feature: str, hint: str | None = None) -> ModuleType:
    """Import an optional dependency lazily, with an error that says what needs it and how to get it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        top = module.split(".")[0]
        raise MissingDependencyError(
            f"{feature} needs the optional package {top!r}, which is not installed "
            f"(pip install {hint or top})"
        ) from exc
