"""Metric syncs that cannot deadlock: every rank makes the same logging collectives in the same
order, whatever its number of micro-batches (docs/DESIGN.md §7, trap "Logging per micro-batch").

Lightning syncs a ``self.log(..., sync_dist=True)`` value with one collective per call. The user's
``training_step`` runs once per micro-batch, and dp groups hold different numbers of micro-batches
(or none), so those per-call collectives would pair up across ranks wrongly or hang. Instead:

* inside a step, :class:`StepMetricSync` keeps each call's value local (the strategy's ``reduce``
  asks :meth:`StepMetricSync.intercept`), notes after each micro-batch which logged metric it
  belongs to, and at the step's end reduces all of them with one object gather and two fixed
  collectives, on every rank alike: an on-step value becomes the mean (sum, max, min) over every
  micro-batch of every rank that logged it;
* in the same object gather, after every step (training, validation, test), :func:`align_epoch_metrics`
  gives every rank the same epoch metrics in the same order, adding neutral ones (nothing
  accumulated) where a rank logged nothing (a rank with no validation micro-batch), so the
  per-metric syncs of the epoch's (or a dataloader's) compute pair up.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ...group_collectives import world_collectives
from .lightning_compat import ResultMetric, Sync, result_metadata

__all__ = ["StepMetricSync", "align_epoch_metrics"]

_SUM_OPS = ("mean", "avg", "sum")
_EXTREMA = ("max", "min")


def _op_name(reduce_op: Any) -> str:
    """A reduce op (``"mean"``, ``torch.max``, ``ReduceOp.SUM``) as one of mean/sum/max/min."""
    name = getattr(reduce_op, "__name__", None) or str(reduce_op)
    name = name.lower().rsplit(".", 1)[-1].replace("redopType.", "")
    name = {"avg": "mean", "amax": "max", "amin": "min"}.get(name, name)
    if name not in ("mean", "sum", "max", "min"):
        raise ValueError(f"self.log(sync_dist=True) under HotSPaStrategy supports reduce_fx mean, sum, max or min; "
                         f"got {reduce_op!r}")
    return name


class StepMetricSync:
    """Defers the ``sync_dist`` reductions of one step (its micro-batches) to one reduction at its end."""

    def __init__(self) -> None:
        self._active = False
        self._pending: list[Tensor] = []  # values handed out during the current micro-batch
        self._stats: dict[str, list] = {}  # key -> [op, sum, count, max, min]

    @property
    def active(self) -> bool:
        """True inside a step: ``reduce`` then keeps values local."""
        return self._active

    def intercept(self, tensor: Tensor, reduce_op: Any) -> Tensor:
        """What the strategy's ``reduce`` returns inside a step: the value itself, noted for later.

        Args:
            tensor: the value being logged (Lightning's clone of it).
            reduce_op: the reduction it asked for.
        """
        _op_name(reduce_op)  # a clear error now, not at the step's end
        self._pending.append(tensor)
        return tensor

    @contextlib.contextmanager
    def step(self, results: Any) -> Iterator[None]:
        """Around one step's micro-batches; the reduction itself is :meth:`finish`.

        Args:
            results: Lightning's result collection of the running loop (``trainer._results``).
        """
        self._active, self._stats = True, {}
        try:
            yield
        finally:
            self._active, self._pending = False, []

    def after_micro_batch(self, results: Any) -> None:
        """Attribute the values logged by the micro-batch just run to their metrics (last value wins
        within one call, as within one ``training_step`` under DDP).

        Args:
            results: the result collection the values were logged into.
        """
        if not self._pending or results is None:
            self._pending = []
            return
        pending, self._pending = self._pending, []  # held alive while ids are compared: a dead one's id is reused
        mine = {id(t) for t in pending}
        for key, metric in results.items():
            cache = getattr(metric, "_forward_cache", None)
            if isinstance(cache, Tensor) and id(cache) in mine:
                value = float(cache.detach().double().mean()) if cache.numel() != 1 else float(cache)
                op = _op_name(metric.meta.sync.op)
                stats = self._stats.setdefault(key, [op, 0.0, 0, float("-inf"), float("inf")])
                stats[1] += value
                stats[2] += 1
                stats[3], stats[4] = max(stats[3], value), min(stats[4], value)

    def finish(self, results: Any, reduce: Any, device: torch.device) -> None:
        """The step's one metric exchange, on every rank alike: writes each reduced on-step value into
        the rank's logged metric in place (what Lightning reports for the step), then aligns the
        epoch metrics (:func:`align_epoch_metrics`).

        Args:
            results: the result collection the values were logged into (None: a loop without one).
            reduce: the strategy's ``reduce`` (the sync function of metrics created here).
            device: where the collective's tensors live.
        """
        if results is None or not dist.is_initialized():
            return
        gathered = world_collectives().all_gather_object((sorted((k, s[0]) for k, s in self._stats.items()),
                                                          _epoch_descriptions(results)))
        self._reduce_step_values(results, sorted({e for keys, _ in gathered for e in keys}), device)
        align_epoch_metrics(results, [epoch for _, epoch in gathered], reduce, device)

    def _reduce_step_values(self, results: Any, union: list[tuple[str, str]], device: torch.device) -> None:
        """Two fixed collectives over every rank's (sum, count, max, -min) of each key in ``union``."""
        if not union:
            return
        local = torch.zeros(len(union), 4, dtype=torch.float64, device=device)
        for i, (key, _) in enumerate(union):
            stats = self._stats.get(key)
            local[i] = torch.tensor([stats[1], stats[2], stats[3], -stats[4]] if stats else
                                    [0.0, 0.0, float("-inf"), float("-inf")], dtype=torch.float64)
        sums, extrema = local[:, :2].contiguous(), local[:, 2:].contiguous()
        world_collectives().all_reduce(sums)
        world_collectives().all_reduce(extrema, op="max")
        for i, (key, op) in enumerate(union):
            cache = getattr(results.get(key), "_forward_cache", None)
            if key not in self._stats or not isinstance(cache, Tensor):
                continue  # this rank logged nothing under that key in this step
            total, count = float(sums[i, 0]), float(sums[i, 1])
            value = {"mean": total / max(count, 1.0), "sum": total, "max": float(extrema[i, 0]),
                     "min": -float(extrema[i, 1])}[op]
            cache.fill_(value)


def _metric_description(metric: Any) -> dict[str, Any]:
    """What another rank needs to create the same metric (no callables: they do not pickle)."""
    meta = metric.meta
    return {"fx": meta.fx, "name": meta.name, "prog_bar": meta.prog_bar, "logger": meta.logger,
            "on_step": meta.on_step, "on_epoch": meta.on_epoch, "reduce_fx": _op_name(meta.reduce_fx),
            "add_dataloader_idx": meta.add_dataloader_idx, "dataloader_idx": meta.dataloader_idx,
            "sync": meta.sync.should, "rank_zero_only": meta.sync.rank_zero_only}


def _neutral_metric(description: dict[str, Any], reduce: Any, device: torch.device) -> Any:
    """A logged metric with nothing accumulated: it adds nothing to the epoch's sync."""
    meta = result_metadata(description)
    meta.sync = Sync(_should=description["sync"], fn=reduce, rank_zero_only=description["rank_zero_only"])
    metric = ResultMetric(meta, True).to(device)
    metric.has_reset = False
    return metric


def _epoch_descriptions(results: Any) -> dict[str, dict[str, Any]]:
    """This rank's logged epoch metrics that sync (tensors with something accumulated), described;
    unsynced ones make no collective and are left as they are."""
    return {key: _metric_description(m) for key, m in results.items()
            if m.is_tensor and not m.has_reset and m.meta.on_epoch and m.meta.sync.should
            and not m.meta.sync.rank_zero_only}


def align_epoch_metrics(results: Any, gathered: list[dict[str, dict[str, Any]]], reduce: Any,
                        device: torch.device) -> None:
    """Every rank the same epoch metrics in the same (sorted) order, so the per-metric syncs of the
    epoch's compute pair up.

    Args:
        results: Lightning's result collection.
        gathered: every rank's :func:`_epoch_descriptions`.
        reduce: the strategy's ``reduce`` (the sync function of metrics created here).
        device: where a created metric's state lives.
    """
    union: dict[str, dict[str, Any]] = {}
    for rank_metrics in gathered:
        for key, description in rank_metrics.items():
            union.setdefault(key, description)
    for key in sorted(union):
        metric = results.get(key)
        if metric is None or metric.has_reset:
            metric = _neutral_metric(union[key], reduce, device)
        results.pop(key, None)
        results[key] = metric  # re-inserted in sorted order: the compute order is the same everywhere
