"""Offline document sources: each yields ``(doc_id, text_or_bytes)`` in a fixed, sorted order.

Text records (jsonl, chat jsonl, parquet string and binary columns, hf_disk) follow one UTF-8 policy,
:func:`~.source_base.utf8_problem`: invalid bytes and lone surrogates are bad records. Files of a
text folder (and the stdlib corpus) are documents as raw bytes, for the byte tokenizer, by design.

Order matters because mini-batch composition is a pure function of (data, seed, epoch, step):
the same files must give the same document indices on every rank and every run. Bad data is
either an error naming the file and line/row (``on_bad_record="raise"``, the default) or is
skipped and counted (``"skip"``); empty documents are always skipped and counted, since a
zero-length document trains nothing. Each source also has a ``fingerprint()`` (paths, sizes,
mtimes or generator parameters) that the token cache hashes, so edits invalidate the cache.
"""

from __future__ import annotations

import json
import os
import sys
import sysconfig
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from .chat import ChatJsonlSource
from .errors import BadRecordPolicy, DataError, require
from .lengths import LengthGenerator
from .source_base import (  # noqa: F401  (re-exported: their public home)
    Document,
    DocumentSource,
    SourceStats,
    _existing,
    _rel,
    files_fingerprint,
    list_files,
    utf8_problem,
)

DEFAULT_TEXT_SUFFIXES: tuple[str, ...] = tuple(
    ".txt .md .rst .py .c .h .cc .cpp .hpp .java .js .ts .go .rs .sh".split()
)
TEST_DIR_NAMES: frozenset[str] = frozenset({"test", "tests", "idle_test"})


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
        problem = utf8_problem(text)
        if problem:
            self._bad(where, f"text field {self.text_field!r}: {problem}")
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

    ``text_field`` may be a string or binary column; a binary value must be UTF-8, as every text
    record must (:func:`~.source_base.utf8_problem`). A null value is a bad record (named by
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
                    problem = None if value is None else utf8_problem(value)
                    if value is None:
                        self._bad(f"{f} row {row}", f"null {self.text_field!r}")
                    elif problem:
                        self._bad(f"{f} row {row}", f"column {self.text_field!r}: {problem}")
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
            elif utf8_problem(text):
                self._bad(where, f"text field {self.text_field!r}: {utf8_problem(text)}")
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
    "chat_jsonl": ChatJsonlSource,
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
