"""The DataLoader of step plans: its sampler of (epoch, step), pinning, and the resume position.

Plans are already per rank, so Lightning must not shard them again: :class:`PlanDataLoader` keeps
its own sampler and ignores one Lightning injects (with a warning). Its position (the next
(epoch, step) to hand out) advances when a plan leaves the loader, not when workers prefetch; see
the resume notes of :mod:`.datamodule`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler, Sampler

from ..checks import is_int
from ..plan import RankPlan
from .errors import DataError
from .minibatches import MiniBatchSampler

__all__ = ["STATE_FORMAT", "PlanDataLoader", "pin_rank_plan"]

STATE_FORMAT = 1


@dataclass
class _Cursor:
    """The next (epoch, step) the training loader hands out."""

    epoch: int = 0
    step: int = 0


class _StepSampler(Sampler[tuple[int, int]]):
    """Yields ``(epoch, step)`` from the cursor to the end of its epoch; a finished epoch rolls
    over to the next one. Without a cursor (validation, prediction): always all of epoch 0.
    """

    def __init__(self, cursor: _Cursor | None, length: int) -> None:
        self.cursor, self.length = cursor, length

    def __len__(self) -> int:
        return self.length

    def set_epoch(self, epoch: int) -> None:
        """Deliberately ignored: the position follows consumption, not Lightning's epoch number.

        Lightning passes ``epoch_progress.current.processed``, which after resuming from a
        checkpoint taken when ``max_steps`` stopped a fit mid-epoch is one ahead of the epoch the
        loop actually continues; obeying it would skip the rest of that epoch.
        """

    def __iter__(self) -> Iterator[tuple[int, int]]:
        if self.cursor is None:
            yield from ((0, s) for s in range(self.length))
            return
        if self.cursor.step >= self.length:
            self.cursor.epoch, self.cursor.step = self.cursor.epoch + 1, 0
        epoch, start = self.cursor.epoch, self.cursor.step
        yield from ((epoch, s) for s in range(start, self.length))


def _identity_collate(batch: RankPlan) -> RankPlan:
    return batch


def _accelerator_available() -> bool:
    acc = getattr(torch, "accelerator", None)
    if acc is not None and hasattr(acc, "is_available"):
        return bool(acc.is_available())
    return torch.cuda.is_available()


def pin_rank_plan(plan: RankPlan, pin: Callable[[torch.Tensor], torch.Tensor] | None = None) -> RankPlan:
    """A copy of ``plan`` with every tensor in page-locked memory (``pin`` replaces the pinning in
    tests). The loader pins here, in its iterator, rather than with torch's pin-memory thread, which
    would call :meth:`RankPlan.pin_memory` (the same mapping) only when ``pin_memory=True``."""
    return plan.map_tensors(pin or torch.Tensor.pin_memory)


class _PlanIterator(Iterator[RankPlan]):
    """Starts the DataLoader's iterator on the first ``next`` and records what was handed out."""

    def __init__(self, loader: PlanDataLoader) -> None:
        self._loader = loader
        self._inner: Iterator[RankPlan] | None = None

    def __next__(self) -> RankPlan:
        if self._inner is None:
            self._inner = DataLoader.__iter__(self._loader)
        plan = next(self._inner)
        cursor = self._loader.dataset.cursor
        if self._loader.sampler.cursor is not None:
            cursor.epoch, cursor.step = plan.extras["epoch"], plan.extras["step"] + 1
        return pin_rank_plan(plan) if self._loader.pin_plans else plan


class PlanDataLoader(DataLoader):
    """A DataLoader of :class:`RankPlan` batches that keeps its own sampler and resume position.

    ``batch_size=None`` and an identity collate: one item is one optimizer step. Extra DataLoader
    arguments Lightning passes when it re-creates a loader (``sampler``, ``shuffle``,
    ``batch_size``, ...) are accepted and ignored, so plans are never re-sharded.
    """

    dataset: Any  # a StepPlanDataset (data/datamodule.py, which imports this module)
    sampler: _StepSampler

    def __init__(
        self,
        dataset: Any,
        num_workers: int = 0,
        pin_memory: bool = False,
        persistent_workers: bool = False,
        multiprocessing_context: Any = None,
        prefetch_factor: int | None = None,
        timeout: float = 0,
        worker_init_fn: Callable[[int], None] | None = None,
        resumable: bool = True,
        **ignored: Any,
    ) -> None:
        foreign = ignored.get("sampler")
        # Lightning's own DistributedSampler (use_distributed_sampler=True, its default) is dropped
        # silently: plans are already per rank, and nothing needs changing; any other sampler warns
        if foreign is not None and not isinstance(foreign, (_StepSampler, DistributedSampler)):
            warnings.warn(
                f"{type(self).__name__} ignores the sampler {type(foreign).__name__} it was given: "
                "step plans are already per rank and ordered by the data module's own sampler",
                stacklevel=2,
            )
        self.resumable = resumable
        cursor = dataset.cursor if resumable else None
        super().__init__(
            dataset,
            batch_size=None,
            sampler=_StepSampler(cursor, len(dataset)),
            collate_fn=_identity_collate,
            num_workers=num_workers,
            pin_memory=False,  # RankPlan is pinned here, see pin_rank_plan
            persistent_workers=persistent_workers and num_workers > 0,
            multiprocessing_context=multiprocessing_context if num_workers > 0 else None,
            prefetch_factor=prefetch_factor if num_workers > 0 else None,
            timeout=timeout,
            worker_init_fn=worker_init_fn,
        )
        self.pin_plans = bool(pin_memory) and _accelerator_available()
        if pin_memory and not self.pin_plans:
            warnings.warn("pin_memory=True but no accelerator is available: plans are not pinned",
                          stacklevel=2)

    def __iter__(self) -> Iterator[RankPlan]:  # type: ignore[override]
        return _PlanIterator(self)

    def state_dict(self) -> dict[str, Any]:
        """Position of the next plan (Lightning saves this with the fit loop)."""
        return _position_state(self.dataset.cursor, self.dataset)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _load_position(self.dataset.cursor, state, _identity(self.dataset.sampler, len(self.dataset)))


def _identity(sampler: MiniBatchSampler | None, batches_per_epoch: int | None) -> dict[str, Any]:
    """What a saved position depends on: the mini-batch composition and the epoch length."""
    out: dict[str, Any] = {} if sampler is None else sampler.state_dict()
    out.pop("epoch", None)
    out.pop("step", None)
    if batches_per_epoch is not None:
        out["batches_per_epoch"] = batches_per_epoch
    return out


def _position_state(cursor: _Cursor, dataset: Any) -> dict[str, Any]:
    return {"format": STATE_FORMAT, "epoch": cursor.epoch, "step": cursor.step,
            **_identity(dataset.sampler, len(dataset))}


def _load_position(cursor: _Cursor, state: Mapping[str, Any], mine: Mapping[str, Any]) -> None:
    """Move ``cursor`` to a saved position after checking it was made for the same data."""
    if not isinstance(state, Mapping) or state.get("format") != STATE_FORMAT:
        raise DataError(f"not a HotSPa data position (format {STATE_FORMAT}): {state!r}")
    diff = {k: (state[k], v) for k, v in mine.items() if k in state and state[k] != v}
    if diff:
        raise DataError(f"saved data position does not match this data/config: (saved, current) = {diff}")
    epoch, step = state.get("epoch"), state.get("step")
    if any(not is_int(v) or v < 0 for v in (epoch, step)):
        raise DataError(f"saved data position needs non-negative int epoch and step, got {epoch!r}, {step!r}")
    cursor.epoch, cursor.step = epoch, step
