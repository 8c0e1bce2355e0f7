"""Pipeline parallelism in the cost model: bubbles per schedule against hand computations, micro-batches
in flight and memory per stage, the layer split, and the gate between priced and runnable pp layouts."""

from __future__ import annotations

import pytest

from lightning_hotspa.layout import Layout
from lightning_hotspa.planner.candidates import enumerate_layouts, runs
from lightning_hotspa.planner.cost.cost_model import AnalyticCostModel, CostModelError
from lightning_hotspa.planner.cost.pp_memory import stage_memories
from lightning_hotspa.planner.cost.pp_schedule import PipelineSchedule, get_schedule, in_flight, stage_layers


def test_bubble_per_schedule_matches_the_hand_computation():
    # p = 4, m = 8: GPipe / 1F1B (p-1)/m = 3/8; interleaved v = 2: (p-1)/(v m) = 3/16 (Narayanan et al. 2021);
    # ZB-H1 with T_F = T_B = T_W: (p-1)(T_F + T_B - T_W) / (m (T_F + T_B + T_W)) = 3/8 * 1/3; full recompute
    # puts the forward again into T_B: 3/8 * (1 + 2 - 1) / (1 + 2 + 1) = 3/16
    assert PipelineSchedule("gpipe").bubble(4, 8) == pytest.approx(3 / 8)
    assert PipelineSchedule("1f1b").bubble(4, 8) == pytest.approx(3 / 8)
    assert get_schedule("interleaved:2").bubble(4, 8) == pytest.approx(3 / 16)
    assert PipelineSchedule("zb-h1").bubble(4, 8) == pytest.approx(1 / 8)
    assert PipelineSchedule("zb-h1").bubble(4, 8, recompute=True) == pytest.approx(3 / 16)
    assert PipelineSchedule().bubble(1, 8) == 0.0 and PipelineSchedule().bubble(4, 0) == 0.0
    with pytest.raises(ValueError, match="'pipedream'"):
        PipelineSchedule("pipedream")
    with pytest.raises(ValueError, match="virtual_stages=2: only the 'interleaved'"):
        PipelineSchedule("1f1b", virtual_stages=2)
    with pytest.raises(CostModelError, match="'nope'"):
        AnalyticCostModel("llama7b", "H100", 8, pipeline="nope")


def test_group_seconds_pay_the_schedules_bubble():
    lay = Layout(dp=2, tp=2, pp=2)
    for spec, factor in (("1f1b", 1 + 1 / 4), ("interleaved:2", 1 + 1 / 8), ("zb-h1", 1 + 1 / 12)):
        opt = AnalyticCostModel("llama7b", "H100", 8, pipeline=spec).option(lay, False)
        assert opt.group_seconds(2.0, 4) == pytest.approx((2.0 + 4 * opt.per_micro_batch) * factor)
    # interleaved: v times the point-to-point sends per micro-batch (exposed on ours)
    one = AnalyticCostModel("llama7b", "H100", 8).option(lay, False)
    two = AnalyticCostModel("llama7b", "H100", 8, pipeline="interleaved:2").option(lay, False)
    hw = AnalyticCostModel("llama7b", "H100", 8).hardware
    per_send = 4096 * 2 / (2 * hw.bandwidth(8, 4))
    assert two.linear - one.linear == pytest.approx(2 * per_send)


def test_micro_batches_in_flight_per_stage():
    one = PipelineSchedule("1f1b")
    assert [in_flight(one, 4, s, 8) for s in range(4)] == [4, 3, 2, 1]  # the first stage holds the most
    assert [in_flight(one, 4, s, 2) for s in range(4)] == [2, 2, 2, 1]
    assert [in_flight(PipelineSchedule("gpipe"), 4, s, 8) for s in range(4)] == [8] * 4
    inter = get_schedule("interleaved:2")  # stage 0 warms up 2 (p-1) + (v-1) p = 10 chunks: (10 + 1) / v
    assert in_flight(inter, 4, 0, 8) == pytest.approx(4 + 3 / 2) and in_flight(inter, 4, 3, 8) == pytest.approx(2.5)
    with pytest.raises(ValueError, match="stage 4"):
        in_flight(one, 4, 4, 8)


def test_layer_split_even_or_balanced_with_the_head_on_the_last_stage():
    assert stage_layers(32, 4, 2.4, "even") == (8, 8, 8, 8)
    # head = 2.4 layers: a last stage of 6 layers loads 8.4 <= the others' 9; 5 loads 7.4 but splits less evenly
    assert stage_layers(32, 4, 2.4) == (8, 9, 9, 6)  # the extra layers on the middle stages first
    assert stage_layers(32, 2, 0.65) == (16, 16)  # 16 + 0.65 < 17
    assert stage_layers(30, 4, 0.0) == (7, 8, 8, 7)
    with pytest.raises(ValueError, match="pp=40 must be between 1 and the model's 32 layers"):
        stage_layers(32, 40)
    with pytest.raises(ValueError, match="does not divide the model's 30 layers"):
        stage_layers(30, 4, split="even")
    cm = AnalyticCostModel("llama3-8b", "H100", 8)
    assert cm.stage_layers(Layout(dp=2, pp=4)) == (8, 9, 9, 6)  # its 128K vocabulary head: ~2.4 layers
    with pytest.raises(CostModelError, match="pp8.*does not divide"):
        AnalyticCostModel("llama7b", "H100", 8, pipeline="interleaved:8").check(Layout(pp=8))


def test_memory_per_stage_first_stage_holds_the_most_activations():
    cm = AnalyticCostModel("llama7b", "H100", 8, pipeline=PipelineSchedule(split="even"))
    lay = Layout(dp=2, tp=2, pp=2)
    first, last = stage_memories(cm, lay, False)
    per_layer, once, head = cm.activation_parts(False, 2, 1)
    # 1F1B: stage 0 holds p = 2 micro-batches of its 16 layers, stage 1 one, plus the loss head's; a
    # non-last stage also its 2 in-flight outputs, one received gradient (hidden / tp wide each) and a
    # layer's backward transients (no loss head's come first there)
    boundary = cm.param_bytes * cm.model.hidden / 2
    beyond = 3 * boundary + cm.layer_backward_bytes_per_token(2, 1)
    assert first.activation_per_token == pytest.approx(2 * 16 * per_layer + once + beyond)
    assert last.activation_per_token == pytest.approx(16 * per_layer + once + head)
    assert first.activation_per_token + head == pytest.approx(cm.activation_bytes_per_token(False, 2, 1) + beyond)
    # the embedding on the first stage, the head and the final norm on the last: equal weights for an untied model
    m = cm.model
    assert last.working - first.working == pytest.approx(m.hidden * (cm.param_bytes + cm.grad_accum_bytes))
    assert cm.memory(lay, False) == first  # the binding stage
    gpipe = AnalyticCostModel("llama7b", "H100", 8, pipeline=PipelineSchedule("gpipe", split="even", micro_batches=8))
    assert [s.activation_per_token for s in stage_memories(gpipe, lay, False)] == pytest.approx(
        [8 * 16 * per_layer + once + 9 * boundary + cm.layer_backward_bytes_per_token(2, 1),
         8 * 16 * per_layer + once + head])
    inter = AnalyticCostModel("llama7b", "H100", 8, pipeline="interleaved:2")
    assert stage_memories(inter, Layout(dp=2, pp=4), False)[0].activation_per_token > \
        stage_memories(AnalyticCostModel("llama7b", "H100", 8), Layout(dp=2, pp=4), False)[0].activation_per_token
    assert cm.capacity(lay, False) > cm.capacity(Layout(dp=4, tp=2), False)  # half the weights per rank


def test_fsdp_with_pp_gathers_only_its_stage():
    cm = AnalyticCostModel("llama7b", "H100", 16)
    flat, piped = Layout(dp=8, tp=2, fsdp=True), Layout(dp=4, tp=2, pp=2, fsdp=True)
    # each stage gathers its 16 blocks and the embedding or the head over its 4 dp ranks (not 8)
    assert sum(cm.fsdp_exchange_parts(piped)) < sum(cm.fsdp_exchange_parts(flat))
    assert cm.switch_bytes(None, piped) == 0.0
    assert cm.memory(piped, True).working < cm.memory(Layout(dp=8, tp=2), True).working


def test_pp_candidates_are_priced_by_the_simulator_and_offered_only_when_runnable(monkeypatch):
    cm = AnalyticCostModel("llama7b", "H100", 8)
    priced = [lay for lay in enumerate_layouts(8, cm, runnable_only=False) if lay.pp > 1]
    assert Layout(dp=2, tp=2, pp=2) in priced and Layout(tp=4, pp=2) in priced
    offered = [lay for lay in enumerate_layouts(8, cm) if lay.pp > 1]
    assert offered == [lay for lay in priced if runs(lay)]  # before the runtime runs pp: none; after: all
    monkeypatch.setattr(Layout, "check_runnable", lambda self: self)  # as once the runtime runs pp
    assert {lay for lay in enumerate_layouts(8, cm) if lay.pp > 1} == set(priced)
    assert not [lay for lay in enumerate_layouts(8, cm, pp=False) if lay.pp > 1]


def test_the_planner_plans_pp_layouts_once_the_runtime_runs_them(monkeypatch):
    """With ``check_runnable`` accepting pp (the runtime's side of issue 56), a declared pp layout is
    planned: every document once, its stage priced with the schedule's bubble over its micro-batches."""
    import numpy as np

    from lightning_hotspa.planner.solve.solver import CostModelPlanner

    monkeypatch.setattr(Layout, "check_runnable", lambda self: self)
    lengths = np.array([9000, 7000, 5000, 3000, 2000, 1500, 1200, 800, 600, 400] * 4)
    planner = CostModelPlanner(["dp2xtp2xpp2"], model="llama7b", hardware="H100")
    total, stages = planner.solve(lengths)
    (opt, groups), = stages
    assert opt.layout == Layout(dp=2, tp=2, pp=2)
    assert sorted(i for g in groups for mb in g for i in mb) == list(range(lengths.size))
    docs = opt.doc_seconds(opt.padded(lengths))
    busiest = max(groups, key=lambda g: float(sum(docs[list(mb)].sum() for mb in g)))
    plain = float(sum(docs[list(mb)].sum() for mb in busiest)) + opt.per_micro_batch * len(busiest)
    assert opt.stage_seconds(docs, groups) >= plain * (1 + 1 / len(busiest)) * (1 - 1e-9)
    assert total >= opt.stage_seconds(docs, groups)


def test_the_exact_bound_refuses_more_gradient_kinds_than_it_enumerates():
    """pp multiplies the gradient kinds (tp, pp, fsdp shard) the exact bound enumerates subsets of (2^k): past
    MAX_GRADIENT_KINDS it raises naming the count instead of exhausting memory; the candidates' seeding leaves
    pp layouts out (test_planner's seeded 64-rank test runs with them among the candidates)."""
    import numpy as np

    from lightning_hotspa.planner.cost.terms import gradient_kind
    from lightning_hotspa.planner.solve.oracle_bound import MAX_GRADIENT_KINDS, charged_oracles

    cm = AnalyticCostModel("llama13b", "H200", 64)
    layouts = enumerate_layouts(64, cm)
    kinds = {gradient_kind(lay) for lay in layouts}
    assert len(kinds) > MAX_GRADIENT_KINDS and any(lay.pp > 1 for lay in layouts)
    with pytest.raises(ValueError, match=f"{len(kinds)} gradient kinds"):
        charged_oracles(cm, np.ones((len(layouts), 3)), layouts)
