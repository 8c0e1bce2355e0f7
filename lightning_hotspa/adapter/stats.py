"""The step's logger metrics, built in this one place from the step runner's typed records.

Metrics are keyed by stage (:func:`stage_keys`): ``<stage>`` is the layout's name, ``+ac`` when the
stage checkpointed activations fully, ``+sac`` selectively (``Checkpointing.suffix``; ``dp8``,
``dp8+ac``: the cost planner may split a layout's documents
over two such stages in one step), and ``#2``, ``#3``... on a name's later stages in the same step.
The strategy logs :func:`step_metrics`:
``hotspa/<stage>/{tokens,documents,micro_batches,switch_s,switch_MB,compute_s,reduce_s,tokens_per_s}``
and step totals ``hotspa/step_s``, ``hotspa/tokens_per_s``, ``hotspa/switch_fraction``. Token counts
are summed over ranks (tp copies once), times are the slowest rank's (:class:`StageRecord`). The
monitor adds :func:`monitor_metrics` (what needs the model or the cost model): ``train/step_loss``,
``hotspa/<stage>/{stage_s,mfu,predicted_s}``, ``hotspa/mfu``, ``hotspa/predicted_step_s`` and
``hotspa/predicted_over_measured``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ..engine.records import StageRecord

__all__ = ["monitor_metrics", "stage_keys", "step_metrics"]


def stage_keys(records: Sequence[StageRecord]) -> list[str]:
    """One metric key per record, unique within the step: :attr:`StageRecord.name`, with ``#<n>``
    on the n-th stage of a name that repeats.

    Args:
        records: one step's records, in stage order.
    """
    seen: dict[str, int] = {}
    keys = []
    for r in records:
        seen[r.name] = seen.get(r.name, 0) + 1
        keys.append(r.name if seen[r.name] == 1 else f"{r.name}#{seen[r.name]}")
    return keys


def step_metrics(records: Sequence[StageRecord]) -> dict[str, float]:
    """The logger metrics of one step's records (empty for a step without stages)."""
    metrics: dict[str, float] = {}
    step_s = switch_total = tokens_total = 0.0
    for r, key in zip(records, stage_keys(records)):
        prefix = f"hotspa/{key}"
        metrics[f"{prefix}/tokens"] = r.tokens
        metrics[f"{prefix}/documents"] = r.documents
        metrics[f"{prefix}/micro_batches"] = r.micro_batches
        metrics[f"{prefix}/switch_s"] = r.switch_s
        metrics[f"{prefix}/switch_MB"] = r.switch_mb
        if r.layout.fsdp:  # per-unit gathers and reduce-scatters of a sharded working copy
            metrics[f"{prefix}/fsdp_MB"] = r.fsdp_mb
        metrics[f"{prefix}/compute_s"] = r.compute_s
        metrics[f"{prefix}/reduce_s"] = r.reduce_s
        metrics[f"{prefix}/tokens_per_s"] = r.tokens / r.stage_s if r.stage_s > 0 else 0.0
        step_s += r.stage_s
        switch_total += r.switch_s
        tokens_total += r.tokens
    if records:
        metrics["hotspa/step_s"] = step_s
        metrics["hotspa/tokens_per_s"] = tokens_total / step_s if step_s > 0 else 0.0
        metrics["hotspa/switch_fraction"] = switch_total / step_s if step_s > 0 else 0.0
    return metrics


def monitor_metrics(records: Sequence[StageRecord], step_s: float | None, loss: float | None,
                    peak_flops_total: float | None,
                    planner_notes: Mapping[str, float] | None = None) -> dict[str, float]:
    """The monitor's metrics of one step's records, with ``flops`` / ``predicted_s`` filled in, and the
    planner's notes on the step (``hotspa/planner/*``: e.g. the never-worse-than-static guard)."""
    out: dict[str, float] = {f"hotspa/planner/{k}": float(v) for k, v in (planner_notes or {}).items()}
    if loss is not None:
        out["train/step_loss"] = loss
    for r, key in zip(records, stage_keys(records)):
        prefix = f"hotspa/{key}"
        out[f"{prefix}/stage_s"] = r.seconds
        if (mfu := r.mfu(peak_flops_total)) is not None:
            out[f"{prefix}/mfu"] = mfu
        if r.predicted_s is not None:
            out[f"{prefix}/predicted_s"] = r.predicted_s
    if records and all(r.flops is not None for r in records) and peak_flops_total and step_s:
        out["hotspa/mfu"] = sum(r.flops or 0.0 for r in records) / (step_s * peak_flops_total)
    if records and all(r.predicted_s is not None for r in records) and step_s:
        predicted = sum(r.predicted_s or 0.0 for r in records)
        out["hotspa/predicted_step_s"] = predicted
        out["hotspa/predicted_over_measured"] = predicted / step_s
    return out
