"""Tokenized corpus cached on disk: one flat memory-mapped token file plus document offsets.

Why: tokenizing is the slow part of data loading and every rank (and loader worker) needs the
same token ids; a memory-mapped file is shared through the page cache instead of copied.

Layout of one cache entry, ``<cache_dir>/<key>/``::

    tokens.bin    all documents' ids back to back (uint16 when the vocabulary fits, else int32)
    offsets.npy   int64, len(docs) + 1; document i is tokens[offsets[i]:offsets[i+1]]
    doc_ids.json  the source's id of every kept document
    meta.json     format version, key, dtype, counts and the pass statistics

``key`` hashes the source's fingerprint (paths, sizes, mtimes or generator parameters) and the
tokenizer's fingerprint, so a change to either is a cache miss. An entry is written into a
temporary directory beside it and published with one ``os.replace``: a crash leaves either no
entry or a stray ``.tmp-*`` directory that is never read. On open, sizes and offsets are
checked against ``meta.json``; anything inconsistent is rebuilt, never trusted.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np

from .errors import DataError
from .sources import DocumentSource
from .tokenizer import Tokenizer

log = logging.getLogger(__name__)

CACHE_FORMAT = 1
CACHE_DIR_ENV = "HOTSPA_CACHE_DIR"
_TOKENS, _OFFSETS, _IDS, _META = "tokens.bin", "offsets.npy", "doc_ids.json", "meta.json"


@dataclass
class CorpusStats:
    """Counts of the tokenization pass (kept in ``meta.json``, so a cache hit reports them too)."""

    documents: int = 0
    tokens: int = 0
    empty_skipped: int = 0
    empty_after_tokenization: int = 0
    bad_records_skipped: int = 0
    bad_files_skipped: int = 0


def default_cache_dir() -> Path:
    """``$HOTSPA_CACHE_DIR`` if set, else ``.hotspa_cache/`` in the working directory."""
    return Path(os.environ.get(CACHE_DIR_ENV) or Path.cwd() / ".hotspa_cache")


def cache_key(source: DocumentSource, tokenizer: Tokenizer) -> str:
    """Hex digest of (format, source identity, tokenizer identity)."""
    ident = {
        "format": CACHE_FORMAT,
        "source": source.fingerprint(),
        "tokenizer": tokenizer.fingerprint(),
    }
    blob = json.dumps(ident, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:32]


class TokenizedCorpus:
    """Documents as token arrays: ``len``, ``lengths``, ``doc(i)``, ``doc_id(i)``, ``stats``."""

    def __init__(
        self,
        tokens: np.ndarray,
        offsets: np.ndarray,
        doc_ids: Sequence[str],
        stats: CorpusStats,
        *,
        path: Path | None = None,
        key: str | None = None,
        cache_hit: bool = False,
    ) -> None:
        self.tokens = tokens
        self.offsets = offsets
        self.doc_ids = list(doc_ids)
        self.stats = stats
        self.path = path
        self.key = key
        self.cache_hit = cache_hit
        self.lengths: np.ndarray = np.diff(np.asarray(offsets, dtype=np.int64))

    # -- construction ----------------------------------------------------------------------
    @classmethod
    def build(
        cls,
        source: DocumentSource,
        tokenizer: Tokenizer,
        cache_dir: str | os.PathLike[str] | None = None,
        *,
        use_cache: bool = True,
        batch_docs: int = 64,
        progress: Callable[[Iterable[Any]], Iterable[Any]] | None = None,
    ) -> TokenizedCorpus:
        """Open the cached tokenization of ``source`` or make (and publish) it; a corpus without a
        single non-empty document is a DataError naming the source's input and what was empty.

        Args:
            source: the documents.
            tokenizer: what turns them into token ids.
            cache_dir: where entries live (default :func:`default_cache_dir`).
            use_cache: False: tokenize in memory, write nothing.
            batch_docs: documents per tokenizer call.
            progress: wraps the stream of tokenized documents while they are made (a command's
                progress bar, e.g. ``tools.progress``); None: nothing shown.
        """
        key = cache_key(source, tokenizer)
        if not use_cache:
            return _not_empty(_in_memory(source, tokenizer, batch_docs, key, progress), source)
        root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        final = root / key
        if final.exists():
            try:
                return _not_empty(_open_entry(final, key), source)
            except _InvalidEntry as exc:
                log.warning("token cache %s is invalid (%s); rebuilding", final, exc)
        root.mkdir(parents=True, exist_ok=True)
        log.info("token cache miss: tokenizing %s into %s", type(source).__name__, final)
        _publish(root, final, key, source, tokenizer, batch_docs, progress)
        corpus = _open_entry(final, key)
        corpus.cache_hit = False
        return _not_empty(corpus, source)

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> TokenizedCorpus:
        """Open an existing cache entry directory (e.g. one a log printed), fully validated."""
        try:
            return _open_entry(Path(path), None)
        except _InvalidEntry as exc:
            raise DataError(f"not a valid token cache entry: {str(path)!r} ({exc})") from exc

    @classmethod
    def from_token_arrays(
        cls, docs: Iterable[np.ndarray], doc_ids: Sequence[str] | None = None
    ) -> TokenizedCorpus:
        """An in-memory corpus (synthetic data, tests); empty arrays are dropped and counted."""
        arrays = [np.asarray(d, dtype=np.int32) for d in docs]
        ids = list(doc_ids) if doc_ids is not None else [str(i) for i in range(len(arrays))]
        if len(ids) != len(arrays):
            raise DataError(f"from_token_arrays: {len(arrays)} documents but {len(ids)} doc_ids")
        kept = [(i, a) for i, a in zip(ids, arrays, strict=True) if a.size]
        lengths = np.array([a.size for _, a in kept], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        tokens = np.concatenate([a for _, a in kept]) if kept else np.zeros(0, np.int32)
        stats = CorpusStats(
            documents=len(kept), tokens=int(offsets[-1]), empty_skipped=len(arrays) - len(kept)
        )
        return cls(tokens, offsets, [i for i, _ in kept], stats)

    # -- access ----------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.doc_ids)

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])

    def doc(self, i: int, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Tokens ``[start:stop]`` of document ``i`` as a fresh int32 array."""
        if not 0 <= i < len(self):
            raise IndexError(
                f"document index {i} out of range for a corpus of {len(self)} documents"
            )
        lo, hi = int(self.offsets[i]), int(self.offsets[i + 1])
        a, b, _ = slice(start, stop).indices(hi - lo)
        return np.array(self.tokens[lo + a : lo + max(a, b)], dtype=np.int32)

    def doc_id(self, i: int) -> str:
        return self.doc_ids[i]

    def __reduce__(self) -> tuple[Any, ...]:
        """A cached corpus pickles as its path: loader workers re-map it instead of copying it."""
        if self.path is None:
            return object.__reduce__(self)
        return (_reopen, (str(self.path), self.key, self.cache_hit))

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(documents={len(self)}, tokens={self.num_tokens}, "
            f"path={str(self.path) if self.path else None!r}, cache_hit={self.cache_hit})"
        )


def _reopen(path: str, key: str | None, cache_hit: bool) -> TokenizedCorpus:
    corpus = TokenizedCorpus.open(path)
    if key is not None and corpus.key != key:
        raise DataError(f"token cache entry {path!r} changed while the corpus was pickled")
    corpus.cache_hit = cache_hit
    return corpus


class _InvalidEntry(Exception):
    """A cache directory that must not be trusted (truncated, foreign or half-written)."""


def _batched(items: Iterator[Any], n: int) -> Iterator[list[Any]]:
    while chunk := list(islice(items, n)):
        yield chunk


def _write_durably(path: Path, data: bytes) -> None:
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


class _Tokenized:
    """Tokenizes a source's documents in batches, dropping (and counting) empty results."""

    def __init__(self, source: DocumentSource, tokenizer: Tokenizer, batch_docs: int) -> None:
        self.source, self.tokenizer, self.batch_docs = source, tokenizer, batch_docs
        self.empty_after = 0

    def __iter__(self) -> Iterator[tuple[str, np.ndarray]]:
        vocab = self.tokenizer.vocab_size
        for batch in _batched(iter(self.source), self.batch_docs):
            for (doc_id, _), arr in zip(
                batch, self.tokenizer.encode_batch([d for _, d in batch]), strict=True
            ):
                if arr.size == 0:
                    self.empty_after += 1
                    continue
                if int(arr.min()) < 0 or int(arr.max()) >= vocab:
                    raise DataError(
                        f"tokenizer produced ids outside [0, {vocab}) for document {doc_id!r}"
                    )
                yield doc_id, arr

    def stats(self, offsets: np.ndarray) -> CorpusStats:
        s = self.source.stats
        return CorpusStats(
            documents=len(offsets) - 1,
            tokens=int(offsets[-1]),
            empty_skipped=s.empty_skipped,
            empty_after_tokenization=self.empty_after,
            bad_records_skipped=s.bad_records_skipped,
            bad_files_skipped=s.bad_files_skipped,
        )


def _not_empty(corpus: TokenizedCorpus, source: DocumentSource) -> TokenizedCorpus:
    """``corpus``, or a DataError naming the input (files) and that its documents were empty."""
    if len(corpus):
        return corpus
    s = corpus.stats
    files = [str(f) for f in getattr(source, "files", [])]
    where = getattr(source, "root", None)
    named = (f"{files[0]!r}" if len(files) == 1 else f"{len(files)} files under {str(where)!r}" if files
             else repr(str(where)) if where is not None else "its input")
    raise DataError(f"{type(source).__name__}: no document to train on in {named}: the documents were empty "
                    f"({s.empty_skipped} empty, {s.empty_after_tokenization} empty after tokenization, "
                    f"{s.bad_records_skipped} bad records and {s.bad_files_skipped} bad files skipped; a blank "
                    f"line is no document)")


def _offsets(lengths: list[int]) -> np.ndarray:
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return offsets


def _in_memory(
    source: DocumentSource, tokenizer: Tokenizer, batch_docs: int, key: str,
    progress: Callable[[Iterable[Any]], Iterable[Any]] | None = None,
) -> TokenizedCorpus:
    """The uncached path: same counting and checks, nothing written."""
    pass_ = _Tokenized(source, tokenizer, batch_docs)
    ids, arrays = [], []
    for doc_id, arr in (progress(pass_) if progress else pass_):
        ids.append(doc_id)
        arrays.append(arr)
    offsets = _offsets([a.size for a in arrays])
    tokens = np.concatenate(arrays) if arrays else np.zeros(0, np.int32)
    return TokenizedCorpus(tokens, offsets, ids, pass_.stats(offsets), key=key)


def _write_entry(
    directory: Path, key: str, source: DocumentSource, tokenizer: Tokenizer, batch_docs: int,
    progress: Callable[[Iterable[Any]], Iterable[Any]] | None = None,
) -> None:
    """Tokenize every document of ``source`` into the files of one entry in ``directory``."""
    dtype = tokenizer.storage_dtype
    pass_ = _Tokenized(source, tokenizer, batch_docs)
    lengths: list[int] = []
    ids: list[str] = []
    with open(directory / _TOKENS, "wb") as out:
        for doc_id, arr in (progress(pass_) if progress else pass_):
            out.write(arr.astype(dtype, copy=False).tobytes())
            lengths.append(int(arr.size))
            ids.append(doc_id)
        out.flush()
        os.fsync(out.fileno())
    offsets = _offsets(lengths)
    with open(directory / _OFFSETS, "wb") as fh:
        np.save(fh, offsets)
        fh.flush()
        os.fsync(fh.fileno())
    _write_durably(directory / _IDS, json.dumps(ids).encode())
    stats = pass_.stats(offsets)
    meta = {
        "format": CACHE_FORMAT,
        "key": key,
        "dtype": dtype.str,
        "num_docs": stats.documents,
        "num_tokens": stats.tokens,
        "stats": asdict(stats),
        "source": type(source).__name__,
        "tokenizer": tokenizer.fingerprint(),
    }
    # meta.json last: even inside the temp dir, an entry without it is unreadable.
    _write_durably(directory / _META, json.dumps(meta, indent=1, default=str).encode())


def _publish(
    root: Path, final: Path, key: str, source: DocumentSource, tokenizer: Tokenizer, batch_docs: int,
    progress: Callable[[Iterable[Any]], Iterable[Any]] | None = None,
) -> None:
    """Write into a temp dir beside ``final``, then rename it into place in one step."""
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{key[:12]}-", dir=root))
    try:
        _write_entry(tmp, key, source, tokenizer, batch_docs, progress)
        os.chmod(tmp, 0o755)
        if final.exists():
            if _is_valid(final, key):  # another process published meanwhile: keep theirs
                shutil.rmtree(tmp, ignore_errors=True)
                return
            shutil.rmtree(final, ignore_errors=True)  # a rejected leftover
        try:
            os.replace(tmp, final)
        except OSError as exc:  # lost a race to another process: fine if its entry is sound
            if not _is_valid(final, key):
                raise DataError(
                    f"could not publish token cache entry {str(final)!r} ({exc})"
                ) from exc
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _is_valid(path: Path, key: str) -> bool:
    try:
        _open_entry(path, key)
    except _InvalidEntry:
        return False
    return True


def _open_entry(path: Path, key: str | None) -> TokenizedCorpus:
    """Open and validate one entry; raise :class:`_InvalidEntry` if anything is off."""
    try:
        meta = json.loads((path / _META).read_text())
        if meta.get("format") != CACHE_FORMAT:
            raise _InvalidEntry(f"format {meta.get('format')!r}, expected {CACHE_FORMAT}")
        if key is not None and meta.get("key") != key:
            raise _InvalidEntry(f"key {meta.get('key')!r}, expected {key!r}")
        dtype = np.dtype(meta["dtype"])
        n_docs, n_tokens = int(meta["num_docs"]), int(meta["num_tokens"])
        offsets = np.load(path / _OFFSETS, mmap_mode="r", allow_pickle=False)
        size = (path / _TOKENS).stat().st_size
        ids = json.loads((path / _IDS).read_text())
        stats = CorpusStats(**meta["stats"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise _InvalidEntry(f"unreadable ({type(exc).__name__}: {exc})") from exc
    if offsets.shape != (n_docs + 1,) or int(offsets[0]) != 0 or int(offsets[-1]) != n_tokens:
        raise _InvalidEntry(
            f"offsets shape {offsets.shape} or ends disagree with {n_docs} docs / {n_tokens} tokens"
        )
    if size != n_tokens * dtype.itemsize:
        raise _InvalidEntry(f"tokens file has {size} bytes, expected {n_tokens * dtype.itemsize}")
    if len(ids) != n_docs:
        raise _InvalidEntry(f"{len(ids)} doc ids for {n_docs} documents")
    if n_docs and np.any(np.diff(offsets) <= 0):
        raise _InvalidEntry("offsets are not strictly increasing")
    tokens = (
        np.memmap(path / _TOKENS, dtype=dtype, mode="r", shape=(n_tokens,))
        if n_tokens
        else np.zeros(0, dtype)
    )
    return TokenizedCorpus(tokens, offsets, ids, stats, path=path, key=meta["key"], cache_hit=True)
