"""The planner's mixed-cp lockstep rounds (issue 31 step 3, ``planner/solve/mixed_rounds.py``): it emits
them where they price lower than separate lockstep stages, prices a round as its slowest block plus
the per-unit gathers once, plans every block within its capacity, the same on every rank; and a
plan it made runs on 4 gloo ranks like the single process."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import MIXED_BATCHES, PAIR_4, fit_and_compare, planner_mixed_plans, worst

from lightning_hotspa.layout import Layout, MeshShape
from lightning_hotspa.plan import slice_plan
from lightning_hotspa.planner.solve.mixed_rounds import MixedBlock, MixedGroups, mixed_seconds
from lightning_hotspa.planner.solve.solver import CostModelPlanner

#: one 30K document and 120 short ones on 8 H100 (llama7b): the long one needs cp4
LONG_AND_SHORT = [30000] + [1500] * 120
PAIR_8 = ["dp8:fsdp", "dp2xcp4:fsdp"]


def _planner(layouts, mixed=True, **kw):
    kw = {"model": "llama7b", "hardware": "H100", "static_margin": 0.0, **kw}
    return CostModelPlanner(layouts, mixed_rounds=mixed, **kw)


def _mixed(plan):
    """The plan's mixed-cp lockstep stages (blocks on one sharded copy); a ladder's block stage, whose
    blocks run on their own copies, is not one (tests/unit/test_ladder.py)."""
    return [s for s in plan.stages if s.blocks and s.lockstep_blocks]


def test_one_long_and_many_short_documents_get_a_mixed_round_priced_below_separate_stages():
    """The long document runs at cp4 on one dp group of dp2xcp4 while the other four ranks run
    short ones at cp1, in the same rounds; the whole step prices lower than the best plan whose
    stages each compute in one layout (the long document's stage idles the other groups)."""
    mixed_planner, plain_planner = _planner(PAIR_8), _planner(PAIR_8, mixed=False)
    plan, plain = mixed_planner.plan(0, LONG_AND_SHORT), plain_planner.plan(0, LONG_AND_SHORT)
    assert not _mixed(plain)
    (stage,) = _mixed(plan)
    assert {b.layout.name for b in stage.blocks} == set(PAIR_8)
    wide = next(b for b in stage.blocks if b.layout.cp == 4)
    assert 0 in {d for g in wide.micro_batches for mb in g for d in mb}  # the long document runs wide
    ours, theirs = mixed_planner.predict(plan).seconds, plain_planner.predict(plain).seconds
    assert ours < theirs * (1 - 1e-3), (ours, theirs)
    assert mixed_planner.last_decision.multi_s == pytest.approx(ours)


def test_mixed_plans_are_memory_feasible_per_block_tile_the_world_and_are_deterministic():
    planner = _planner(PAIR_8)
    plan = planner.plan(3, LONG_AND_SHORT)
    assert plan == _planner(PAIR_8).plan(3, LONG_AND_SHORT)  # a fresh planner (another rank) agrees
    (stage,) = _mixed(plan)
    for b in stage.blocks:
        opt = planner.option(b.layout, stage.activation_checkpointing)
        for g in b.micro_batches:
            for mb in g:
                assert int(opt.padded([LONG_AND_SHORT[d] for d in mb]).sum()) <= opt.capacity, (b.layout, mb)
    mesh = MeshShape.for_layouts(planner.layouts, 8)
    docs = [torch.zeros(n, dtype=torch.long) for n in LONG_AND_SHORT]
    sliced = [slice_plan(plan, docs, mesh, r).stages[0] for r in range(8)]  # raises unless they tile
    assert sorted(s.compute_layout.name for s in sliced) == ["dp2xcp4:fsdp"] * 4 + ["dp8:fsdp"] * 4
    assert len({s.num_rounds for s in sliced}) == 1


def test_a_mixed_round_lasts_as_long_as_its_slowest_block_plus_its_gathers_once():
    """Hand-priced: per round the max over every group of (its micro-batch's seconds + its
    option's per-micro-batch seconds: the unit gathers and reduce-scatters), an idle group paying
    only the latter; rounds summed."""
    planner = _planner(PAIR_8)
    wide, narrow = (planner.option(Layout.parse(x), False) for x in ("dp2xcp4:fsdp", "dp8:fsdp"))
    lengths = np.array([30000, 1500, 1500, 1500, 700])
    mixed = MixedGroups((MixedBlock(wide, (0,), (((0,), (4,)),)),
                         MixedBlock(narrow, (1, 3, 5, 7), (((1,),), ((2,),), ((3,),), ()))))
    w = wide.doc_seconds(wide.padded(lengths)) + wide.per_micro_batch
    n = narrow.doc_seconds(narrow.padded(lengths)) + narrow.per_micro_batch
    expected = max(w[0], n[1], n[2], n[3], narrow.per_micro_batch) \
        + max(w[4], narrow.per_micro_batch)
    assert mixed_seconds(mixed, lengths, in_order=True) == pytest.approx(expected, rel=1e-12)


def test_no_mixed_stage_without_two_candidates_of_one_sharded_working_copy():
    """Replicated copies run free instead (no lockstep rounds to share), and a single sharded
    layout has nothing to mix with: the planner's plan is the plain one."""
    for layouts in (["dp8", "dp2xcp4"], ["dp2xcp4:fsdp", "dp8"]):
        assert not _mixed(_planner(layouts).plan(0, LONG_AND_SHORT))


# -- a planner-made mixed plan on 4 gloo ranks ----------------------------------------------------

def test_the_planner_makes_a_mixed_stage_of_each_batch_of_the_gloo_run():
    for plan in planner_mixed_plans():
        (stage,) = _mixed(plan)
        assert sorted(b.layout.name for b in stage.blocks) == sorted(PAIR_4)


def run_planner_mixed_plans(precision="32-true"):
    """The strategy trains on :func:`planner_mixed_plans` (test_strategy's comparison)."""
    return fit_and_compare(PAIR_4, len(MIXED_BATCHES), precision, plans=planner_mixed_plans())


def test_a_planner_made_mixed_plan_matches_the_single_process_on_4_ranks(ranks):
    """The invariant for the planner's mixed stages: per step the gradients equal the single
    process's from the same weights at 1e-5 (fp32), and the weights after the 3 steps too."""
    result = ranks(4).run(run_planner_mixed_plans)[0]
    assert result["global_step"] == len(MIXED_BATCHES)
    for step, errors in enumerate(result["grads"]):
        assert worst(errors)[1] <= 1e-5, (step, worst(errors))
    assert max(result["losses"]) <= 1e-5, result["losses"]
    assert worst(result["weights"])[1] <= 1e-4, worst(result["weights"])


def test_plan_statistics_count_a_mixed_stages_blocks():
    """Fill and padding of a mixed stage come from its blocks (each padding to its own cp)."""
    from lightning_hotspa.planner.plan_stats import stage_stats

    planner = _planner(PAIR_8)
    (stage,) = _mixed(planner.plan(0, LONG_AND_SHORT))
    stats = stage_stats(stage, LONG_AND_SHORT, planner.capacity(stage.layout))
    assert stats.documents == len(LONG_AND_SHORT) and stats.tokens == sum(LONG_AND_SHORT)
    assert stats.micro_batches == sum(len(g) for b in stage.blocks for g in b.micro_batches) > 0
    assert stats.padded_tokens >= stats.tokens and len(stats.group_costs) == 1 + 4  # a cp4 group, 4 cp1 ones
