"""W&B metrics of a block stage: one key set per block that ran, its tokens adding up to the stage's."""

from __future__ import annotations

import torch

from lightning_hotspa.adapter.observability.stats import block_metrics, stage_doc_tokens, step_metrics
from lightning_hotspa.engine.records import FIELDS, StageRecord
from lightning_hotspa.layout import Layout, MeshShape
from lightning_hotspa.plan import Block, Stage, StepPlan, block_dp_groups

LAYOUTS = [Layout.parse(x) for x in ("dp4", "dp2xcp2:kv", "dp2xcp2:kv:fsdp2")]


def _plan_and_table() -> tuple[StepPlan, MeshShape, torch.Tensor, list[StageRecord]]:
    """4 ranks: a sharded cp2 block on 0-1 (one micro-batch), a dp block on 2 (two), an idle dp block on 3."""
    mesh = MeshShape.for_layouts(LAYOUTS, 4)
    cp, dp = Layout.parse("dp2xcp2:kv"), Layout.parse("dp4")
    lengths = (900, 300, 200, 100, 50)
    blocks = (Block(cp, block_dp_groups(cp, mesh, (0, 1)), (((0,),),), sharded=True, activation_checkpointing="full"),
              Block(dp, block_dp_groups(dp, mesh, (2,)), (((1, 2), (3, 4)),)),
              Block(dp, block_dp_groups(dp, mesh, (3,)), ((),)))
    plan = StepPlan(0, lengths, (Stage(cp, (), label="(256,1024]", blocks=blocks),))
    # per rank: switch_s 0.1, compute_s by rank (the cp block's slowest rank is 1, the dp block is rank 2)
    compute = [2.0, 3.0, 1.5, 0.0]
    rows = []
    for rank in range(4):
        vals = {f: 0.0 for f in FIELDS} | {"switch_s": 0.1, "compute_s": compute[rank], "tp": 1.0}
        rows.append([0.0] + [vals[f] for f in FIELDS])
    record = StageRecord(step=0, order=0, layout=cp, label="(256,1024]", tokens=1600.0, documents=5.0,
                         micro_batches=3.0, switch_s=0.1, switch_mb=0.0, compute_s=3.0, reduce_s=0.2, stage_s=3.3)
    return plan, mesh, torch.tensor(rows, dtype=torch.float64), [record]


def test_each_block_that_ran_logs_its_tokens_seconds_and_rate() -> None:
    plan, mesh, table, records = _plan_and_table()
    metrics = block_metrics(records, plan, table, mesh)
    stage = "hotspa/256-1024"  # the bucket: no layout in the key
    assert set(metrics) == {f"{stage}/{b}/{k}" for b in ("block0", "block1")
                            for k in ("tokens", "documents", "micro_batches", "ranks", "compute_s", "tokens_per_s")}
    assert metrics[f"{stage}/block0/tokens"] == 900.0 and metrics[f"{stage}/block0/ranks"] == 2.0
    assert metrics[f"{stage}/block0/compute_s"] == 3.0  # the block's slowest rank
    assert abs(metrics[f"{stage}/block0/tokens_per_s"] - 900.0 / 3.1) < 1e-9
    assert metrics[f"{stage}/block1/tokens"] == 650.0 and metrics[f"{stage}/block1/micro_batches"] == 2.0
    assert abs(metrics[f"{stage}/block1/tokens_per_s"] - 650.0 / 1.6) < 1e-9
    # the blocks' tokens add up to the stage's document tokens (the idle block logs nothing)
    stage_tokens = step_metrics(records, stage_doc_tokens(plan, 1))[f"{stage}/tokens"]
    assert sum(v for k, v in metrics.items() if k.endswith("/tokens")) == stage_tokens == 1550.0


def test_no_block_metrics_without_a_block_stage_or_a_plan() -> None:
    plan, mesh, table, records = _plan_and_table()
    assert block_metrics(records, None, table, mesh) == {}
    assert block_metrics(records, plan, table, None) == {}
    plain = StepPlan(0, (10, 20), (Stage(Layout.parse("dp4"), (((0,),), ((1,),), (), ())),))
    assert block_metrics(records, plain, table, mesh) == {}
