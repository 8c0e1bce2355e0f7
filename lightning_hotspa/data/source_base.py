"""The base of every document source: iteration with empty / bad-record accounting, a fingerprint,
and the file listing helpers the file-based sources share (kept apart so that source modules can
live in their own files without importing each other)."""

from __future__ import annotations

import abc
import os
from collections.abc import Callable, Collection, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .errors import BadRecordPolicy, DataError, check_policy

__all__ = ["Document", "DocumentSource", "SourceStats", "files_fingerprint", "list_files", "utf8_problem"]

Document = tuple[str, bytes | str]

_MAX_NOTES = 20


@dataclass
class SourceStats:
    """What one full pass over a source saw; reset at the start of every pass."""

    documents: int = 0
    empty_skipped: int = 0
    bad_records_skipped: int = 0
    bad_files_skipped: int = 0
    notes: list[str] = field(default_factory=list)

    def note(self, message: str) -> None:
        """Keep the first few skip reasons, so a skipped record can still be found."""
        if len(self.notes) < _MAX_NOTES:
            self.notes.append(message)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class DocumentSource(abc.ABC):
    """Base of all sources: iteration with empty/bad-record accounting, plus a fingerprint."""

    def __init__(self, on_bad_record: BadRecordPolicy = "raise") -> None:
        self.on_bad_record = check_policy(on_bad_record)
        self.stats = SourceStats()

    def __iter__(self) -> Iterator[Document]:
        self.stats = SourceStats()
        for doc_id, doc in self._documents():
            if len(doc) == 0:
                self.stats.empty_skipped += 1
                continue
            self.stats.documents += 1
            yield doc_id, doc

    @abc.abstractmethod
    def _documents(self) -> Iterator[Document]:
        """All documents, empty ones included (the base class counts and drops those)."""

    @abc.abstractmethod
    def fingerprint(self) -> dict[str, Any]:
        """JSON-able identity: changes whenever the yielded documents could change."""

    def _bad(self, where: str, reason: str, *, whole_file: bool = False) -> None:
        """Apply the bad-data policy: raise naming ``where``, or count and remember it."""
        message = (
            f"{type(self).__name__}: bad {'file' if whole_file else 'record'} at {where}: {reason}"
        )
        if self.on_bad_record == "raise":
            raise DataError(message)
        if whole_file:
            self.stats.bad_files_skipped += 1
        else:
            self.stats.bad_records_skipped += 1
        self.stats.note(message)


def utf8_problem(doc: bytes | str) -> str | None:
    """Why a text record breaks the UTF-8 policy (every text source alike: jsonl, chat jsonl, parquet
    string or binary columns, hf_disk): bytes that are not UTF-8, or a lone surrogate (a JSON
    ``\\ud800`` escape) that no UTF-8 text holds; None if it is fine.

    Args:
        doc: one record's text.
    """
    try:
        (doc.encode("utf-8") if isinstance(doc, str) else bytes(doc).decode("utf-8"))
    except UnicodeEncodeError as exc:
        return f"lone surrogate {doc[exc.start]!r} at character {exc.start} (not UTF-8 text)"  # type: ignore[index]
    except UnicodeDecodeError as exc:
        return f"not UTF-8 text (byte {exc.start}: {bytes(doc)[exc.start:exc.start + 1]!r})"
    return None


def _existing(path: str | os.PathLike[str], what: str) -> Path:
    p = Path(path).expanduser()
    if not p.exists():
        raise DataError(f"{what}: path does not exist: {str(p)!r}")
    return p


def list_files(
    root: Path,
    suffixes: Collection[str],
    *,
    what: str,
    skip_dir: Callable[[str], bool] = lambda name: False,
) -> list[Path]:
    """Files under ``root`` with one of ``suffixes``, sorted by relative path (hidden names skipped).

    ``os.walk`` without following links keeps the walk finite; sorting the relative POSIX path
    makes the order the same on every machine whatever the file system returns.
    """
    if root.is_file():
        return [root]
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and not skip_dir(d)]
        for name in filenames:
            if not name.startswith(".") and name.endswith(tuple(suffixes)):
                found.append(Path(dirpath) / name)
    if not found:
        raise DataError(f"{what}: no files ending in {sorted(suffixes)} under {str(root)!r}")
    return sorted(found, key=lambda f: f.relative_to(root).as_posix())


def _rel(root: Path, f: Path) -> str:
    return f.name if root.is_file() else f.relative_to(root).as_posix()


def files_fingerprint(root: Path, files: list[Path]) -> dict[str, Any]:
    """Paths, sizes and mtimes: cheap to compute, and any edit or replacement changes them."""
    entries = []
    for f in files:
        st = f.stat()
        entries.append([_rel(root, f), st.st_size, st.st_mtime_ns])
    return {"root": str(root.resolve()), "files": entries}
