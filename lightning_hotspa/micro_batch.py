"""One micro-batch of packed documents, as one rank holds it: the tensor side of a step plan.

Context-parallel slicing happens here, not in the model: each document is padded to a multiple of
``2*cp``, cut into ``2*cp`` chunks, and cp rank ``r`` takes chunks ``r`` and ``2*cp-1-r`` so causal
attention work is balanced across cp ranks. Under tp the last document's tail is padded further so
the rank's token count divides by tp (sequence parallelism). These are the only padding in the system.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields

import torch

from .checks import check_int
from .host_facts import remember

__all__ = ["IGNORE_INDEX", "PlanError", "MicroBatch", "pack_micro_batch", "idle_micro_batch"]

#: The label of a token with no loss (document ends, padding, prompt tokens); torch's own default.
IGNORE_INDEX = -100


class PlanError(ValueError):
    """An inconsistent plan or micro-batch; the message names the offending value."""


def _check_1d(name: str, t: torch.Tensor, dtypes: tuple[torch.dtype, ...]) -> None:
    if not isinstance(t, torch.Tensor) or t.dim() != 1:
        raise PlanError(f"MicroBatch.{name} must be a 1-D tensor, got {type(t).__name__} "
                        f"of shape {tuple(getattr(t, 'shape', ()))}")
    if t.dtype not in dtypes:
        raise PlanError(f"MicroBatch.{name} must have dtype in {dtypes}, got {t.dtype}")


def _check_cu_seqlens(name: str, cu: torch.Tensor, total: int) -> list[int]:
    _check_1d(name, cu, (torch.int32, torch.int64))
    values = cu.tolist()
    if len(values) < 2 or values[0] != 0 or values[-1] != total:
        raise PlanError(f"MicroBatch.{name} must start at 0 and end at {total}, got {values}")
    if any(b <= a for a, b in zip(values, values[1:])):
        raise PlanError(f"MicroBatch.{name} must be strictly increasing (no empty documents), got {values}")
    return values


def moved(t: torch.Tensor, device: torch.device | str, non_blocking: bool) -> torch.Tensor:
    """``t`` on ``device``; asynchronous from pinned host memory even if the caller did not ask
    (Lightning's batch transfer passes ``non_blocking`` to tensors only, not to a plan's ``.to``).

    Args:
        t: the tensor to move.
        device: where to.
        non_blocking: what the caller asked for.
    """
    return t.to(device, non_blocking=non_blocking or (t.device.type == "cpu" and t.is_pinned()))


def _id_range(ids: torch.Tensor, ignore_index: int | None = None) -> tuple[int, ...]:
    """(min, max) of the ids, ``ignore_index`` left out; ``()`` if none is left."""
    if ignore_index is not None:
        ids = ids[ids != ignore_index]
    if ids.numel() == 0:
        return ()
    low, high = torch.aminmax(ids)
    return int(low), int(high)


@dataclass(frozen=True)
class MicroBatch:
    """Packed documents one tp x cp group processes in one forward/backward (this rank's slice).

    ``labels`` are already shifted inside each document (``IGNORE_INDEX`` at document ends, padding
    and masked positions); ``position_ids`` restart at every document; ``cu_seqlens`` are the
    document boundaries as this rank holds them. With ``cp_size > 1`` each local document is this
    rank's two chunks, and ``cp_cu_seqlens`` gives the boundaries of the whole (padded) row.
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    num_target_tokens: int
    cp_size: int = 1
    cp_rank: int = 0
    cp_cu_seqlens: torch.Tensor | None = None
    doc_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        long = (torch.int64,)
        _check_1d("input_ids", self.input_ids, long)
        _check_1d("labels", self.labels, long)
        _check_1d("position_ids", self.position_ids, long)
        total = self.input_ids.numel()
        if total == 0:
            raise PlanError("MicroBatch is empty (no tokens)")
        for name in ("labels", "position_ids"):
            if getattr(self, name).numel() != total:
                raise PlanError(f"MicroBatch.{name} has {getattr(self, name).numel()} tokens, input_ids has {total}")
        bounds = _check_cu_seqlens("cu_seqlens", self.cu_seqlens, total)
        full = None
        longest = max(b - a for a, b in zip(bounds, bounds[1:]))
        if self.max_seqlen != longest:
            raise PlanError(f"MicroBatch.max_seqlen is {self.max_seqlen} but the longest document is {longest}")
        targets = int((self.labels != IGNORE_INDEX).sum())
        if self.num_target_tokens != targets:
            raise PlanError(f"MicroBatch.num_target_tokens is {self.num_target_tokens} but labels hold {targets}")
        if not (1 <= self.cp_size and 0 <= self.cp_rank < self.cp_size):
            raise PlanError(f"MicroBatch cp_rank={self.cp_rank} is not within cp_size={self.cp_size}")
        if self.cp_size > 1:
            if self.cp_cu_seqlens is None:
                raise PlanError(f"MicroBatch with cp_size={self.cp_size} needs cp_cu_seqlens")
            full = _check_cu_seqlens("cp_cu_seqlens", self.cp_cu_seqlens, total * self.cp_size)
            local_lengths = [b - a for a, b in zip(bounds, bounds[1:])]
            full_lengths = [b - a for a, b in zip(full, full[1:])]
            if [n * self.cp_size for n in local_lengths] != full_lengths or any(
                n % (2 * self.cp_size) for n in full_lengths
            ):
                raise PlanError(f"MicroBatch cp_cu_seqlens {full} does not match local cu_seqlens {bounds} "
                                f"split over cp_size={self.cp_size} in 2*cp chunks")
        self._remember(tuple(bounds), None if full is None else tuple(full), _id_range(self.input_ids),
                       _id_range(self.labels, IGNORE_INDEX))

    def _remember(self, bounds: tuple[int, ...], full: tuple[int, ...] | None, ids: tuple[int, ...],
                  labels: tuple[int, ...]) -> None:
        """Files the host-side values validated here (:mod:`..host_facts`): the hot path then never
        reads them back from the device."""
        object.__setattr__(self, "_facts", (bounds, full, ids, labels))
        remember(self.cu_seqlens, "bounds", bounds)
        if full is not None:
            remember(self.cp_cu_seqlens, "bounds", full)
        remember(self.input_ids, "id_range", (ids, None))
        remember(self.labels, "id_range", (labels, IGNORE_INDEX))

    def __setstate__(self, state: dict) -> None:
        """Unpickled in another process (a loader worker's batch): its facts are filed again."""
        for name, value in state.items():
            object.__setattr__(self, name, value)
        self._remember(*self._facts)

    @property
    def bounds(self) -> tuple[int, ...]:
        """``cu_seqlens`` as host ints (validated when the micro-batch was built)."""
        return self._facts[0]

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    @property
    def num_documents(self) -> int:
        return self.cu_seqlens.numel() - 1

    def map_tensors(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> MicroBatch:
        """A copy with ``fn`` applied to every tensor (moving, pinning: one definition of each)."""
        def apply(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else fn(t)

        # validated where it was built: a copy is not read back (on a device that would sync the host)
        out = object.__new__(MicroBatch)
        for f in fields(MicroBatch):
            value = getattr(self, f.name)
            object.__setattr__(out, f.name, apply(value) if isinstance(value, torch.Tensor) else value)
        out._remember(*self._facts)
        return out

    def to(self, device: torch.device | str, non_blocking: bool = False) -> MicroBatch:
        """Lightning moves any object with ``.to`` to the device."""
        return self.map_tensors(lambda t: moved(t, device, non_blocking))

    def pin_memory(self) -> MicroBatch:
        """torch's DataLoader pin thread calls this on custom batch types."""
        return self.map_tensors(torch.Tensor.pin_memory)


def pack_micro_batch(
    docs: Sequence[torch.Tensor], cp_size: int = 1, cp_rank: int = 0, doc_ids: Sequence[int] = (),
    tp_size: int = 1,
) -> MicroBatch:
    """Packs whole documents (1-D token tensors) into one micro-batch, cp-sliced for ``cp_rank``.

    Every document's labels are its next tokens; the last token of a document has no target.
    ``tp_size``: the local token count is made a multiple of it (sequence parallelism splits the
    tokens over tp) by padding the LAST document's tail (token 0, label ``IGNORE_INDEX``; causal
    attention keeps it from every real token), together with its cp padding if it is split.
    """
    if not docs:
        raise PlanError("cannot pack a micro-batch from zero documents")
    if cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise PlanError(f"cp_rank={cp_rank} is not within cp_size={cp_size}")
    check_int(tp_size, "tp_size", error=PlanError)
    inputs, labels, positions, local_lengths, full_lengths = [], [], [], [], []
    chunks = 2 * cp_size if cp_size > 1 else 1
    for i, doc in enumerate(docs):
        doc = torch.as_tensor(doc).long().reshape(-1)
        n = doc.numel()
        if n == 0:
            raise PlanError(f"document {doc_ids[i] if doc_ids else i} is empty; empty documents must be skipped "
                            f"earlier")
        lab = torch.full((n,), IGNORE_INDEX, dtype=torch.long)
        lab[:-1] = doc[1:]
        size = -(-n // chunks)  # tokens per chunk; this rank keeps 2 chunks under cp, all of it without
        if i == len(docs) - 1 and tp_size > 1:
            local = sum(local_lengths)
            for _ in range(tp_size):  # always found: cp keeps an even count, and so adds 2 per step
                if (local + size * min(chunks, 2)) % tp_size == 0:
                    break
                size += 1
        padded = size * chunks
        pad = padded - n
        if pad:
            doc = torch.cat([doc, doc.new_zeros(pad)])
            lab = torch.cat([lab, lab.new_full((pad,), IGNORE_INDEX)])
        pos = torch.arange(padded, dtype=torch.long)
        if cp_size > 1:
            c = size
            head, tail = cp_rank * c, (chunks - 1 - cp_rank) * c  # two slices: cheaper than fancy indexing
            doc, lab, pos = (torch.cat([t[head:head + c], t[tail:tail + c]]) for t in (doc, lab, pos))
            full_lengths.append(padded)
        inputs.append(doc)
        labels.append(lab)
        positions.append(pos)
        local_lengths.append(doc.numel())
    cu = torch.zeros(len(docs) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(local_lengths).cumsum(0)
    cp_cu = None
    if cp_size > 1:
        cp_cu = torch.zeros(len(docs) + 1, dtype=torch.int32)
        cp_cu[1:] = torch.tensor(full_lengths).cumsum(0)
    label = torch.cat(labels)
    return MicroBatch(torch.cat(inputs), label, torch.cat(positions), cu, max(local_lengths),
                      int((label != IGNORE_INDEX).sum()), cp_size, cp_rank, cp_cu, tuple(doc_ids))


def idle_micro_batch(cp_size: int = 1, cp_rank: int = 0, tp_size: int = 1) -> MicroBatch:
    """A one-token document without targets: what a dp group with fewer micro-batches than the
    busiest computes (loss weight 0) so that an fsdp stage's per-unit collectives line up (padded
    for ``cp_size`` and ``tp_size`` as :func:`pack_micro_batch` pads)."""
    return pack_micro_batch([torch.zeros(1, dtype=torch.long)], cp_size, cp_rank, tp_size=tp_size)
