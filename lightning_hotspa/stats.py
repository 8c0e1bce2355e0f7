"""Per-stage measurements of one step, and the step's one small collective that aggregates them.

Metric names are stable across steps (keyed by layout, which appears at most once per plan):
``hotspa/<layout>/{tokens,documents,micro_batches,switch_s,switch_MB,compute_s,reduce_s,tokens_per_s}``
and step totals ``hotspa/step_s``, ``hotspa/tokens_per_s``, ``hotspa/switch_fraction``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .plan import RankStage

__all__ = ["StageStats", "step_metrics"]

_FIELDS = ("tokens", "documents", "micro_batches", "target_tokens", "switch_bytes", "switch_s", "compute_s",
           "reduce_s")


@dataclass(frozen=True)
class StageStats:
    """What one rank saw of one stage."""

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

    @classmethod
    def measure(cls, stage: RankStage, switch_report, grad_report, *, switch_s: float, compute_s: float,
                reduce_s: float) -> StageStats:
        mbs = [m for m in stage.micro_batches if hasattr(m, "num_tokens")]
        return cls(stage.layout.name, stage.label, stage.layout.tp,
                   tokens=sum(m.num_tokens for m in mbs), documents=sum(m.num_documents for m in mbs),
                   micro_batches=len(stage.micro_batches), target_tokens=sum(m.num_target_tokens for m in mbs),
                   switch_bytes=switch_report.bytes_received, switch_s=switch_s, compute_s=compute_s,
                   reduce_s=reduce_s)


def step_metrics(loss_sum: torch.Tensor, stats: list[StageStats], device: torch.device) -> tuple[torch.Tensor, dict[str, float]]:
    """All-gathers every rank's loss contribution and stage numbers once; returns the exact global
    token-mean loss and the step's metrics (token counts summed over ranks, tp copies counted once;
    times are the slowest rank's)."""
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
    return loss, metrics
