"""Mixed-cp lockstep rounds: one sharded working copy, different cp degrees on different dp blocks
in one stage (docs/DESIGN.md §4), against the single process; and the plan's checks of them."""

import functools

import helpers
import pytest
import torch

from lightning_hotspa.layout import Layout, LayoutError, MeshShape
from lightning_hotspa.plan import Block, PlanError, Stage, StepPlan, slice_plan

# two kinds of working copy of tp 1 (plain fsdp, HSDP over pairs), each computed at cp1 and cp2
# (Ulysses and all-gather-KV), and a tp2 layout between them (its own reduction)
MIXED_LAYOUTS = ["dp4:fsdp", "dp2xcp2:fsdp", "dp2xcp2:kv:fsdp", "dp2xtp2", "dp4:fsdp2", "dp2xcp2:fsdp2"]


def _groups_of(layout: Layout, ranks) -> tuple[int, ...]:
    return helpers.groups_of(MIXED_LAYOUTS, layout, ranks)


def _block(name: str, ranks, counts, docs: list[int]) -> Block:
    return helpers.block_of(MIXED_LAYOUTS, name, ranks, counts, docs)


def mixed_block_plans() -> list[StepPlan]:
    """Step 0: dp4:fsdp's copy, ranks {0,1} at cp2 (1 micro-batch: an idle round) beside ranks 2
    and 3 at cp1 (2 and 1), then tp2. Step 1: a dp4:fsdp stage carries its gradients into a mixed
    stage on dp2xcp2:fsdp's copy (recomputing activations): cp1 on {0,1}, all-gather-KV cp2 on
    {2,3}. Step 2: the HSDP copy of dp4:fsdp2, cp2 on {2,3} beside cp1 on {0,1}, then tp2."""
    plans = []
    for step, shape in enumerate([
        ("dp4:fsdp", [("dp2xcp2:fsdp", (0, 1), [1]), ("dp4:fsdp", (2, 3), [2, 1])], "dp2xtp2"),
        ("dp2xcp2:fsdp", [("dp4:fsdp", (0, 1), [1, 2]), ("dp2xcp2:kv:fsdp", (2, 3), [2])], "dp4:fsdp"),
        ("dp4:fsdp2", [("dp2xcp2:fsdp2", (2, 3), [2]), ("dp4:fsdp2", (0, 1), [1, 1])], "dp2xtp2"),
    ]):
        working, blocks, other = shape
        lengths = helpers.LENGTHS[step]
        docs = sorted(range(len(lengths)), key=lambda i: -lengths[i])  # the longest ones go first
        mixed = Stage(Layout.parse(working), (), label="mixed",
                      blocks=tuple(_block(name, ranks, counts, docs) for name, ranks, counts in blocks))
        rest = helpers.deal(Layout.parse(other), sorted(docs))
        stages = (mixed, rest) if step != 1 else (rest, mixed)
        plans.append(StepPlan(step, tuple(lengths), stages))
    return plans


def run_mixed_blocks(precision="32-true", kv_heads=None):
    """:func:`fit_and_compare` over :func:`mixed_block_plans`; ``kv_heads``: a tiny model with that many
    kv heads (fewer than the cp2 blocks' cp with 1)."""
    return helpers.fit_and_compare(MIXED_LAYOUTS, 3, precision, plans=mixed_block_plans(),
                                   activation_checkpointing=["dp2xcp2:fsdp"],
                                   make_model=functools.partial(helpers.tiny_lm, kv_heads=kv_heads))


@pytest.mark.parametrize("precision, kv_heads, grad_tol, loss_tol, weight_tol", [
    ("32-true", None, 1e-5, 1e-5, 1e-4),
    # one kv head: fewer than the cp2 blocks' cp (Ulysses and all-gather-KV)
    pytest.param("32-true", 1, 1e-5, 1e-5, 1e-4, marks=pytest.mark.slow),
    # fp64 removes the reduction-order noise: the whole 3-step trajectory must match
    pytest.param("64-true", None, 1e-10, 1e-12, 1e-9, marks=pytest.mark.slow),
])
def test_mixed_cp_blocks_in_one_sharded_stage_match_single_process(ranks, precision, kv_heads, grad_tol,
                                                                    loss_tol, weight_tol):
    """The core invariant for mixed-cp rounds: per step the gradients equal the single process's on
    the same weights, and after 3 AdamW steps the weights equal the single process's."""
    result = ranks(4).run(run_mixed_blocks, precision, kv_heads)[0]
    helpers.check_against_single_process(result, 3, grad_tol, loss_tol, weight_tol)


def test_a_rank_slices_its_blocks_micro_batches_with_its_blocks_cp():
    """Ranks 0 and 1 get the cp2 block's document in halves, ranks 2 and 3 their own dp group's
    whole documents; every rank runs the busiest group's rounds."""
    plan = mixed_block_plans()[0]
    mesh = MeshShape.for_layouts([Layout.parse(x) for x in MIXED_LAYOUTS], 4)
    docs = [torch.arange(n) for n in plan.doc_lengths]
    stages = [slice_plan(plan, docs, mesh, r).stages[0] for r in range(4)]
    assert [s.compute_layout.name for s in stages] == ["dp2xcp2:fsdp", "dp2xcp2:fsdp", "dp4:fsdp", "dp4:fsdp"]
    assert all(s.layout.name == "dp4:fsdp" and s.num_rounds == 2 for s in stages)
    assert [[m.cp_size for m in s.micro_batches] for s in stages] == [[2], [2], [1, 1], [1]]
    assert [m.cp_rank for s in stages[:2] for m in s.micro_batches] == [0, 1]
    by_length = sorted(range(len(plan.doc_lengths)), key=lambda i: -plan.doc_lengths[i])
    assert stages[0].micro_batches[0].doc_ids == stages[1].micro_batches[0].doc_ids == tuple(by_length[:2])
    assert [m.doc_ids for m in stages[3].micro_batches] == [tuple(by_length[6:8])]  # rank 2 took the 2 before


def test_mixed_stages_refuse_what_they_cannot_run():
    fsdp, cp2 = Layout.parse("dp4:fsdp"), Layout.parse("dp2xcp2:fsdp")
    with pytest.raises(PlanError, match=r"block stage dp4 mixes blocks of sharded layouts \['dp2xcp2:fsdp'\]"):
        Stage(Layout.parse("dp4"), (), blocks=(Block(cp2, (0,), (((0,),),)),))
    with pytest.raises(PlanError, match=r"block stage dp4:fsdp mixes blocks of sharded layouts \['dp2xcp2:fsdp'\]"):
        Stage(fsdp, (), blocks=(Block(cp2, (0,), (((0,),),)), Block(Layout.parse("dp2xtp2"), (1,), (((1,),),))))
    with pytest.raises(PlanError, match=r"block in layout dp2xcp2:fsdp2: a block must shard the same"):
        Stage(fsdp, (), blocks=(Block(Layout.parse("dp2xcp2:fsdp2"), (0,), (((0,),),)),))
    with pytest.raises(PlanError, match=r"dp_groups \(2,\); they must be distinct ints in \[0, 2\)"):
        Block(cp2, (2,), (((0,),),))
    with pytest.raises(PlanError, match=r"lists 1 dp groups of micro-batches for its 2 dp_groups \(0, 1\)"):
        Block(cp2, (0, 1), (((0,),),))
    with pytest.raises(PlanError, match="has both blocks and micro_batches"):
        Stage(fsdp, (((0,),),) * 4, blocks=(Block(cp2, (0,), (((1,),),)),))
    mesh = MeshShape.for_layouts([Layout.parse(x) for x in MIXED_LAYOUTS], 4)
    docs = [torch.arange(5)] * 3
    gap = StepPlan(0, (5, 5, 5), (Stage(fsdp, (), blocks=(Block(cp2, (0,), (((0, 1, 2),),)),)),))
    with pytest.raises(PlanError, match=r"ranks \[2, 3\] are in no block of block stage dp4:fsdp"):
        slice_plan(gap, docs, mesh, 0)
    twice = StepPlan(0, (5, 5, 5), (Stage(fsdp, (), blocks=(
        Block(cp2, (0, 1), (((0,),), ((1,),))), Block(fsdp, _groups_of(fsdp, (1,)), (((2,),),)))),))
    with pytest.raises(PlanError, match=r"rank 1 is in block 0 \(dp2xcp2:fsdp\) and block 1 \(dp4:fsdp\)"):
        slice_plan(twice, docs, mesh, 0)
    foreign = StepPlan(0, (5,), (Stage(fsdp, (), blocks=(Block(Layout.parse("cp4:fsdp"), (0,), (((0,),),)),)),))
    with pytest.raises(LayoutError, match=r"uses layout cp4:fsdp, which is not among the mesh's layouts"):
        slice_plan(foreign, docs[:1], mesh, 0)


def run_mixed_evaluation(**overrides):
    """Evaluation of every mixed plan (``StepRunner.run_forward``): the token-weighted sum of the
    micro-batch losses over all ranks, and the single process's loss on the same documents.

    Args:
        overrides: the tiny preset's config changes (``n_kv_heads=1``: fewer kv heads than cp).
    """
    from helpers import TinyLlama

    return [(loss, reference) for loss, reference, _ in
            helpers.evaluate_plans(MIXED_LAYOUTS, lambda: TinyLlama(**overrides), mixed_block_plans())]


@pytest.mark.parametrize("overrides", [{}, {"n_kv_heads": 1}], ids=["gqa2", "one_kv_head"])
def test_mixed_stages_evaluate_like_the_single_process(ranks, overrides):
    """Evaluation runs each block in its own layout and the idle rounds' gathers: the global token
    mean of every mixed plan's losses equals the single process's at 1e-5 (fp32), also with fewer
    kv heads than a block's cp."""
    for ours, reference in ranks(4).run(run_mixed_evaluation, **overrides)[0]:
        assert abs(ours - reference) <= 1e-5 * abs(reference), (ours, reference)
