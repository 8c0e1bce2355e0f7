"""Free runs (planner/cost/timeline.py): dp groups of a run of one replicated tp degree start a stage
when their own blocks are free, and the planner packs and prices each stage so."""

from __future__ import annotations

import numpy as np
import pytest

from lightning_hotspa.layout import Layout, MeshShape
from lightning_hotspa.plan import Stage, StepPlan
from lightning_hotspa.planner.cost.timeline import GroupBlocks, compute_seconds
from lightning_hotspa.planner.solve.solver import CostModelPlanner


def test_group_blocks_are_the_tp_groups_of_each_dp_group():
    """On a 3-dim mesh (16 ranks: 2 x 2 x 4), every dp group spans exactly the tp blocks of the
    ranks whose dp coordinate it is, and a smaller cp's groups nest in a larger cp's."""
    layouts = [Layout.parse(x) for x in ("tp2xcp8", "dp4xtp2xcp2", "dp8xtp2", "dp2xcp8", "dp16")]
    shape = MeshShape.for_layouts(layouts, 16)
    blocks = GroupBlocks(layouts, 16)
    for lay in layouts:
        spans = blocks.spans(lay)
        assert spans.shape == (lay.dp, lay.cp)
        for rank in range(16):
            dp_rank = shape.rank_coords(lay, rank)[0]
            assert rank // lay.tp in spans[dp_rank]
    inner, outer = blocks.spans(Layout.parse("dp4xtp2xcp2")), blocks.spans(Layout.parse("tp2xcp8"))
    for g in inner:
        assert any(set(g) <= set(o) for o in outer)
    assert blocks.spans(Layout.parse("dp4xcp4")) is None  # not on this mesh: priced in step


def _planner(**kw):
    return CostModelPlanner(["dp2xcp4", "dp8", "dp8:fsdp"], model="llama7b", hardware="H100", world_size=8,
                            static_margin=0.0, **kw)


def test_a_free_run_overlaps_a_long_document_with_short_ones():
    """dp2xcp4 then dp8 (both tp1, replicated): the dp8 groups on the blocks the long document leaves
    idle start at once. Hand-computed: the run lasts max(long, short work spread as it fits)."""
    p = _planner()
    lengths = np.array([60000] + [2000] * 8)
    cp4, dp8 = (p.option(Layout.parse(x), False) for x in ("dp2xcp4", "dp8"))
    plan_stages = [(cp4, (((0,),), ())), (dp8, tuple(((1 + g,),) for g in range(8)))]
    long_s = cp4.doc_seconds(cp4.padded(lengths))[0] + cp4.per_micro_batch
    short_s = dp8.doc_seconds(dp8.padded(lengths))[1] + dp8.per_micro_batch
    spans = p.blocks.spans(Layout.parse("dp2xcp4"))
    busy = set(spans[0].tolist())  # the blocks of cp4's group 0
    free_s = compute_seconds(plan_stages, lengths, p.blocks)
    assert free_s == pytest.approx(long_s + short_s)  # the group-0 blocks: long, then a short one each
    in_step = compute_seconds(plan_stages, lengths, None)
    assert in_step == pytest.approx(long_s + short_s)
    # the same documents, the short ones packed where the long one is not: the run is the long one
    spans8 = p.blocks.spans(Layout.parse("dp8"))
    idle = [g for g in range(8) if spans8[g][0] not in busy]
    packed: list[tuple] = [()] * 8
    for k, g in enumerate(idle):
        packed[g] = ((1 + 2 * k,), (2 + 2 * k,))
    stages = [(cp4, (((0,),), ())), (dp8, tuple(packed))]
    assert compute_seconds(stages, lengths, p.blocks) == pytest.approx(max(long_s, 2 * short_s))
    # a stage of another kind (here fsdp) ends the run: every block in step again
    fs = p.option(Layout.parse("dp8:fsdp"), False)
    after = compute_seconds([*stages, (fs, tuple(((1,),) if g == 0 else () for g in range(8)))], lengths, p.blocks)
    assert after == pytest.approx(max(long_s, 2 * short_s) + fs.doc_seconds(fs.padded(lengths))[1] + fs.per_micro_batch)


def test_the_planner_packs_short_documents_around_a_long_one_and_predicts_it():
    """A mixed batch on dp2xcp4 + dp8: the plan's dp8 stage puts its documents on the groups cp4's
    long document leaves idle, the prediction credits the overlap, and plan, solve and predict agree."""
    p = _planner(activation_checkpointing=False)
    rng = np.random.default_rng(3)
    lengths = np.concatenate([[11000], rng.integers(200, 1200, 60)])
    plan = p.plan(0, lengths)
    assert [s.layout.name for s in plan.stages] == ["dp2xcp4", "dp8"]
    pred = p.predict(plan)
    assert pred.overlap_seconds > 0
    assert pred.seconds == pytest.approx(p.solve(lengths)[0], rel=1e-9)
    long_group = next(g for g, mbs in enumerate(plan.stages[0].micro_batches) if any(0 in mb for mb in mbs))
    busy = set(p.blocks.spans(Layout.parse("dp2xcp4"))[long_group].tolist())
    spans8 = p.blocks.spans(Layout.parse("dp8"))
    docs = [sum(len(mb) for mb in g) for g in plan.stages[1].micro_batches]
    on_busy = sum(d for g, d in enumerate(docs) if spans8[g][0] in busy)
    assert on_busy < sum(docs) / 2  # most short documents run beside the long one
    # priced in step, the same plan is slower by exactly the credited overlap
    in_step = sum(s.seconds for s in pred.stages) + pred.switch_seconds
    assert in_step - pred.seconds == pytest.approx(pred.overlap_seconds)


def test_a_plan_outside_the_mesh_is_priced_in_step():
    p = _planner()
    lengths = (5000, 3000)
    plan = StepPlan(0, lengths, (Stage(Layout.parse("dp8"), tuple(((d,),) if d < 2 else () for d in range(8))),))
    assert p.predict(plan).overlap_seconds == 0.0
