"""Mixed tp at once: in one stage different dp blocks hold their replicated working copy in
different tp degrees and run on their own, then one joint gradient reduction (docs/DESIGN.md §4),
against the single process; and the plan's checks of such stages."""

import functools
import math

import pytest
import torch
from helpers import (
    LENGTHS,
    SMALLISH,
    block_of,
    check_against_single_process,
    deal,
    evaluate_plans,
    fit_and_compare,
    groups_of,
    tiny_lm,
)

from lightning_hotspa.layout import Layout, MeshShape
from lightning_hotspa.plan import Block, PlanError, Stage, StepPlan, slice_plan

MIXED_TP_LAYOUTS = ["dp4", "dp2xtp2", "dp2xcp2"]


def _groups_of(layout: Layout, ranks) -> tuple[int, ...]:
    return groups_of(MIXED_TP_LAYOUTS, layout, ranks)


def _block(name: str, ranks, counts, docs: list[int]) -> Block:
    return block_of(MIXED_TP_LAYOUTS, name, ranks, counts, docs)


#: per step: the mixed stage's blocks (layout, ranks, micro-batches per dp group), and the normal
#: stages before / after it. Step 0: a tp2 block {0,1} beside two tp1 blocks {2}, {3} (2 and 1
#: micro-batches). Step 1: between a dp2xtp2 stage and a dp4 stage, tp1 on {0}, {1} beside tp2 on
#: {2,3}. Step 2: uneven blocks: tp2 on {0,1} with 3 micro-batches, a cp2 (tp1) block {2,3} with one.
MIXED_TP_SHAPES = [
    ([("dp2xtp2", (0, 1), [2]), ("dp4", (2,), [2]), ("dp4", (3,), [1])], (), ()),
    ([("dp4", (0,), [1]), ("dp4", (1,), [1]), ("dp2xtp2", (2, 3), [1])], ("dp2xtp2",), ("dp4",)),
    ([("dp2xtp2", (0, 1), [3]), ("dp2xcp2", (2, 3), [1])], (), ("dp2xtp2",)),
]


def mixed_tp_plans() -> list[StepPlan]:
    """:data:`MIXED_TP_SHAPES` as step plans over :data:`LENGTHS`: the longest documents go to the
    mixed stage's blocks, the rest are dealt to the normal stages (or all to the mixed one)."""
    plans = []
    for step, (blocks, before, after) in enumerate(MIXED_TP_SHAPES):
        lengths = LENGTHS[step]
        docs = sorted(range(len(lengths)), key=lambda i: -lengths[i])
        mixed = Stage(Layout.parse(blocks[0][0]), (), label="mixed-tp",
                      blocks=tuple(_block(name, ranks, counts, docs) for name, ranks, counts in blocks))
        rest = sorted(docs)
        others = list(before) + list(after)
        if not others:  # every document in the mixed stage: the last block takes the rest
            mixed = Stage(mixed.layout, (), label="mixed-tp", blocks=mixed.blocks[:-1] + (Block(
                mixed.blocks[-1].layout, mixed.blocks[-1].dp_groups,
                (mixed.blocks[-1].micro_batches[0] + tuple(tuple(rest[i:i + 2]) for i in range(0, len(rest), 2)),)),))
            stages = (mixed,)
        else:
            share = -(-len(rest) // len(others))
            normal = [deal(Layout.parse(x), rest[i * share:(i + 1) * share]) for i, x in enumerate(others)]
            stages = tuple(normal[:len(before)]) + (mixed,) + tuple(normal[len(before):])
        plans.append(StepPlan(step, tuple(lengths), stages))
    return plans


def run_mixed_tp(precision="32-true", kv_heads=None):
    """:func:`fit_and_compare` over :func:`mixed_tp_plans` (3 AdamW steps under a real Trainer);
    ``kv_heads``: a tiny model with that many kv heads (1: fewer than the tp2 blocks' tp, so the kv
    projections are ``replicated_partial``)."""
    return fit_and_compare(MIXED_TP_LAYOUTS, 3, precision, plans=mixed_tp_plans(),
                           make_model=functools.partial(tiny_lm, kv_heads=kv_heads))


@pytest.mark.parametrize("precision, kv_heads, grad_tol, loss_tol, weight_tol", [
    ("32-true", None, 1e-5, 1e-5, 1e-4),
    # one kv head, fewer than tp2: the kv projections' gradients are partial sums over tp
    pytest.param("32-true", 1, 1e-5, 1e-5, 1e-4, marks=pytest.mark.slow),
    # fp64 removes the reduction-order noise: the whole 3-step trajectory must match
    pytest.param("64-true", None, 1e-10, 1e-12, 1e-9, marks=pytest.mark.slow),
    # bf16 working copies: the gather sends bf16, the joint reduction sums the fp32 main grads
    pytest.param("bf16-mixed", None, 5e-2, 1e-2, 5e-2, marks=pytest.mark.slow),
])
def test_mixed_tp_blocks_in_one_replicated_stage_match_single_process(ranks, precision, kv_heads, grad_tol,
                                                                      loss_tol, weight_tol):
    """The core invariant for mixed tp: per step the gradients equal the single process's on the
    same weights (tp2 and tp1 blocks at once, uneven blocks, next to normal stages), and after 3
    AdamW steps the weights equal the single process's."""
    result = ranks(4).run(run_mixed_tp, precision, kv_heads)[0]
    check_against_single_process(result, 3, grad_tol, loss_tol, weight_tol)


def test_a_rank_of_a_mixed_tp_stage_gets_its_blocks_layout_and_every_peers():
    """Each rank computes and holds its copy in its own block's layout, runs only its own
    micro-batches (no lockstep rounds), and knows every rank's layout for the joint exchange."""
    plan = mixed_tp_plans()[0]
    mesh = MeshShape.for_layouts([Layout.parse(x) for x in MIXED_TP_LAYOUTS], 4)
    docs = [torch.arange(n) for n in plan.doc_lengths]
    stages = [slice_plan(plan, docs, mesh, r).stages[0] for r in range(4)]
    assert [s.compute_layout.name for s in stages] == ["dp2xtp2", "dp2xtp2", "dp4", "dp4"]
    assert all([x.name for x in s.peers] == ["dp2xtp2", "dp2xtp2", "dp4", "dp4"] for s in stages)
    assert all(s.rounds == 0 and s.num_rounds == len(s.micro_batches) for s in stages)
    assert [len(s.micro_batches) for s in stages[:3]] == [2, 2, 2] and len(stages[3].micro_batches) > 1
    assert stages[0].micro_batches[0].doc_ids == stages[1].micro_batches[0].doc_ids  # a tp group's copies


def test_mixed_tp_stages_refuse_sharded_blocks():
    with pytest.raises(PlanError, match=r"block stage dp4 mixes blocks of sharded layouts \['dp2xcp2:fsdp'\]"):
        Stage(Layout.parse("dp4"), (), blocks=(Block(Layout.parse("dp2xcp2:fsdp"), (0,), (((0,),),)),))


def test_a_block_that_does_not_fit_its_own_layout_is_refused_naming_it():
    """Memory is planned per block: 60 tokens fit a tp2 block (capacity 40 per rank x tp) but not a
    tp1 block, which holds the whole working copy; slice_plan refuses the plan naming the block."""
    tp2, tp1 = Layout.parse("dp2xtp2"), Layout.parse("dp4")
    mesh = MeshShape.for_layouts([Layout.parse(x) for x in MIXED_TP_LAYOUTS], 4)
    docs = [torch.arange(n) for n in (30, 30, 5)]

    def capacity(layout: Layout) -> int:
        return 40 * layout.tp * layout.cp

    fits = StepPlan(0, (30, 30, 5), (Stage(tp2, (), blocks=(
        Block(tp2, _groups_of(tp2, (0, 1)), (((0, 1),),)),
        Block(tp1, _groups_of(tp1, (2,)), (((2,),),)), Block(tp1, _groups_of(tp1, (3,)), ((),)))),))
    assert slice_plan(fits, docs, mesh, 3, capacity).stages[0].micro_batches == ()
    group = _groups_of(tp1, (2,))[0]
    too_big = StepPlan(0, (30, 30, 5), (Stage(tp2, (), blocks=(
        Block(tp2, _groups_of(tp2, (0, 1)), (((2,),),)),
        Block(tp1, _groups_of(tp1, (2,)), (((0, 1),),)), Block(tp1, _groups_of(tp1, (3,)), ((),)))),))
    with pytest.raises(PlanError, match=rf"stage 0 \(dp2xtp2\): block 1 in layout dp4, dp group {group}, runs a "
                                        rf"micro-batch of documents \[0, 1\] \(60 tokens with cp padding\), more than "
                                        rf"dp4's capacity of 40"):
        slice_plan(too_big, docs, mesh, 0, capacity)


@pytest.mark.parametrize("layout", ["dp4", "dp2xtp2"])
def test_memory_model_plans_each_block_with_the_joint_exchange_buffers(layout):
    """The memory model's mixed-tp term holds what the joint reduction really allocates on a rank
    of that block (the largest bucket's fp32 send and receive buffers, read off the primitive's
    routes, one parameter per bucket), where the overlapped reduction's term did not suffice; and a
    tp1 block holds twice a tp2 block's working copy of the tp-split weights."""
    from lightning_hotspa.engine.nested_exchange import NestedExchange
    from lightning_hotspa.models import Llama, LlamaConfig, llama_tp_plan, param_roles
    from lightning_hotspa.placements import build_shardings
    from lightning_hotspa.planner.cost.cost_model import AnalyticCostModel

    config = LlamaConfig(vocab_size=1000, hidden=256, n_layers=2, n_heads=8, n_kv_heads=4, ffn_hidden=704,
                         vocab_multiple=64)
    with torch.device("meta"):
        module = Llama(config)
    mesh = MeshShape.for_layouts([Layout.parse(x) for x in MIXED_TP_LAYOUTS], 4)
    roles = param_roles(module, llama_tp_plan(config, 2))
    shardings = build_shardings({n: tuple(p.shape) for n, p in module.named_parameters()}, roles, mesh)
    tp2, tp1 = Layout.parse("dp2xtp2"), Layout.parse("dp4")
    peers = (tp2, tp2, tp1, tp1)
    lay = Layout.parse(layout)
    rank = peers.index(lay)
    routes = NestedExchange(shardings, mesh, peers, rank, bucket_bytes=1).reduce_routes

    def elements(pieces, name):
        return sum(math.prod(shardings[n].shape) // shardings[n].shape[shardings[n].dim] * (b - a)
                   for n, a, b in pieces if n == name)

    measured = max(4 * (sum(elements(p, name) for p in routes.send) + sum(elements(p, name) for p in routes.recv))
                   for name in shardings)
    cm = AnalyticCostModel(config, "H100", 4)
    in_working = config.padded_vocab_size * config.hidden / lay.tp * cm.param_bytes  # what the term nets out
    assert cm.memory(lay, False, mixed_tp=True).transient + in_working >= measured
    assert cm.memory(lay, False).transient + in_working < measured  # the overlapped reduction's term is short
    assert cm.capacity(lay, False, mixed_tp=True) <= cm.capacity(lay, False)
    split = cm.memory(tp1, False).working - cm.memory(tp2, False).working
    assert split > 0.4 * cm.memory(tp1, False).working  # a tp1 block: about twice the copy


def run_mixed_tp_evaluation():
    """Evaluation of every mixed-tp plan (``StepRunner.run_forward``): the token-weighted sum of the
    micro-batch losses over all ranks, and the single process's loss on the same documents."""
    from helpers import TinyLlama

    return evaluate_plans(MIXED_TP_LAYOUTS, TinyLlama, mixed_tp_plans())


def test_mixed_tp_stages_evaluate_like_the_single_process(ranks):
    """Evaluation materializes each block's own copy and drops it after the stage: the global token
    mean of every mixed-tp plan's losses equals the single process's at 1e-5 (fp32)."""
    for ours, reference, active in ranks(4).run(run_mixed_tp_evaluation)[0]:
        assert abs(ours - reference) <= 1e-5 * abs(reference), (ours, reference)
        assert active is None


@pytest.mark.parametrize("layout, peers", [
    ("dp4", ("dp4", "dp4", "dp2xtp2", "dp2xtp2")),
    ("dp2xtp2", ("dp2xtp2", "dp2xtp2", "dp4", "dp4")),
], ids=["tp1_block", "tp2_block"])
def test_estimator_runs_a_mixed_tp_block_within_the_memory_models_term(layout, peers):
    """``hotspa memory``'s estimator through a real mixed-tp step of rank 0's block (FakeTensorMode,
    the joint exchange each way): its peak agrees with the model's, and what the joint reduction
    adds (one parameter per bucket, the model's assumption) stays within the model's mixed-tp term
    but not within the overlapped reduction's."""
    from lightning_hotspa.planner.cost.cost_model import AnalyticCostModel
    from lightning_hotspa.tools.memory import estimate_layout

    got = estimate_layout(SMALLISH, 4, layout, 512, peers=peers, overlap=False, bucket_bytes=1)
    lay, cm = Layout.parse(layout), AnalyticCostModel(SMALLISH, "H100", 4)
    assert abs(got["peak_bytes"] / cm.peak_bytes(lay, False, 512, mixed_tp=True) - 1) < 0.10
    added = sum(got["reduce_peak"].values()) - sum(got["reduce_start"].values())
    in_working = SMALLISH.padded_vocab_size * SMALLISH.hidden / lay.tp * cm.param_bytes  # netted out of the term
    assert added <= cm.memory(lay, False, mixed_tp=True).transient + in_working, added
    assert added > cm.memory(lay, False).transient + in_working, added
