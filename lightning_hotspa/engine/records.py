"""What one step measured, as typed records: one rank's view of a stage, and all ranks' view.

:class:`StageStats` is what one rank saw of one stage (the step runner fills it). The step's one
small collective (:func:`gather_step`) all-gathers every rank's loss contribution and stage
numbers; from that table come the exact global loss and one :class:`StageRecord` per stage (token
counts summed over ranks with tp copies counted once, times the slowest rank's). Everything that
reports a step (logger metrics, the monitor, the timeline, the profiled planner) reads these
records, never strings parsed back from logged metrics: a record carries its :class:`Layout` and
its stage index; names are written only where metrics, JSON and logs are (:attr:`StageRecord.name`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..activation_checkpointing import Checkpointing
from ..collective_names import collective
from ..group_collectives import world_collectives
from ..host import host_reads
from ..layout import Layout
from ..plan import RankStage

__all__ = ["FIELDS", "StageRecord", "StageStats", "StepResult", "gather_step", "rank_stage_fields"]

#: the per-stage columns of the gathered table, in order
FIELDS = ("tokens", "documents", "micro_batches", "target_tokens", "switch_bytes", "switch_s", "compute_s",
          "reduce_s", "sum_sq", "sum_len", "fsdp_bytes", "counted_by", "before_s")


@dataclass(frozen=True)
class StageStats:
    """What one rank saw of one stage. Seconds are device time (:mod:`.timing`), ``compute_cpu_s``
    this process' CPU seconds of the stage's micro-batches.

    ``reduce_*``: the gradient reduction at the stage end. A stage followed by one of the same tp
    degree does not reduce (0 s, 0 bytes, 0 collectives): the last stage of such a run reduces the
    whole run's gradients, so its ``reduce_s`` pays for all of them.
    """

    layout: Layout
    order: int  # the stage's index in the step
    label: str
    tokens: int
    documents: int
    micro_batches: int
    target_tokens: int
    switch_bytes: int
    switch_s: float
    compute_s: float
    reduce_s: float
    sum_sq: float = 0.0  # sum over this rank's documents of (cp-padded length)^2
    sum_len: float = 0.0  # sum of cp-padded lengths
    reduce_bytes: int = 0  # this rank's received bytes of the reduction (GradReport)
    reduce_collectives: int = 0
    compute_cpu_s: float = 0.0
    activation_checkpointing: Checkpointing = Checkpointing.NONE  # what the stage ran with
    #: fsdp layouts: bytes this rank received in its units' gathers (forward, backward re-gathers)
    #: and reduce-scatters during the stage's micro-batches (``engine/fsdp.py``); 0 otherwise
    fsdp_bytes: int = 0
    #: how many ranks count this rank's micro-batches: its tp group (its block's in a mixed stage) times
    #: its pp group (every pipeline stage runs the same micro-batches), so the records divide by it
    counted_by: int = 1
    #: seconds from the previous stage's end (the step's start for the first stage) to this one's
    #: start: what lies between stages (entering the stage's hooks), in no stage's seconds
    before_s: float = 0.0

    @classmethod
    def measure(cls, stage: RankStage, switch_report: Any, grad_report: Any, *, order: int, switch_s: float,
                compute_s: float, reduce_s: float, compute_cpu_s: float = 0.0,
                activation_checkpointing: Checkpointing = Checkpointing.NONE, fsdp_bytes: int = 0,
                before_s: float = 0.0) -> StageStats:
        """This rank's stats of ``stage``, the ``order``-th of the step, from its switch and gradient
        reports and its measured seconds (see the class docstring for each field)."""
        mbs = [m for m in stage.micro_batches if hasattr(m, "num_tokens")]
        sum_sq = sum_len = 0.0
        if mbs:  # a local document of a cp rank is 1/cp of its padded row; one host copy per stage
            with host_reads():  # plan metadata (real tensors under the fake-world estimator's mode)
                s = torch.cat([m.cu_seqlens.diff() for m in mbs]).double() * stage.compute_layout.cp
                sum_sq, sum_len = torch.stack([(s * s).sum(), s.sum()]).tolist()
        return cls(stage.layout, order, stage.label,
                   tokens=sum(m.num_tokens for m in mbs), documents=sum(m.num_documents for m in mbs),
                   micro_batches=len(stage.micro_batches), target_tokens=sum(m.num_target_tokens for m in mbs),
                   switch_bytes=switch_report.bytes_received, switch_s=switch_s, compute_s=compute_s,
                   reduce_s=reduce_s, sum_sq=sum_sq, sum_len=sum_len,
                   reduce_bytes=grad_report.bytes_received, reduce_collectives=grad_report.collectives,
                   compute_cpu_s=compute_cpu_s, activation_checkpointing=activation_checkpointing,
                   fsdp_bytes=fsdp_bytes,
                   counted_by=stage.compute_layout.tp * stage.compute_layout.pp, before_s=before_s)


@dataclass(frozen=True)
class StageRecord:
    """One stage of one step over all ranks: what ran (bucket, layout) and how long it took.

    ``switch_s`` / ``compute_s`` / ``reduce_s`` are each the slowest rank's; ``stage_s`` is the
    slowest rank's sum of the three (what the step waited for; given none, the sum of the three):
    the ONE seconds figure of the stage every rate, share and MFU divides by (:attr:`seconds`).
    ``before_s``: the slowest rank's seconds between the previous stage's end and this one's start.
    ``flops`` (model FLOPs),
    ``predicted_s`` (cost model) and ``plan`` (packing stats) are added by the monitor. A stage is
    identified by ``order`` (its index in the step); :attr:`name` is what metrics and tables show."""

    step: int
    order: int
    layout: Layout
    label: str
    tokens: float
    documents: float
    micro_batches: float
    switch_s: float
    switch_mb: float
    compute_s: float
    reduce_s: float
    stage_s: float | None = None
    fsdp_mb: float = 0.0  # all ranks' received MB of the sharded working copy's per-unit traffic
    flops: float | None = None
    predicted_s: float | None = None
    plan: Mapping[str, Any] = field(default_factory=dict)  # packing stats: fill, padding, imbalance
    activation_checkpointing: Checkpointing = Checkpointing.NONE  # what the stage ran with
    before_s: float = 0.0

    def __post_init__(self) -> None:
        if self.stage_s is None:
            object.__setattr__(self, "stage_s", self.switch_s + self.compute_s + self.reduce_s)

    @property
    def name(self) -> str:
        """``"dp8"``, ``"dp8+sac"``, ``"dp8+ac"``: the layout's name and the stage's checkpointing
        (:attr:`Checkpointing.suffix`: selective, full)."""
        return self.layout.name + Checkpointing.parse(self.activation_checkpointing).suffix

    @property
    def seconds(self) -> float:
        """The stage's one seconds figure: :attr:`stage_s`."""
        return float(self.stage_s or 0.0)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def mfu(self, peak_flops_total: float | None) -> float | None:
        """Model FLOPs / (stage seconds x peak FLOP/s of all devices)."""
        if self.flops is None or not peak_flops_total or self.seconds <= 0:
            return None
        return self.flops / (self.seconds * peak_flops_total)


@dataclass(frozen=True)
class StepResult:
    """What :meth:`StepRunner.run` returns: the step's global loss, this rank's stage stats, all
    ranks' stage records and the gathered table they came from (identical on every rank)."""

    step: int
    loss: torch.Tensor  # exact global token-mean loss (0-d, float64), the same on every rank
    stages: tuple[StageStats, ...]
    records: tuple[StageRecord, ...]
    table: torch.Tensor  # [world, 1 + stages * len(FIELDS)]
    finite: bool = True
    skip_update: bool = False  # the non-finite policy dropped this step's update

    @property
    def between_s(self) -> float:
        """What lies between the stages: the sum over stages of the slowest rank's ``before_s``."""
        return sum(r.before_s for r in self.records)

    @property
    def step_s(self) -> float:
        """The step's time: its stages' ``stage_s`` plus :attr:`between_s` (exactly their sum)."""
        return sum(r.seconds for r in self.records) + self.between_s


def gather_step(loss_sum: torch.Tensor, stats: list[StageStats], device: torch.device | str, step: int = -1,
                ) -> tuple[torch.Tensor, tuple[StageRecord, ...], torch.Tensor]:
    """All-gathers every rank's loss contribution and stage numbers once; returns the global loss,
    one record per stage and the gathered ``[world, 1 + stages * fields]`` table."""
    row = [float(loss_sum)] + [float(getattr(s, f)) for s in stats for f in FIELDS]
    local = torch.tensor(row, dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered = local.new_empty(dist.get_world_size() * local.numel())
        with collective("the step's record gather", range(dist.get_world_size())):
            world_collectives().all_gather_into(gathered, local)
        gathered = gathered.view(dist.get_world_size(), local.numel())
    else:
        gathered = local.unsqueeze(0)
    loss = gathered[:, 0].sum()
    records = []
    for i, s in enumerate(stats):
        cols = {f: gathered[:, 1 + i * len(FIELDS) + j] for j, f in enumerate(FIELDS)}
        records.append(StageRecord(
            step=step, order=s.order, layout=s.layout, label=s.label,
            tokens=float((cols["tokens"] / cols["counted_by"]).sum()),
            documents=float((cols["documents"] / cols["counted_by"]).sum()),
            micro_batches=float((cols["micro_batches"] / cols["counted_by"]).sum()),
            switch_s=float(cols["switch_s"].max()), switch_mb=float(cols["switch_bytes"].sum()) / 1e6,
            compute_s=float(cols["compute_s"].max()), reduce_s=float(cols["reduce_s"].max()),
            stage_s=float((cols["switch_s"] + cols["compute_s"] + cols["reduce_s"]).max()),
            fsdp_mb=float(cols["fsdp_bytes"].sum()) / 1e6, activation_checkpointing=s.activation_checkpointing,
            before_s=float(cols["before_s"].max())))
    return loss, tuple(records), gathered


def rank_stage_fields(table: torch.Tensor, num_stages: int) -> list[list[dict[str, float]]]:
    """The gathered table as ``[rank][stage] -> {field: value}`` (rank-major, stage order)."""
    rows = table.detach().to("cpu", torch.float64).tolist()
    width = len(FIELDS)
    return [[dict(zip(FIELDS, row[1 + i * width:1 + (i + 1) * width])) for i in range(num_stages)] for row in rows]
