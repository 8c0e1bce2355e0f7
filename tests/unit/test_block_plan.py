"""Block stages (plan.Block): the contract's validation and each rank's slice (docs/DESIGN.md §4, "Blocks")."""

import pytest
import torch

from lightning_hotspa.activation_checkpointing import Checkpointing
from lightning_hotspa.layout import Layout, LayoutError, MeshShape
from lightning_hotspa.plan import (
    Block,
    PlanError,
    Stage,
    StepPlan,
    block_dp_groups,
    block_ranks,
    check_block_capacity,
    slice_plan,
)

L = Layout.parse
# 8 ranks: a cp4:kv block on 0-3 sharded over itself, a dp2 block on 4-5 sharded, two replicated dp1 blocks
LAYOUTS = ["dp8", "dp8:fsdp2", "dp2xcp4:kv", "dp2xcp4:kv:fsdp4", "dp4xtp2", "dp8:fsdp"]


def _mesh():
    return MeshShape.for_layouts([L(x) for x in LAYOUTS], 8)


def _docs(lengths):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(1, 255, (n,), generator=g) for n in lengths]


def _stage(mesh):
    cp4, dp8, tp2 = L("dp2xcp4:kv"), L("dp8"), L("dp4xtp2")
    return Stage(L("dp8"), (), label="blocks", blocks=(
        Block(cp4, block_dp_groups(cp4, mesh, range(0, 4)), (((0,),),), sharded=True,
              activation_checkpointing="full"),
        Block(dp8, block_dp_groups(dp8, mesh, range(4, 6)), (((1,), (2,)), ((3,),)), sharded=True),
        Block(tp2, block_dp_groups(tp2, mesh, range(6, 8)), ((),)),
    ))


def test_block_fields_default_and_parse():
    b = Block(L("dp4"), (0,), (((0,),),))
    assert b.sharded is False and b.activation_checkpointing is None and b.working_layout == L("dp4")
    assert b.checkpointing(Checkpointing.FULL) is Checkpointing.FULL
    c = Block(L("dp2xcp2"), (1,), (((0,),),), sharded=True, activation_checkpointing=True)
    assert c.activation_checkpointing is Checkpointing.FULL
    assert c.checkpointing(Checkpointing.NONE) is Checkpointing.FULL
    assert c.working_layout == L("dp2xcp2:fsdp2") and c.size == 2
    assert Block(L("dp2xcp2"), (0, 1), ((), ()), sharded=True).working_layout == L("dp2xcp2:fsdp")


@pytest.mark.parametrize("kwargs, match", [
    ({"sharded": 1}, "sharded must be True or False"),
    ({"sharded": True}, "one dp group and no cp"),
    ({"activation_checkpointing": "sometimes"}, "sometimes"),
])
def test_block_validation_names_the_value(kwargs, match):
    with pytest.raises((PlanError, ValueError), match=match):
        Block(L("dp4"), (0,), (((0,),),), **kwargs)


def test_sharded_block_names_a_plain_layout():
    with pytest.raises(PlanError, match="plain compute layout"):
        Block(L("dp4:fsdp"), (0, 1), ((), ()), sharded=True)


def test_block_stage_validation():
    cp2 = L("dp2xcp2")
    legacy = Block(L("dp2xcp2:fsdp"), (0,), (((0,),),))
    with pytest.raises(PlanError, match="mixes blocks of sharded layouts"):
        Stage(L("dp4:fsdp"), (), blocks=(legacy, Block(cp2, (1,), (((1,),),))))
    with pytest.raises(PlanError, match="world 8"):
        Stage(L("dp4"), (), blocks=(Block(L("dp8"), (0,), (((0,),),)),))
    with pytest.raises(PlanError, match="sharded block in layout dp2xcp2 would run selective"):
        Stage(L("dp4"), (), activation_checkpointing="selective",
              blocks=(Block(cp2, (0, 1), (((0,),), ((1,),)), sharded=True),))
    assert Stage(L("dp4"), (), activation_checkpointing="selective",
                 blocks=(Block(cp2, (0, 1), (((0,),), ((1,),)), sharded=True, activation_checkpointing="full"),))
    # a plain-block stage may be named by any layout of its world, sharded included
    assert Stage(L("dp4:fsdp"), (), blocks=(Block(cp2, (0, 1), (((0,),), ((1,),)), sharded=True),)).blocks


def test_block_ranks_must_be_an_aligned_sub_mesh():
    mesh = _mesh()
    dp8 = L("dp8")
    assert block_ranks(Block(dp8, block_dp_groups(dp8, mesh, range(4, 6)), ((), ())), mesh) == (4, 5)
    with pytest.raises(PlanError, match=r"ranks \[5, 6\], not an aligned sub-mesh"):
        block_ranks(Block(dp8, block_dp_groups(dp8, mesh, (5, 6)), ((), ())), mesh)
    with pytest.raises(PlanError, match="not an aligned sub-mesh"):
        block_ranks(Block(dp8, block_dp_groups(dp8, mesh, range(0, 3)), ((), (), ())), mesh)


def test_slice_block_stage_every_rank():
    mesh = _mesh()
    plan = StepPlan(0, (9, 6, 5, 4), (_stage(mesh),))
    docs = _docs(plan.doc_lengths)
    seen = []
    for rank in range(8):
        st = slice_plan(plan, docs, mesh, rank).stages[0]
        assert st.layout == L("dp8") and len(st.peers) == 8
        assert st.peers[:4] == (L("dp2xcp4:kv:fsdp4"),) * 4 and st.peers[4:6] == (L("dp8:fsdp2"),) * 2
        assert st.peers[6:] == (L("dp4xtp2"),) * 2
        assert st.working_layout(rank) == st.peers[rank] and st.working_layouts == st.peers
        if rank < 4:  # one micro-batch of doc 0, cp-sliced 4 ways; the block's own checkpointing; a sharded
            # block computes in its working layout (the same tp / cp groups as its plain one)
            assert st.compute_layout == L("dp2xcp4:kv:fsdp4") and st.activation_checkpointing is Checkpointing.FULL
            assert st.num_rounds == 1 and st.micro_batches[0].cp_size == 4
        elif rank < 6:  # lockstep inside the block only: 2 rounds on both of its ranks
            assert st.compute_layout == L("dp8:fsdp2") and st.activation_checkpointing is Checkpointing.NONE
            assert st.rounds == 2
        else:  # the replicated block without a micro-batch
            assert st.compute_layout == L("dp4xtp2") and st.micro_batches == () and st.num_rounds == 0
        seen += [d for m in st.micro_batches for d in m.doc_ids if rank < 4 or rank >= 4]
    assert sorted(set(seen)) == [0, 1, 2, 3]


def test_slice_block_stage_refusals_name_the_value():
    mesh = _mesh()
    dp8, tp2 = L("dp8"), L("dp4xtp2")
    docs = _docs((5, 5))
    # a sharded block's working layout must be among the mesh's (its groups exist from set-up)
    three = Stage(dp8, (), blocks=(Block(dp8, block_dp_groups(dp8, mesh, range(4)), (((0,),), (), (), ()),
                                         sharded=True),
                                   Block(tp2, block_dp_groups(tp2, mesh, range(4, 8)), (((1,),), ()))))
    with pytest.raises(LayoutError, match="dp8:fsdp4"):
        slice_plan(StepPlan(0, (5, 5), (three,)), docs, mesh, 0)
    gap = Stage(dp8, (), blocks=(Block(tp2, block_dp_groups(tp2, mesh, range(4)), (((0, 1),), ())),))
    with pytest.raises(PlanError, match=r"ranks \[4, 5, 6, 7\] are in no block"):
        slice_plan(StepPlan(0, (5, 5), (gap,)), docs, mesh, 0)
    twice = Stage(dp8, (), blocks=(Block(tp2, block_dp_groups(tp2, mesh, range(8)), (((0, 1),), (), (), ())),
                                   Block(dp8, block_dp_groups(dp8, mesh, range(6, 8)), ((), ()))))
    with pytest.raises(PlanError, match="rank 6 is in block 0"):
        slice_plan(StepPlan(0, (5, 5), (twice,)), docs, mesh, 0)


def test_capacity_of_a_sharded_block_is_its_working_layouts():
    mesh = _mesh()
    plan = StepPlan(0, (9, 6, 5, 4), (_stage(mesh),))
    asked = []
    check_block_capacity(plan, lambda lay: asked.append(lay) or 100)
    assert L("dp2xcp4:kv:fsdp4") in asked and L("dp8:fsdp2") in asked and L("dp4xtp2") in asked
    with pytest.raises(PlanError, match=r"block 0 in layout dp2xcp4:kv, dp group 0, runs a micro-batch of "
                                        r"documents \[0\]"):
        check_block_capacity(plan, lambda lay: 8)
