"""Packing and the threshold rule: capacity (with cp padding), cost balance, every token once."""

from __future__ import annotations

import time
from collections import Counter

import numpy as np
import pytest
import torch
from helpers import EIGHT, FOUNDATION
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_hotspa.layout import Layout, LayoutError, MeshShape
from lightning_hotspa.plan import IGNORE_INDEX, PlanError, pack_micro_batch, slice_plan
from lightning_hotspa.planner import (
    DocumentTooLongError,
    Planner,
    QuadraticCost,
    ThresholdPlanner,
    plan_stats,
)
from lightning_hotspa.planner.solve.packing import (
    cp_padded_lengths,
    first_fit_decreasing,
    pack_layout,
    spread_over_groups,
)

LAYOUT_SETS = [
    FOUNDATION,
    ["dp4", "dp2xtp2", "tp4"],
    ["dp4", "dp2xcp2", "tp2xcp2"],
    ["dp2xtp2", "tp2xcp2"],
    ["tp4"],
    EIGHT,
    ["dp8", "dp2xtp2xcp2", "tp8"],
]


# -- first-fit decreasing and LPT -----------------------------------------------------------------
def test_ffd_is_first_fit_in_decreasing_order() -> None:
    assert first_fit_decreasing([5, 4, 3, 3, 2, 2, 1], 7) == [[0, 4], [1, 2], [3, 5, 6]]
    assert first_fit_decreasing([], 7) == []
    with pytest.raises(PlanError, match="item 1 has size 9"):
        first_fit_decreasing([3, 9], 8)


@given(st.lists(st.integers(1, 100), max_size=60), st.integers(100, 300))
@settings(max_examples=60, deadline=None)
def test_ffd_never_exceeds_capacity_and_places_each_item_once(sizes: list[int], cap: int) -> None:
    bins = first_fit_decreasing(sizes, cap)
    assert sorted(i for b in bins for i in b) == list(range(len(sizes)))
    assert all(b and sum(sizes[i] for i in b) <= cap for b in bins)
    assert len(bins) <= max(1, 2 * -(-sum(sizes) // cap))  # FFD never uses > 2x the optimum


def test_lpt_gives_the_costliest_items_to_different_groups() -> None:
    assert spread_over_groups([1.0, 10.0, 9.0, 2.0], 2) == [[1, 0], [2, 3]]


# -- pack_layout ----------------------------------------------------------------------------------
def test_cp_padding_counts_against_capacity() -> None:
    cp2 = Layout(cp=2)  # documents occupy multiples of 2*cp = 4 tokens
    assert cp_padded_lengths([5, 3, 8, 1], 2).tolist() == [8, 4, 8, 4]
    packed = pack_layout([0, 1], [5, 3], cp2, capacity=8)  # 5 + 3 = 8 fits, padded 8 + 4 does not
    assert packed.micro_batches == (((0,), (1,)),)
    assert packed.stats.padded_tokens == 12 and packed.stats.padding_fraction == pytest.approx(4 / 12)
    assert pack_layout([0, 1], [5, 3], Layout(dp=2), capacity=8).stats.padded_tokens == 8


def test_balances_predicted_cost_not_tokens() -> None:
    """One 3000-token document costs as much as nine 1000-token ones under a quadratic cost."""
    lengths = [3000] + [1000] * 9
    packed = pack_layout(range(10), lengths, Layout(dp=2), 16384, cost_fn=lambda n: n.astype(float) ** 2)
    tokens = sorted(sum(lengths[d] for mb in g for d in mb) for g in packed.micro_batches)
    assert tokens == [3000, 9000]  # token balance would be 6000 / 6000
    assert packed.stats.imbalance == pytest.approx(1.0)
    assert QuadraticCost(1000.0)(np.array([1000, 10])).tolist() == [2000.0, 10.1]


@st.composite
def stage_inputs(draw: st.DrawFn) -> tuple[list[int], Layout, int]:
    layout = Layout.parse(draw(st.sampled_from(FOUNDATION + EIGHT + ["dp1", "cp4"])))
    capacity = draw(st.integers(16, 400))
    usable = capacity - capacity % layout.token_granule  # sequence parallelism's padding stays within
    longest = usable if layout.cp == 1 else usable // (2 * layout.cp) * (2 * layout.cp)
    lengths = draw(st.lists(st.integers(1, max(1, longest)), max_size=50))
    return lengths, layout, capacity


@given(stage_inputs())
@settings(max_examples=80, deadline=None)
def test_pack_layout_places_every_document_once_within_capacity(args) -> None:
    lengths, layout, capacity = args
    ids = [10 + 3 * i for i in range(len(lengths))]  # global ids need not be 0..n-1
    by_id = dict(zip(ids, lengths, strict=True))
    packed = pack_layout(ids, lengths, layout, capacity)
    groups = packed.micro_batches
    assert len(groups) == layout.dp
    placed = [d for g in groups for mb in g for d in mb]
    assert sorted(placed) == sorted(ids)
    for g in groups:
        for mb in g:
            assert mb and int(cp_padded_lengths([by_id[d] for d in mb], layout.cp).sum()) <= capacity
            # what the ranks run, sequence parallelism's padding included, stays within capacity too
            docs = [torch.ones(by_id[d], dtype=torch.long) for d in mb]
            ran = pack_micro_batch(docs, layout.cp, 0, tp_size=layout.tp)
            assert ran.input_ids.numel() * layout.cp <= capacity, (mb, ran.input_ids.numel())
    capacity -= capacity % layout.token_granule  # what the stats and the bins below hold
    if len(lengths) >= layout.dp:
        assert all(groups), "a dp group without work although there are enough documents"
    s = packed.stats
    assert s.tokens == sum(lengths) and s.micro_batches == sum(len(g) for g in groups)
    if lengths:
        assert s.fill == pytest.approx(sum(lengths) / (s.micro_batches * capacity))
        assert 0 < s.fill <= 1 and 0 <= s.padding_fraction < 1
    # cost balancing never does worse than plain LPT over the first-fit-decreasing micro-batches
    cost = QuadraticCost()
    size = cp_padded_lengths(lengths, layout.cp)
    bins = first_fit_decreasing(size, capacity)
    loads = [sum(float(cost(size[b]).sum()) for b in (bins[i] for i in grp))
             for grp in spread_over_groups([float(cost(size[b]).sum()) for b in bins], layout.dp)]
    assert max(s.group_costs) <= max(loads, default=0.0) * (1 + 1e-9) + 1e-9


def test_packing_is_deterministic_and_fast_for_a_256k_batch() -> None:
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(6.0, 0.9, size=2000), 1, 4096).astype(int)
    lengths = lengths[np.cumsum(lengths) <= 262_144]
    ids = np.arange(lengths.size)
    a = pack_layout(ids, lengths, Layout(dp=4), 4096)
    start = time.perf_counter()
    b = pack_layout(ids, lengths, Layout(dp=4), 4096)
    elapsed = time.perf_counter() - start
    assert a == b
    assert a.stats.imbalance < 1.01 and a.stats.fill > 0.9
    assert elapsed < 0.5, f"packing {lengths.size} documents took {elapsed:.3f}s"


def test_too_long_document_names_index_length_and_capacity() -> None:
    with pytest.raises(DocumentTooLongError, match=r"document 7 has 15 tokens \(padded to 16 for cp=2\).*12 tokens"):
        pack_layout([3, 7], [4, 15], Layout(dp=2, cp=2), 12)
    planner = ThresholdPlanner(FOUNDATION, 64)
    with pytest.raises(DocumentTooLongError, match=r"document 2 has 257 tokens.*256 tokens in tp2xcp2"):
        planner.plan(0, [5, 256, 257])


# -- the threshold rule ---------------------------------------------------------------------------
def _layouts_of(plan) -> dict[int, str]:
    return {d: s.layout.name for s in plan.stages for d in s.doc_ids}


def test_rule_sends_each_document_to_the_most_data_parallel_layout_that_holds_it() -> None:
    lengths = [10, 64, 65, 128, 129, 256]
    cp_first = ThresholdPlanner(FOUNDATION, 64, backfill=False)
    assert [(b.label, b.layout.name) for b in cp_first.buckets] == [
        ("(0,64]", "dp4"), ("(64,128]", "dp2xcp2"), ("(128,256]", "tp2xcp2")]
    assert _layouts_of(cp_first.plan(0, lengths)) == {
        0: "dp4", 1: "dp4", 2: "dp2xcp2", 3: "dp2xcp2", 4: "tp2xcp2", 5: "tp2xcp2"}
    tp_first = ThresholdPlanner(FOUNDATION, 64, prefer="tp", backfill=False)
    assert _layouts_of(tp_first.plan(0, lengths)) == {
        0: "dp4", 1: "dp4", 2: "dp2xtp2", 3: "dp2xtp2", 4: "tp4", 5: "tp4"}
    # a cp layout holds only multiples of 2*cp: with 63 tokens per rank dp2xcp2 holds 124, not 126
    odd = ThresholdPlanner(["dp4", "dp2xcp2", "tp4"], 63)
    assert [(b.high, b.layout.name) for b in odd.buckets] == [(63, "dp4"), (124, "dp2xcp2"), (252, "tp4")]
    assert odd.capacity(Layout(dp=2, cp=2)) == 126


def test_stages_run_tp_descending_with_band_labels() -> None:
    lengths = [10, 100, 200, 20]
    plan = ThresholdPlanner(FOUNDATION, 64, backfill=False).plan(5, lengths)
    assert [(s.layout.name, s.label) for s in plan.stages] == [
        ("tp2xcp2", "(128,256]"), ("dp2xcp2", "(64,128]"), ("dp4", "(0,64]")]
    plan = ThresholdPlanner(FOUNDATION, 64, prefer="tp", backfill=False).plan(5, lengths)
    assert [s.layout.name for s in plan.stages] == ["tp4", "dp2xtp2", "dp4"]
    assert plan.step == 5 and plan.doc_lengths == tuple(lengths)
    only_short = ThresholdPlanner(FOUNDATION, 64).plan(0, [3, 4])
    assert [s.layout.name for s in only_short.stages] == ["dp4"]  # empty stages are left out


def test_backfill_puts_short_documents_into_the_room_of_long_micro_batches() -> None:
    lengths = [200, 40, 100]  # tp2xcp2 holds 256: 56 tokens left, enough for 40 but not for 100
    pure = ThresholdPlanner(FOUNDATION, 64, backfill=False).plan(0, lengths)
    assert _layouts_of(pure) == {0: "tp2xcp2", 1: "dp4", 2: "dp2xcp2"}
    filled = ThresholdPlanner(FOUNDATION, 64).plan(0, lengths)
    assert _layouts_of(filled) == {0: "tp2xcp2", 1: "tp2xcp2", 2: "dp2xcp2"}
    assert filled.stages[0].micro_batches == (((0, 1),),)  # one micro-batch, no extra one
    assert [s.layout.name for s in filled.stages] == ["tp2xcp2", "dp2xcp2"]  # dp4 stage saved
    assert ThresholdPlanner(FOUNDATION, 64).layout_of(lengths) == [Layout.parse(x) for x in (
        "tp2xcp2", "tp2xcp2", "dp2xcp2")]


def test_hand_set_buckets_and_fixed_layout() -> None:
    planner = ThresholdPlanner(FOUNDATION, 64, buckets=[(32, "dp4"), 200], backfill=False,
                               activation_checkpointing=["tp2xcp2"])
    assert [(b.label, b.layout.name) for b in planner.buckets] == [
        ("(0,32]", "dp4"), ("(32,200]", "tp2xcp2"), ("(200,256]", "tp2xcp2")]
    plan = planner.plan(0, [32, 33, 250])
    assert _layouts_of(plan) == {0: "dp4", 1: "tp2xcp2", 2: "tp2xcp2"}
    assert plan.stages[0].label == "(32,200]+(200,256]" and plan.stages[0].activation_checkpointing
    assert not plan.stages[1].activation_checkpointing
    fixed = ThresholdPlanner(FOUNDATION, 64, fixed_layout="dp2xtp2")
    plan = fixed.plan(0, [1, 50, 128])
    assert [s.layout.name for s in plan.stages] == ["dp2xtp2"]
    with pytest.raises(DocumentTooLongError, match="document 0 has 129 tokens"):
        fixed.plan(0, [129])


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"tokens_per_rank": 0}, PlanError, "tokens_per_rank must be a positive int, got 0"),
        ({"tokens_per_rank": True}, PlanError, "got True"),
        ({"tokens_per_rank": "4096"}, PlanError, "got '4096'"),
        ({"layouts": ["dp4", "dp2"]}, LayoutError, "layout dp2 covers 2 ranks"),
        ({"layouts": []}, LayoutError, "empty"),
        ({"layouts": "dp4"}, LayoutError, "expected a list"),
        ({"layouts": ["dp4", "dp4"]}, LayoutError, "listed twice"),
        ({"layouts": ["dp6", "tp2xdp3", "tp3xdp2"]}, LayoutError, "do not nest"),
        ({"fixed_layout": "tp2xdp2xcp1x"}, LayoutError, "cannot parse"),
        ({"fixed_layout": "dp2xcp2", "layouts": ["dp4", "tp4"]}, LayoutError, "dp2xcp2 is not among"),
        ({"buckets": [64, 64]}, PlanError, "increase strictly; 64 follows 64"),
        ({"buckets": [(100, "dp4")]}, PlanError, r"\(0,100\] cannot run in dp4.*at most 64"),
        ({"buckets": [300]}, PlanError, r"\(.., 300\] is longer than every layout holds"),
        ({"buckets": [], "fixed_layout": None}, PlanError, "non-empty list"),
        ({"buckets": [10], "fixed_layout": "dp4"}, PlanError, "either fixed_layout or buckets"),
        ({"prefer": "pp"}, PlanError, "prefer must be 'cp' or 'tp', got 'pp'"),
    ],
)
def test_configuration_errors_name_the_value(kwargs: dict, error: type, match: str) -> None:
    args = {"layouts": FOUNDATION, "tokens_per_rank": 64, **kwargs}
    with pytest.raises(error, match=match):
        ThresholdPlanner(args.pop("layouts"), args.pop("tokens_per_rank"), **args)


def test_threshold_planner_is_a_stateless_planner() -> None:
    planner = ThresholdPlanner(FOUNDATION, 64)
    assert isinstance(planner, Planner)
    state = planner.state_dict()
    assert state["buckets"] == [(b.high, b.layout.name) for b in planner.buckets]
    lengths = [int(x) for x in np.random.default_rng(1).integers(1, 126, size=40)]
    other = ThresholdPlanner(["dp2", "tp2"], 64)
    before = (other.buckets, other.plan(3, lengths), other.state_dict())
    other.load_state_dict(state)  # another run's state (other layouts, world size): accepted, ignored
    assert (other.buckets, other.plan(3, lengths), other.state_dict()) == before
    assert {s.layout.name for s in other.plan(3, lengths).stages} <= {"dp2", "tp2"}
    assert planner.plan(3, lengths) == ThresholdPlanner(FOUNDATION, 64).plan(3, lengths)


# -- whole plans, sliced for every rank -----------------------------------------------------------
def _check_rank_slices(plan, docs, mesh: MeshShape, capacity) -> Counter:
    """(doc, position, token) of every real token over all ranks (tp replicas counted once)."""
    seen: Counter = Counter()
    for rank in range(mesh.world_size):
        rp = slice_plan(plan, docs, mesh, rank)
        for stage in rp.stages:
            _, tp_rank, _ = mesh.rank_coords(stage.layout, rank)
            for mb in stage.micro_batches:
                assert mb.input_ids.numel() * mb.cp_size <= capacity(stage.layout)
                bounds = mb.cu_seqlens.tolist()
                for j, d in enumerate(mb.doc_ids):
                    seg = slice(bounds[j], bounds[j + 1])
                    for p, t, lab in zip(mb.position_ids[seg].tolist(), mb.input_ids[seg].tolist(),
                                         mb.labels[seg].tolist(), strict=True):
                        n = len(docs[d])
                        want = int(docs[d][p + 1]) if p + 1 < n else IGNORE_INDEX
                        assert lab == want, f"label of doc {d} position {p} crosses the document"
                        if p < n and tp_rank == 0:
                            seen[(d, p, t)] += 1
    return seen


@given(st.sampled_from(LAYOUT_SETS), st.lists(st.integers(1, 256), min_size=1, max_size=30),
       st.integers(0, 2**16), st.booleans())
@settings(max_examples=30, deadline=None)
def test_every_token_once_across_ranks(layouts: list[str], lengths: list[int], seed: int,
                                       backfill: bool) -> None:
    world = Layout.parse(layouts[0]).world_size
    mesh = MeshShape.for_layouts(layouts, world)
    planner = ThresholdPlanner(layouts, 256 // world, backfill=backfill)  # widest tp*cp: 256
    g = torch.Generator().manual_seed(seed)
    docs = [torch.randint(0, 256, (n,), generator=g) for n in lengths]
    plan = planner.plan(seed, lengths)
    seen = _check_rank_slices(plan, docs, mesh, planner.capacity)
    expected = Counter((d, p, int(t)) for d, doc in enumerate(docs) for p, t in enumerate(doc.tolist()))
    assert seen == expected
    stats = plan_stats(plan, planner.capacity, planner.cost_fn)
    assert stats.tokens == sum(lengths) and 0 < stats.fill <= 1 and stats.imbalance >= 1.0
