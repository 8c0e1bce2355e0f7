"""``OptionCost``: the predicted seconds of one option (a layout and a checkpointing mode) of the
analytic cost model (:mod:`.cost_model`, whose docstring defines each term; importable from there too).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ...activation_checkpointing import Checkpointing
from ...layout import Layout
from ..solve.packing import cp_padded_lengths, max_doc_length
from .pp_schedule import PipelineSchedule

__all__ = ["OptionCost"]


@dataclass(frozen=True)
class OptionCost:
    """Predicted seconds of one option; see :mod:`.cost_model`'s docstring for the meaning of each term."""

    layout: Layout
    activation_checkpointing: Checkpointing
    capacity: int  # tokens per micro-batch, cp padding included
    quadratic: float  # a: seconds per (padded length)^2 of a document
    linear: float  # b: seconds per padded token
    per_micro_batch: float  # d
    stage_fixed: float  # F
    per_document: float = 0.0  # e: fixed seconds per document (0 analytically; e.g. per-document kernels on CPU)
    ring_exchange: float = 0.0  # x: seconds per padded token of the cp ring's exchange, hidden by attention
    ring_hiding: float = 0.0  # h: seconds per (padded length)^2 of the attention that hides it
    pipeline: PipelineSchedule = PipelineSchedule()  # pp > 1: its schedule (the bubble)
    attention_linear: float = 0.0  # the part of b that is attention: short calls below the kernel's peak rate

    @property
    def key(self) -> tuple[str, Checkpointing]:
        return (self.layout.name, self.activation_checkpointing)

    @property
    def label(self) -> str:
        """``"dp8"``, ``"dp8+sac"``, ``"dp8+ac"``: the layout and the checkpointing mode."""
        return self.layout.name + self.activation_checkpointing.suffix

    @property
    def max_doc_length(self) -> int:
        return max_doc_length(self.capacity, self.layout.cp) if self.capacity > 0 else 0

    def padded(self, lengths: Sequence[int] | np.ndarray) -> np.ndarray:
        return cp_padded_lengths(lengths, self.layout.cp)

    def doc_seconds(self, padded: np.ndarray) -> np.ndarray:
        """``a s^2 + b s (+ e)`` of each (already padded) document, plus what its cp ring's exchange leaves
        exposed, ``max(0, x s - h s^2)`` (per document: a micro-batch's documents share the ring steps, so
        this over-counts a packed micro-batch's exposure, never under-counts it)."""
        s = np.asarray(padded, dtype=np.float64)
        seconds = (self.quadratic * s + self.linear) * s + self.per_document
        if self.ring_exchange:
            seconds = seconds + np.maximum(0.0, (self.ring_exchange - self.ring_hiding * s) * s)
        return seconds

    def balance_cost(self, padded: np.ndarray) -> np.ndarray:
        """Per-document cost for dp balancing: its seconds plus its share of a micro-batch's
        fixed cost (a :data:`~..solve.packing.DocCost`)."""
        s = np.asarray(padded, dtype=np.float64)
        return self.doc_seconds(s) + self.per_micro_batch * s / max(self.capacity, 1)

    def pipeline_factor(self, micro_batches: int) -> float:
        """``1 + bubble``: a dp group's pipelined time over its micro-batches' summed stage time."""
        full = self.activation_checkpointing is Checkpointing.FULL
        return 1.0 + self.pipeline.bubble(self.layout.pp, micro_batches, recompute=full)

    def group_seconds(self, doc_seconds_sum: float, micro_batches: int) -> float:
        """One dp group's time for its micro-batches (documents' seconds summed beforehand)."""
        if micro_batches == 0:
            return 0.0
        return (doc_seconds_sum + self.per_micro_batch * micro_batches) * self.pipeline_factor(micro_batches)

    def stage_seconds(self, doc_seconds: np.ndarray, groups: Sequence[Sequence[Sequence[int]]],
                      in_order: bool = False) -> float:
        """The stage's compute seconds: its slowest dp group. With a sharded working copy whose shard
        spans dp groups (``lockstep``: plain ``:fsdp`` with dp > 1, or an HSDP shard beyond cp)
        every unit's gathers and reduce-scatter span the dp groups, so the groups run in lockstep
        rounds (the runtime gives a group with fewer micro-batches idle rounds, each costing
        ``per_micro_batch``): the sum over rounds of the round's slowest micro-batch, each group's
        micro-batches in descending cost (the order the solver emits) unless ``in_order``."""
        doc_seconds = np.asarray(doc_seconds, dtype=np.float64)
        busy = [g for g in groups if g]
        if not busy:
            return 0.0
        if not self.layout.lockstep or len(groups) == 1:
            return max(self.group_seconds(float(sum(doc_seconds[list(mb)].sum() for mb in g)), len(g)) for g in busy)
        rounds = max(len(g) for g in groups)
        table = np.full((len(groups), rounds), self.per_micro_batch)
        for k, g in enumerate(groups):
            secs = [float(doc_seconds[list(mb)].sum()) + self.per_micro_batch for mb in g]
            table[k, :len(secs)] = secs if in_order else sorted(secs, reverse=True)
        return float(table.max(axis=0).sum())

    def with_coefficients(self, quadratic: float, linear: float, per_micro_batch: float,
                          per_document: float | None = None, ring_scale: float = 1.0) -> OptionCost:
        """The option with new coefficients; ``ring_scale`` scales the ring's exposure term (0: fitted
        coefficients that already hold it)."""
        return dataclasses.replace(self, quadratic=float(quadratic), linear=float(linear),
                                   per_micro_batch=float(per_micro_batch),
                                   per_document=self.per_document if per_document is None else float(per_document),
                                   ring_exchange=self.ring_exchange * ring_scale,
                                   ring_hiding=self.ring_hiding * ring_scale)
