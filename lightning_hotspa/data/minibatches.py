"""Global mini-batches by TOKEN budget, a pure function of (data, seed, epoch, step, budget).

Why tokens and not samples: HotSPa's step cost is dominated by tokens (and their squares), and a
sample count mixes 100-token and 30K-token documents into wildly different steps. The
composition never looks at the world size or the layouts, so a run can change its parallel
plan (or its number of GPUs) and still train on exactly the same mini-batches.

Rules:

1. Documents longer than ``context_length`` are cut into consecutive context-sized *chunks*
   (``long_doc_policy="split"``, the default); ``"truncate"`` keeps only the first chunk (the
   rest is dropped by request); ``"raise"`` refuses, naming the document and its length.
2. Each epoch shuffles the chunks with a permutation drawn from ``(seed, epoch)``.
3. Chunks are taken in that order and a mini-batch is closed as soon as the next chunk would
   exceed ``tokens_per_batch`` (next-fit). Every chunk lands in exactly one mini-batch per
   epoch; the last, partial mini-batch is kept. Because every chunk is at most
   ``context_length <= tokens_per_batch`` tokens, no batch is empty and each closed batch holds
   more than ``tokens_per_batch - context_length`` tokens.

The number of mini-batches is fixed for a given epoch but may differ by a few between epochs
(the shuffle changes how well the chunks fill the budget); ask ``num_batches(epoch)``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Literal, NamedTuple, Protocol

import numpy as np

from ..checks import check_int, is_int
from .errors import DataError

LongDocPolicy = Literal["split", "truncate", "raise"]
LONG_DOC_POLICIES: tuple[str, ...] = ("split", "truncate", "raise")


class ChunkRef(NamedTuple):
    """A contiguous piece of one document: tokens ``[start, start + length)`` of ``doc``."""

    doc: int
    start: int
    length: int


class TokenStore(Protocol):
    """Anything that hands out a slice of a document's tokens (``TokenizedCorpus`` does)."""

    def doc(self, i: int, start: int = 0, stop: int | None = None) -> np.ndarray: ...


def chunk_tokens(store: TokenStore, ref: ChunkRef) -> np.ndarray:
    """The tokens a chunk reference points at."""
    out = store.doc(ref.doc, ref.start, ref.start + ref.length)
    if out.size != ref.length:
        raise DataError(
            f"chunk {ref} runs past the end of document {ref.doc} ({out.size} tokens found)"
        )
    return out


def _positive_int(name: str, value: Any) -> int:
    return check_int(value, name, error=DataError)


def split_into_chunks(
    lengths: np.ndarray,
    context_length: int,
    policy: LongDocPolicy,
    doc_ids: Sequence[str] | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(doc, start, length) arrays of all chunks, in document order; empty documents give none."""
    too_long = np.flatnonzero(lengths > context_length)
    if policy == "raise" and too_long.size:
        i = int(too_long[0])
        name = repr(doc_ids[i]) if doc_ids is not None else f"index {i}"
        raise DataError(
            f"document {name} has {int(lengths[i])} tokens, more than context_length="
            f"{context_length} ({too_long.size} such documents); use long_doc_policy='split' or 'truncate'"
        )
    per_doc = -(-lengths // context_length)  # ceil; 0 for empty documents
    if policy == "truncate":
        per_doc = np.minimum(per_doc, 1)
    docs = np.repeat(np.arange(lengths.size, dtype=np.int64), per_doc)
    first = np.repeat(np.cumsum(per_doc) - per_doc, per_doc)
    starts = (np.arange(docs.size, dtype=np.int64) - first) * context_length
    sizes = np.minimum(context_length, lengths[docs] - starts)
    return docs, starts, sizes


def _next_fit_bounds(sizes: np.ndarray, budget: int) -> np.ndarray:
    """Batch boundaries of next-fit packing: each batch takes chunks while they still fit.

    One ``searchsorted`` per batch on the running token sum (not a Python step per chunk):
    the batch starting at chunk ``i`` ends before the first ``j`` with ``cum[j] > cum[i] + budget``.
    Needs every size in ``(0, budget]``, so each batch advances by at least one chunk.
    """
    cum = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
    bounds = [0]
    while bounds[-1] < sizes.size:
        start = bounds[-1]
        bounds.append(int(np.searchsorted(cum, cum[start] + budget, side="right")) - 1)
    return np.asarray(bounds, dtype=np.int64)


class MiniBatchSampler:
    """Token-budget mini-batches over chunked documents, with mid-epoch resume.

    Iterating yields the remaining mini-batches of the current epoch as lists of
    :class:`ChunkRef` and advances ``step``; an exhausted epoch rolls over to the next one on the
    following ``iter``. ``set_epoch`` (called by Lightning) moves to another epoch's start but
    keeps the step when the epoch is unchanged, so a restored mid-epoch position survives it.
    """

    def __init__(
        self,
        lengths: Sequence[int] | np.ndarray,
        tokens_per_batch: int,
        context_length: int,
        seed: int = 0,
        long_doc_policy: LongDocPolicy = "split",
        *,
        doc_ids: Sequence[str] | None = None,
    ) -> None:
        self.tokens_per_batch = _positive_int("tokens_per_batch", tokens_per_batch)
        self.context_length = _positive_int("context_length", context_length)
        if self.tokens_per_batch < self.context_length:
            raise DataError(
                f"tokens_per_batch={self.tokens_per_batch} is smaller than context_length="
                f"{self.context_length}: a full-context chunk could never fit in a mini-batch"
            )
        self.seed = check_int(seed, "seed", minimum=0, error=DataError)
        if long_doc_policy not in LONG_DOC_POLICIES:
            raise DataError(
                f"long_doc_policy must be one of {LONG_DOC_POLICIES}, got {long_doc_policy!r}"
            )
        self.long_doc_policy = long_doc_policy
        arr = np.asarray(lengths)
        if arr.ndim != 1 or not (arr.size == 0 or np.issubdtype(arr.dtype, np.integer)):
            raise DataError(
                f"lengths must be a 1-D sequence of integers, got shape {arr.shape} dtype {arr.dtype}"
            )
        arr = arr.astype(np.int64)
        if arr.size and arr.min() < 0:
            raise DataError(
                f"lengths must be >= 0, document {int(np.argmin(arr))} has {int(arr.min())}"
            )
        if doc_ids is not None and len(doc_ids) != arr.size:
            raise DataError(f"{len(doc_ids)} doc_ids for {arr.size} lengths")
        self.chunk_doc, self.chunk_start, self.chunk_len = split_into_chunks(
            arr, self.context_length, long_doc_policy, doc_ids
        )
        if self.chunk_doc.size == 0:
            raise DataError("no tokens to sample: every document is empty (or there are none)")
        self.epoch = 0
        self.step = 0
        self._plans: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    # -- composition -----------------------------------------------------------------------
    @property
    def num_chunks(self) -> int:
        return int(self.chunk_doc.size)

    @property
    def tokens_per_epoch(self) -> int:
        return int(self.chunk_len.sum())

    def _plan(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(chunk order, batch boundaries) of one epoch, memoized for the last two epochs."""
        epoch = check_int(epoch, "epoch", minimum=0, error=DataError)
        if epoch not in self._plans:
            order = np.random.default_rng([self.seed, epoch]).permutation(self.num_chunks)
            bounds = _next_fit_bounds(self.chunk_len[order], self.tokens_per_batch)
            if len(self._plans) >= 2:
                self._plans.pop(next(iter(self._plans)))
            self._plans[epoch] = (order, bounds)
        return self._plans[epoch]

    def num_batches(self, epoch: int) -> int:
        return len(self._plan(epoch)[1]) - 1

    def batch_indices(self, epoch: int, step: int) -> np.ndarray:
        """Chunk indices of one mini-batch (into ``chunk_doc``/``chunk_start``/``chunk_len``)."""
        order, bounds = self._plan(epoch)
        if not is_int(step) or not 0 <= step < len(bounds) - 1:
            raise DataError(
                f"step must be in [0, {len(bounds) - 1}) for epoch {epoch}, got {step!r}"
            )
        return order[bounds[step] : bounds[step + 1]]

    def batch(self, epoch: int, step: int) -> list[ChunkRef]:
        """The chunks of mini-batch ``step`` of ``epoch``, in their shuffled order."""
        idx = self.batch_indices(epoch, step)
        return [
            ChunkRef(d, s, n)
            for d, s, n in zip(
                self.chunk_doc[idx].tolist(),
                self.chunk_start[idx].tolist(),
                self.chunk_len[idx].tolist(),
                strict=True,
            )
        ]

    def batch_lengths(self, epoch: int, step: int) -> np.ndarray:
        """Chunk lengths of one mini-batch: what the planner needs, without building refs."""
        return self.chunk_len[self.batch_indices(epoch, step)]

    # -- iteration and resume --------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        self._plan(epoch)  # validates
        if epoch != self.epoch:
            self.epoch, self.step = int(epoch), 0

    def __len__(self) -> int:
        return self.num_batches(self.epoch)

    def __iter__(self) -> Iterator[list[ChunkRef]]:
        if self.step >= self.num_batches(self.epoch):
            self.epoch, self.step = self.epoch + 1, 0
        while self.step < self.num_batches(self.epoch):
            refs = self.batch(self.epoch, self.step)
            self.step += 1
            yield refs

    def _identity(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "tokens_per_batch": self.tokens_per_batch,
            "context_length": self.context_length,
            "long_doc_policy": self.long_doc_policy,
            "num_chunks": self.num_chunks,
            "tokens_per_epoch": self.tokens_per_epoch,
        }

    def state_dict(self) -> dict[str, Any]:
        """Position (next batch to produce) plus what the composition depends on, for checks."""
        return {"epoch": self.epoch, "step": self.step, **self._identity()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at ``(epoch, step)``; refuse a state made for other data, seed or budget."""
        mine = self._identity()
        diff = {k: (state[k], mine[k]) for k in mine if k in state and state[k] != mine[k]}
        if diff:
            raise DataError(
                f"sampler state does not match this data/config: (saved, current) = {diff}"
            )
        epoch, step = state.get("epoch"), state.get("step")
        self._plan(epoch)  # validates epoch
        if not is_int(step) or not 0 <= step <= self.num_batches(epoch):
            raise DataError(
                f"saved step must be in [0, {self.num_batches(epoch)}] for epoch {epoch}, got {step!r}"
            )
        self.epoch, self.step = int(epoch), int(step)
