"""Offline document sources: each yields ``(doc_id, text_or_bytes)`` in a fixed, sorted order.

Order matters because mini-batch composition is a pure function of (data, seed, epoch, step):
the same files must give the same document indices on every rank and every run. Bad data is
either an error naming the file and line/row (``on_bad_record="raise"``, the default) or is
skipped and counted (``"skip"``); empty documents are always skipped and counted, since a
zero-length document trains nothing. Each source also has a ``fingerprint()`` (paths, sizes,
mtimes or generator parameters) that the token cache hashes, so edits invalidate the cache.
"""

from __future__ import annotations

import abc
import json
import os
import sys
import sysconfig
from collections.abc import Callable, Collection, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .errors import BadRecordPolicy, DataError, check_policy, require
from .lengths import LengthGenerator

Document = tuple[str, bytes | str]

DEFAULT_TEXT_SUFFIXES: tuple[str, ...] = tuple(
    ".txt .md .rst .py .c .h .cc .cpp .hpp .java .js .ts .go .rs .sh".split()
)
TEST_DIR_NAMES: frozenset[str] = frozenset({"test", "tests", "idle_test"})
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


class TextFolderSource(DocumentSource):
    """Every text file under a folder (recursive) is one document, read as raw bytes.

    Bytes, not str: the byte tokenizer takes any bytes, so a file in a legacy encoding is data,
    not a crash. ``exclude_dirs`` names directories to skip at any depth.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        suffixes: Collection[str] = DEFAULT_TEXT_SUFFIXES,
        *,
        exclude_dirs: Collection[str] = (),
        on_bad_record: BadRecordPolicy = "raise",
    ) -> None:
        super().__init__(on_bad_record)
        self.root = _existing(path, type(self).__name__)
        self.suffixes = tuple(suffixes)
        if not self.suffixes:
            raise DataError(f"{type(self).__name__}: suffixes must not be empty")
        self.exclude_dirs = frozenset(exclude_dirs)
        self.files = list_files(
            self.root, self.suffixes, what=type(self).__name__, skip_dir=self._skip_dir
        )

    def _skip_dir(self, name: str) -> bool:
        return name in self.exclude_dirs

    def _documents(self) -> Iterator[Document]:
        for f in self.files:
            try:
                data = f.read_bytes()
            except OSError as exc:
                self._bad(str(f), f"unreadable file ({exc})", whole_file=True)
                continue
            yield _rel(self.root, f), data

    def fingerprint(self) -> dict[str, Any]:
        return {
            "type": type(self).__name__,
            "suffixes": list(self.suffixes),
            "exclude_dirs": sorted(self.exclude_dirs),
            "on_bad_record": self.on_bad_record,
            **files_fingerprint(self.root, self.files),
        }


class StdlibCorpusSource(TextFolderSource):
    """The bundled real corpus: the running interpreter's standard-library ``.py`` files.

    It needs no download and is honestly messy (CPython 3.11: 28 empty files, 4 that are not
    UTF-8), which is why documents stay bytes. ``site-packages``/``dist-packages`` and caches are
    never included; test directories (``test``, ``tests``, ``idle_test``) only if
    ``include_tests``. Document ids are paths relative to the stdlib root.
    """

    _ALWAYS_EXCLUDED = frozenset({"site-packages", "dist-packages", "__pycache__"})

    def __init__(
        self, include_tests: bool = True, *, on_bad_record: BadRecordPolicy = "raise"
    ) -> None:
        self.include_tests = include_tests
        excluded = set(self._ALWAYS_EXCLUDED) | (set() if include_tests else set(TEST_DIR_NAMES))
        super().__init__(
            stdlib_root(), (".py",), exclude_dirs=excluded, on_bad_record=on_bad_record
        )

    def fingerprint(self) -> dict[str, Any]:
        return {**super().fingerprint(), "python": sys.version, "include_tests": self.include_tests}


def stdlib_root() -> Path:
    """Where the running interpreter's standard library lives (the base one inside a venv)."""
    return Path(sysconfig.get_paths()["stdlib"])


class JsonlSource(DocumentSource):
    """``.jsonl`` files (one JSON object per line); ``text_field`` holds the document.

    Blank lines are ignored (a trailing newline is common, not an error). Document ids are
    ``<file>:<line>`` unless ``id_field`` names a field to use instead.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        text_field: str = "text",
        *,
        id_field: str | None = None,
        on_bad_record: BadRecordPolicy = "raise",
    ) -> None:
        super().__init__(on_bad_record)
        self.root = _existing(path, type(self).__name__)
        self.text_field = text_field
        self.id_field = id_field
        self.files = list_files(self.root, (".jsonl",), what=type(self).__name__)

    def _documents(self) -> Iterator[Document]:
        for f in self.files:
            try:
                handle = f.open("rb")
            except OSError as exc:
                self._bad(str(f), f"unreadable file ({exc})", whole_file=True)
                continue
            with handle:
                for lineno, line in enumerate(handle, start=1):
                    if not line.strip():
                        continue
                    doc = self._parse(f, lineno, line)
                    if doc is not None:
                        yield doc

    def _parse(self, f: Path, lineno: int, line: bytes) -> Document | None:
        where = f"{f} line {lineno}"
        try:
            record = json.loads(line)
        except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
            self._bad(where, f"not valid JSON ({exc})")
            return None
        if not isinstance(record, dict):
            self._bad(where, f"expected a JSON object, got {type(record).__name__}")
            return None
        if self.text_field not in record:
            self._bad(
                where, f"missing text field {self.text_field!r} (keys: {sorted(record)[:10]})"
            )
            return None
        text = record[self.text_field]
        if not isinstance(text, str):
            self._bad(
                where, f"text field {self.text_field!r} is {type(text).__name__}, not a string"
            )
            return None
        doc_id = f"{_rel(self.root, f)}:{lineno}"
        if self.id_field is not None and self.id_field in record:
            doc_id = str(record[self.id_field])
        return doc_id, text

    def fingerprint(self) -> dict[str, Any]:
        return {
            "type": type(self).__name__,
            "text_field": self.text_field,
            "id_field": self.id_field,
            "on_bad_record": self.on_bad_record,
            **files_fingerprint(self.root, self.files),
        }


class ParquetSource(DocumentSource):
    """``.parquet`` files read with pyarrow in record batches (bounded memory).

    ``text_field`` may be a string or binary column. A null value is a bad record (named by
    row); an unreadable file, a missing column or a column of another type is a bad file.
    Document ids are ``<file>:<row>``.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        text_field: str = "text",
        *,
        batch_size: int = 1024,
        on_bad_record: BadRecordPolicy = "raise",
    ) -> None:
        super().__init__(on_bad_record)
        self.root = _existing(path, type(self).__name__)
        self.text_field = text_field
        self.batch_size = batch_size
        self.files = list_files(self.root, (".parquet",), what=type(self).__name__)
        require("pyarrow.parquet", type(self).__name__)

    def _documents(self) -> Iterator[Document]:
        pa = require("pyarrow", type(self).__name__)
        pq = require("pyarrow.parquet", type(self).__name__)
        for f in self.files:
            try:
                pf = pq.ParquetFile(f)
            except (OSError, pa.ArrowException) as exc:
                self._bad(str(f), f"unreadable parquet file ({exc})", whole_file=True)
                continue
            if not self._column_ok(pa, f, pf.schema_arrow):
                continue
            yield from self._rows(pa, f, pf)

    def _column_ok(self, pa: Any, f: Path, schema: Any) -> bool:
        if self.text_field not in schema.names:
            self._bad(
                str(f), f"no column {self.text_field!r} (columns: {schema.names})", whole_file=True
            )
            return False
        kind = schema.field(self.text_field).type
        t = pa.types
        if not (
            t.is_string(kind)
            or t.is_large_string(kind)
            or t.is_binary(kind)
            or t.is_large_binary(kind)
        ):
            self._bad(
                str(f),
                f"column {self.text_field!r} has type {kind}, not string/binary",
                whole_file=True,
            )
            return False
        return True

    def _rows(self, pa: Any, f: Path, pf: Any) -> Iterator[Document]:
        row = 0
        rel = _rel(self.root, f)
        try:
            for batch in pf.iter_batches(batch_size=self.batch_size, columns=[self.text_field]):
                for value in batch.column(0).to_pylist():
                    if value is None:
                        self._bad(f"{f} row {row}", f"null {self.text_field!r}")
                    else:
                        yield f"{rel}:{row}", value
                    row += 1
        except (OSError, pa.ArrowException) as exc:
            self._bad(str(f), f"unreadable parquet data after row {row} ({exc})", whole_file=True)

    def fingerprint(self) -> dict[str, Any]:
        return {
            "type": type(self).__name__,
            "text_field": self.text_field,
            "on_bad_record": self.on_bad_record,
            **files_fingerprint(self.root, self.files),
        }


class HFDiskSource(DocumentSource):
    """A Hugging Face ``datasets`` dataset saved with ``save_to_disk`` (needs ``datasets``).

    A saved ``DatasetDict`` needs ``split``. Records are validated like JSONL records; document
    ids are ``<split or "data">:<row>``.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        text_field: str = "text",
        *,
        split: str | None = None,
        on_bad_record: BadRecordPolicy = "raise",
    ) -> None:
        super().__init__(on_bad_record)
        self.root = _existing(path, type(self).__name__)
        self.text_field = text_field
        self.split = split
        require("datasets", f"{type(self).__name__}({str(self.root)!r})")

    def _dataset(self) -> Any:
        datasets = require("datasets", type(self).__name__)
        ds = datasets.load_from_disk(str(self.root))
        if isinstance(ds, dict):  # DatasetDict is a dict subclass
            if self.split is None or self.split not in ds:
                raise DataError(
                    f"HFDiskSource: {str(self.root)!r} holds splits {sorted(ds)}; "
                    f"pass split= one of them (got {self.split!r})"
                )
            ds = ds[self.split]
        return ds

    def _documents(self) -> Iterator[Document]:
        prefix = self.split or "data"
        for row, record in enumerate(self._dataset()):
            where = f"{self.root} row {row}"
            text = record.get(self.text_field) if isinstance(record, dict) else None
            if text is None:
                self._bad(where, f"missing or null text field {self.text_field!r}")
            elif not isinstance(text, (str, bytes)):
                self._bad(where, f"text field {self.text_field!r} is {type(text).__name__}")
            else:
                yield f"{prefix}:{row}", text

    def fingerprint(self) -> dict[str, Any]:
        files = sorted((p for p in self.root.rglob("*") if p.is_file()), key=lambda p: p.as_posix())
        return {
            "type": type(self).__name__,
            "text_field": self.text_field,
            "split": self.split,
            "on_bad_record": self.on_bad_record,
            **files_fingerprint(self.root, files),
        }


class SyntheticSource(DocumentSource):
    """Random-byte documents whose lengths follow a :class:`LengthGenerator` profile.

    With the byte tokenizer one byte is one token, so the tokenized lengths are exactly the
    generator's lengths: a whole pipeline (cache, mini-batches, planner) can run on a
    CommonCrawl-like or GitHub-like mix without any download.
    """

    def __init__(
        self, num_documents: int, generator: LengthGenerator | None = None, **gen_kwargs: Any
    ) -> None:
        super().__init__("raise")
        if num_documents < 1:
            raise DataError(f"SyntheticSource num_documents must be >= 1, got {num_documents}")
        if generator is not None and gen_kwargs:
            raise DataError(
                "SyntheticSource: pass either generator= or its keyword arguments, not both"
            )
        self.num_documents = num_documents
        self.generator = generator if generator is not None else LengthGenerator(**gen_kwargs)

    def _documents(self) -> Iterator[Document]:
        rng = np.random.default_rng([self.generator.seed, 2])
        for i, n in enumerate(self.generator.lengths(self.num_documents)):
            yield f"synthetic:{i}", rng.integers(0, 256, size=int(n), dtype=np.uint8).tobytes()

    def fingerprint(self) -> dict[str, Any]:
        return {
            "type": type(self).__name__,
            "num_documents": self.num_documents,
            **self.generator.fingerprint(),
        }


SOURCE_KINDS: dict[str, type[DocumentSource]] = {
    "text": TextFolderSource,
    "jsonl": JsonlSource,
    "parquet": ParquetSource,
    "hf_disk": HFDiskSource,
    "stdlib": StdlibCorpusSource,
    "synthetic": SyntheticSource,
}


def build_source(kind: str, /, **kwargs: Any) -> DocumentSource:
    """Build a source by name (what Hydra configs use): ``build_source("jsonl", path=...)``."""
    try:
        cls = SOURCE_KINDS[kind]
    except KeyError:
        raise DataError(
            f"unknown data source kind {kind!r}; known kinds: {sorted(SOURCE_KINDS)}"
        ) from None
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise DataError(f"build_source({kind!r}): bad arguments {sorted(kwargs)} ({exc})") from exc
