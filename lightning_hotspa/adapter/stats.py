"""Per-stage measurements of one step, and the step's one small collective that aggregates them.

Metric names are stable across steps (keyed by layout, which appears at most once per plan):
``hotspa/<layout>/{tokens,documents,micro_batches,switch_s,switch_MB,compute_s,reduce_s,tokens_per_s}``
and step totals ``hotspa/step_s``, ``hotspa/tokens_per_s``, ``hotspa/switch_fraction``.

The same gather carries each rank's cost-model features of every stage (``sum_sq``, ``sum_len``: its
cp-padded document lengths, see :class:`~lightning_hotspa.planner.calibration.Observation`), so a
profiled planner gets every rank's timings with no collective of its own:
:func:`gathered_observations`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..layout import Layout
from ..plan import RankStage

__all__ = ["StageStats", "gathered_observations", "step_metrics"]

_FIELDS = ("tokens", "documents", "micro_batches", "target_tokens", "switch_bytes", "switch_s", "compute_s",
           "reduce_s", "sum_sq", "sum_len")


@dataclass(frozen=True)
class StageStats:
    """What one rank saw of one stage.

    ``reduce_*``: the gradient reduction at the stage end. A stage followed by one of the same tp
    degree does not reduce (0 s, 0 bytes, 0 collectives): the last stage of such a run reduces the
    whole run's gradients, so its ``reduce_s`` pays for all of them.
    """

    layout: str
    label: str
    tp: int
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

    @classmethod
    def measure(cls, stage: RankStage, switch_report, grad_report, *, switch_s: float, compute_s: float,
                reduce_s: float) -> StageStats:
        mbs = [m for m in stage.micro_batches if hasattr(m, "num_tokens")]
        sum_sq = sum_len = 0.0
        if mbs:  # a local document of a cp rank is 1/cp of its padded row; one host copy per stage
            s = torch.cat([m.cu_seqlens.diff() for m in mbs]).double() * stage.layout.cp
            sum_sq, sum_len = torch.stack([(s * s).sum(), s.sum()]).tolist()
        return cls(stage.layout.name, stage.label, stage.layout.tp,
                   tokens=sum(m.num_tokens for m in mbs), documents=sum(m.num_documents for m in mbs),
                   micro_batches=len(stage.micro_batches), target_tokens=sum(m.num_target_tokens for m in mbs),
                   switch_bytes=switch_report.bytes_received, switch_s=switch_s, compute_s=compute_s,
                   reduce_s=reduce_s, sum_sq=sum_sq, sum_len=sum_len,
                   reduce_bytes=grad_report.bytes_received, reduce_collectives=grad_report.collectives)


def step_metrics(loss_sum: torch.Tensor, stats: list[StageStats], device: torch.device,
                 ) -> tuple[torch.Tensor, dict[str, float], torch.Tensor]:
    """All-gathers every rank's loss contribution and stage numbers once; returns the exact global
    token-mean loss, the step's metrics (token counts summed over ranks, tp copies counted once;
    times are the slowest rank's) and the gathered ``[world, 1 + stages * fields]`` table (the same
    on every rank: :func:`gathered_observations` reads it)."""
    row = [float(loss_sum)] + [float(getattr(s, f)) for s in stats for f in _FIELDS]
    local = torch.tensor(row, dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered = local.new_empty(dist.get_world_size() * local.numel())
        dist.all_gather_into_tensor(gathered, local)
        gathered = gathered.view(dist.get_world_size(), local.numel())
    else:
        gathered = local.unsqueeze(0)
    loss = gathered[:, 0].sum()
    metrics: dict[str, float] = {}
    step_s = switch_total = tokens_total = 0.0
    for i, s in enumerate(stats):
        cols = {f: gathered[:, 1 + i * len(_FIELDS) + j] for j, f in enumerate(_FIELDS)}
        prefix = f"hotspa/{s.layout}"
        tokens = float(cols["tokens"].sum()) / s.tp
        stage_s = float((cols["switch_s"] + cols["compute_s"] + cols["reduce_s"]).max())
        metrics[f"{prefix}/tokens"] = tokens
        metrics[f"{prefix}/documents"] = float(cols["documents"].sum()) / s.tp
        metrics[f"{prefix}/micro_batches"] = float(cols["micro_batches"].sum()) / s.tp
        metrics[f"{prefix}/switch_s"] = float(cols["switch_s"].max())
        metrics[f"{prefix}/switch_MB"] = float(cols["switch_bytes"].sum()) / 1e6
        metrics[f"{prefix}/compute_s"] = float(cols["compute_s"].max())
        metrics[f"{prefix}/reduce_s"] = float(cols["reduce_s"].max())
        metrics[f"{prefix}/tokens_per_s"] = tokens / stage_s if stage_s > 0 else 0.0
        step_s += stage_s
        switch_total += metrics[f"{prefix}/switch_s"]
        tokens_total += tokens
    if stats:
        metrics["hotspa/step_s"] = step_s
        metrics["hotspa/tokens_per_s"] = tokens_total / step_s if step_s > 0 else 0.0
        metrics["hotspa/switch_fraction"] = switch_total / step_s if step_s > 0 else 0.0
    return loss, metrics, gathered


def gathered_observations(table: torch.Tensor, stats: Sequence[StageStats], activation_checkpointing: Sequence[bool]):
    """Every rank's measured stage seconds with its cost-model features, from :func:`step_metrics`'
    table: rank-major, stage order, bit-identical on every rank. ``activation_checkpointing``: per
    stage, whether it ran with checkpointing. Stages a rank had no micro-batch in are skipped."""
    from ..planner.calibration import Observation

    rows = table.detach().to("cpu", torch.float64).tolist()
    width = len(_FIELDS)
    out = []
    for row in rows:
        for i, (s, ac) in enumerate(zip(stats, activation_checkpointing)):
            cols = dict(zip(_FIELDS, row[1 + i * width:1 + (i + 1) * width]))
            if cols["micro_batches"] < 1:
                continue
            out.append(Observation(Layout.parse(s.layout), bool(ac), cols["sum_sq"], cols["sum_len"],
                                   int(cols["micro_batches"]), cols["compute_s"], int(cols["documents"])))
    return out
