"""The step's logger metrics, built in this one place from the step runner's typed records.

Metrics are keyed by stage (:func:`stage_keys`, the one place a stage's key is made): the stage's
length bucket (:func:`bucket_key`: ``(256,1024]`` -> ``256-1024``), so a bucket's charts stay one
series when the layout running it changes (the layout is a column of the plan table, never part of
the key); a stage without a label is keyed by its layout's name (:attr:`StageRecord.name`); ``#2``,
``#3``... on a key's later stages in the same step (the cost planner may run one bucket in two stages).
The strategy logs :func:`step_metrics`:
``hotspa/<stage>/{tokens,padded_tokens,documents,micro_batches,switch_s,switch_MB,compute_s,reduce_s,
stage_s,tokens_per_s}`` (``tokens``: the stage's documents' tokens in the global plan; ``padded_tokens``:
what its ranks computed, cp / tp padding included; ``stage_s``: the stage's ONE seconds figure,
:attr:`StageRecord.seconds`, and ``tokens_per_s`` is exactly ``tokens / stage_s``) and step totals
``hotspa/tokens``, ``hotspa/documents`` (the sums of the stages': the step's global batch),
``hotspa/between_s`` (what lies between the stages), ``hotspa/step_s`` (exactly the sum of the stages'
``stage_s`` plus ``between_s``), ``hotspa/tokens_per_s`` (``tokens / step_s``),
``hotspa/switch_fraction``. A block stage adds one key set per block that
ran (:func:`block_metrics`): ``hotspa/<stage>/block<k>/{tokens,documents,micro_batches,ranks,
compute_s,tokens_per_s}``, ``<k>`` the block's index in the stage, its tokens summing to the stage's.
Only the stages that ran in a step have keys in that step: the strategy forgets the previous step's
``hotspa/*`` values first (``lightning_compat.forget_logged``; Lightning would otherwise hand the
loggers every key's last value at every step). Token counts are summed over ranks (tp copies once),
times are the slowest rank's (:class:`StageRecord`). The monitor adds :func:`monitor_metrics`
(what needs the model or the cost model): ``train/step_loss``,
``hotspa/<stage>/{mfu,predicted_s}``, ``hotspa/mfu``, ``hotspa/predicted_step_s`` and
``hotspa/predicted_over_measured``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from ...engine.records import StageRecord, rank_stage_fields
from ...layout import MeshShape
from ...plan import StepPlan, block_ranks

__all__ = ["block_metrics", "bucket_key", "monitor_metrics", "stage_doc_tokens", "stage_keys", "step_metrics"]

_KEY_CHARS = re.compile(r"[^A-Za-z0-9_.+-]+")


def bucket_key(label: str) -> str:
    """A length bucket's label as a metric-key part: ``(256,1024]`` -> ``256-1024``.

    Args:
        label: the stage's label (:attr:`StageRecord.label`), e.g. ``"(256,1024]"``; may be empty.
    """
    text = label.strip().strip("()[]").replace(",", "-")
    return _KEY_CHARS.sub("_", text).strip("_")


def stage_keys(records: Sequence[StageRecord]) -> list[str]:
    """One metric key per record, unique within the step: :func:`bucket_key` of its label (its
    :attr:`StageRecord.name` where it has none), with ``#<n>`` on the n-th stage of a key that repeats.

    Args:
        records: one step's records, in stage order.
    """
    seen: dict[str, int] = {}
    keys = []
    for r in records:
        key = bucket_key(r.label) or r.name
        seen[key] = seen.get(key, 0) + 1
        keys.append(key if seen[key] == 1 else f"{key}#{seen[key]}")
    return keys


def stage_doc_tokens(plan: Any, stages: int) -> list[int] | None:
    """Each stage's document tokens in a global :class:`StepPlan` (the batch's tokens, without the
    cp / tp padding the ranks add), by stage order; None for anything else, or for a plan whose
    stages are not the ``stages`` the ranks ran.

    Args:
        plan: ``RankPlan.extras["global_plan"]``, or None.
        stages: how many stages the rank's plan has.
    """
    if not isinstance(plan, StepPlan) or len(plan.stages) != stages:
        return None
    return [int(sum(int(plan.doc_lengths[d]) for d in stage.doc_ids)) for stage in plan.stages]


def step_metrics(records: Sequence[StageRecord], doc_tokens: Sequence[int] | None = None,
                 between_s: float = 0.0) -> dict[str, float]:
    """The logger metrics of one step's records (empty for a step without stages).

    Args:
        records: the step's records, in stage order.
        doc_tokens: each stage's document tokens (:func:`stage_doc_tokens`), by ``order``. Given,
            ``tokens`` and ``tokens_per_s`` count them and ``padded_tokens`` what the ranks computed
            (documents plus cp / tp padding); else ``tokens`` is what the ranks computed.
        between_s: what lay between the stages (:attr:`StepResult.between_s`), part of ``step_s``.
    """
    metrics: dict[str, float] = {}
    step_s = switch_total = tokens_total = documents_total = 0.0
    for r, key in zip(records, stage_keys(records)):
        prefix = f"hotspa/{key}"
        tokens = float(doc_tokens[r.order]) if doc_tokens is not None and r.order < len(doc_tokens) else r.tokens
        metrics[f"{prefix}/tokens"] = tokens
        if doc_tokens is not None:
            metrics[f"{prefix}/padded_tokens"] = r.tokens
        metrics[f"{prefix}/documents"] = r.documents
        metrics[f"{prefix}/micro_batches"] = r.micro_batches
        metrics[f"{prefix}/switch_s"] = r.switch_s
        metrics[f"{prefix}/switch_MB"] = r.switch_mb
        if r.layout.fsdp:  # per-unit gathers and reduce-scatters of a sharded working copy
            metrics[f"{prefix}/fsdp_MB"] = r.fsdp_mb
        metrics[f"{prefix}/compute_s"] = r.compute_s
        metrics[f"{prefix}/reduce_s"] = r.reduce_s
        metrics[f"{prefix}/stage_s"] = r.seconds
        metrics[f"{prefix}/tokens_per_s"] = tokens / r.seconds if r.seconds > 0 else 0.0
        step_s += r.seconds
        switch_total += r.switch_s
        tokens_total += tokens
        documents_total += r.documents
    if records:
        step_s += between_s
        metrics["hotspa/between_s"] = between_s
        metrics["hotspa/tokens"] = tokens_total
        metrics["hotspa/documents"] = documents_total
        metrics["hotspa/step_s"] = step_s
        metrics["hotspa/tokens_per_s"] = tokens_total / step_s if step_s > 0 else 0.0
        metrics["hotspa/switch_fraction"] = switch_total / step_s if step_s > 0 else 0.0
    return metrics


def block_metrics(records: Sequence[StageRecord], plan: Any, table: Any, mesh: MeshShape | None) -> dict[str, float]:
    """Each block's metrics in the step's block stages (empty without one): its documents' tokens
    (the global plan's, so a stage's blocks add up to the stage), documents, micro-batches, ranks,
    and its slowest rank's switch + compute seconds and tokens per second over them. A block with no
    micro-batch logs nothing (it did not run).

    Args:
        records: the step's records, in stage order.
        plan: ``RankPlan.extras["global_plan"]`` (a :class:`StepPlan`), or None: no block metrics.
        table: the step's gathered ``[world, ...]`` table (:attr:`StepResult.table`).
        mesh: the world mesh's shape, or None: no block metrics.
    """
    if not isinstance(plan, StepPlan) or mesh is None or len(plan.stages) != len(records):
        return {}
    if not any(s.blocks and not s.lockstep_blocks for s in plan.stages):
        return {}
    fields = rank_stage_fields(table, len(records))
    out: dict[str, float] = {}
    for i, (key, stage) in enumerate(zip(stage_keys(records), plan.stages)):
        if not stage.blocks or stage.lockstep_blocks:
            continue
        for k, block in enumerate(stage.blocks):
            docs = [d for group in block.micro_batches for mb in group for d in mb]
            if not docs:
                continue
            ranks = block_ranks(block, mesh)
            seconds = max(fields[rank][i]["switch_s"] + fields[rank][i]["compute_s"] for rank in ranks)
            tokens = float(sum(int(plan.doc_lengths[d]) for d in docs))
            prefix = f"hotspa/{key}/block{k}"
            out[f"{prefix}/tokens"] = tokens
            out[f"{prefix}/documents"] = float(len(docs))
            out[f"{prefix}/micro_batches"] = float(sum(len(group) for group in block.micro_batches))
            out[f"{prefix}/ranks"] = float(len(ranks))
            out[f"{prefix}/compute_s"] = max(fields[rank][i]["compute_s"] for rank in ranks)
            out[f"{prefix}/tokens_per_s"] = tokens / seconds if seconds > 0 else 0.0
    return out


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
