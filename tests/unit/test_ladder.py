"""The cp ladder planner (planner/solve/ladder.py): blocks that tile the world, every document once,
micro-batches within each block's own capacity, deterministic plans, the guard's fallback, and the
plan a real mesh runs (pure python: no ranks)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from lightning_hotspa.layout import Layout, MeshShape
from lightning_hotspa.plan import block_ranks, check_block_capacity, slice_plan
from lightning_hotspa.planner.solve.ladder import LadderGroups, block_chain, working_layout
from lightning_hotspa.planner.solve.solver import CostModelPlanner
from lightning_hotspa.tools.cli import batch_lengths
from lightning_hotspa.tools.long_grid import token_batch

pytestmark = pytest.mark.fast


@pytest.fixture
def _all_gather_kv_pricing(monkeypatch):
    """Only for the tests of what the guard and the solver do WHEN a ladder prices lower: these batches were
    built (issue 38) where it does under the all-gather-KV pricing (the ``:kv`` layouts' exchange exposed, their
    attention forward re-run in backward). Under the KV ring's pricing no ladder clears even a zero margin on
    them (benchmarks/2026-12-06-kv-ring.md). The ladder's structure is tested on today's pricing
    (``plan_ladder``: the ladder whatever it costs)."""
    from lightning_hotspa.planner.cost.runtime_profile import HOTSPA, RUNTIME_PROFILES

    earlier = dataclasses.replace(HOTSPA, cp_comm_overlap=False, kv_gather_recomputes_attention=True)
    monkeypatch.setitem(RUNTIME_PROFILES, "hotspa", earlier)

#: 8B on 64 H100s at 256K: step 1 of the github mix is a batch the ladder wins by more than the margin
LAYOUTS = ["dp16xtp4", "dp4xtp4xcp4:kv", "dp2xtp4xcp8:kv4", "tp4xcp16:kv8"]


def _planner(**kwargs) -> CostModelPlanner:
    return CostModelPlanner(LAYOUTS, model="llama3-8b", hardware="H100", world_size=64, ladder="auto", **kwargs)


@pytest.fixture(scope="module")
def lengths() -> np.ndarray:
    return batch_lengths("github", 4 * 2**20, 256 * 1024, 0, 1)


def _block_stage(plan):
    stages = [s for s in plan.stages if s.blocks]
    assert len(stages) == 1, plan
    return stages[0]


def test_block_chain_and_working_layouts():
    assert block_chain(64) == (64, 32, 16, 8, 4, 2, 1) and block_chain(24) == (24, 12, 6, 3)
    cp4 = Layout.parse("dp16xcp4:kv")
    assert working_layout(cp4, 16, True) == Layout.parse("dp16xcp4:kv:fsdp16")
    assert working_layout(cp4, 64, True) == Layout.parse("dp16xcp4:kv:fsdp")
    assert working_layout(cp4, 16, False) == cp4


def test_a_ladder_tiles_the_world_and_holds_every_document_once(lengths):
    planner = _planner()
    plan = planner.plan_ladder(1, lengths)
    stage = _block_stage(plan)
    mesh = planner.block_mesh()
    spans = sorted(block_ranks(b, mesh) for b in stage.blocks)
    assert [r for span in spans for r in span] == list(range(64))  # tiled, no rank twice
    for span in spans:  # aligned sub-meshes
        assert 64 % len(span) == 0 and span[0] % len(span) == 0
    docs = sorted(d for s in plan.stages for g in s.groups for mb in g for d in mb)
    assert docs == list(range(len(lengths)))  # every document exactly once
    assert len({b.layout.cp for b in stage.blocks}) > 1  # a ladder: blocks of different cp side by side
    # memory per block: every micro-batch within its block's working layout's capacity
    check_block_capacity(plan, planner.capacity)
    for b in stage.blocks:
        cap = planner.capacity(b.working_layout)
        for g in b.micro_batches:
            for mb in g:
                assert sum(-(-lengths[d] // (2 * b.layout.cp)) * 2 * b.layout.cp if b.layout.cp > 1 else lengths[d]
                           for d in mb) <= cap
    # the prediction of the emitted plan is what the solver priced
    assert planner.predict(plan).seconds == pytest.approx(planner.ladder.solve(lengths)[0], rel=1e-9)


def test_a_block_sharded_over_fewer_ranks_holds_fewer_tokens():
    """Memory: a block-sharded copy costs parameters / block ranks: the smaller the block, the less
    room for activations (the planner trades block size against it)."""
    planner = _planner()
    caps = {e.size: e.option.capacity for e in planner.ladder.entries
            if e.option.layout.degrees == Layout.parse("dp4xtp4xcp4") and e.sharded
            and not e.option.activation_checkpointing}
    sizes = sorted(caps)
    assert len(sizes) >= 3 and all(caps[a] < caps[b] for a, b in zip(sizes, sizes[1:])), caps


def test_ladders_are_deterministic(lengths):
    """The same plan from two planners and repeated calls (every rank computes it alone)."""
    a, b = _planner(), _planner()
    first = a.plan(1, lengths)
    assert a.plan(1, lengths) == first == b.plan(1, lengths)
    assert a.ladder.solve(lengths)[0] == b.ladder.solve(lengths[::-1].copy())[0]  # order-free price


@pytest.mark.usefixtures("_all_gather_kv_pricing")
def test_the_guard_falls_back_when_a_ladder_gains_less_than_the_margin(lengths):
    free = _planner(static_margin=0.0)
    assert any(s.blocks for s in free.plan(1, lengths).stages)
    ladder_s = free.last_decision.multi_s
    strict = _planner(static_margin=9.0)  # no predicted gain is that large: the static plan runs
    plan = strict.plan(1, lengths)
    decision = strict.last_decision
    assert decision.fell_back and not any(s.blocks for s in plan.stages) and len({s.layout for s in plan.stages}) == 1
    assert decision.multi_s == pytest.approx(ladder_s) and strict.predict(plan).seconds == pytest.approx(
        decision.static_s) and decision.static_s > ladder_s  # it gave up a predicted gain, as told
    gain = decision.static_s / ladder_s - 1  # a margin below the gain keeps the ladder, one above drops it
    for margin, kept in ((0.5 * gain, True), (2.0 * gain, False)):
        plan = _planner(static_margin=margin).plan(1, lengths)
        assert any(s.blocks for s in plan.stages) is kept, (margin, gain)


def test_declared_layouts_only_and_the_plan_slices_on_the_real_mesh(lengths):
    """A real run: blocks only of the declared layouts (their working copies too), and the plan
    slices on the mesh of those layouts for a rank of every block."""
    auto = _planner(static_margin=0.0)
    stage = _block_stage(auto.plan_ladder(1, lengths))
    declared = sorted({*LAYOUTS, *(b.layout.name for b in stage.blocks),
                       *(b.working_layout.name for b in stage.blocks)})
    real = CostModelPlanner(declared, model="llama3-8b", hardware="H100", world_size=64, static_margin=0.0)
    allowed = {Layout.parse(x) for x in declared}
    assert {e.option.layout for e in real.ladder.entries} <= allowed
    plan = real.plan_ladder(1, lengths)
    assert plan is not None
    mesh = MeshShape.for_layouts(real.layouts, 64)
    docs = [np.zeros(int(n), dtype=np.int64) for n in lengths]
    import torch

    tensors = [torch.from_numpy(d) for d in docs]
    for b in plan.stages[0].blocks:
        assert b.layout in allowed and b.working_layout in allowed
        rank = block_ranks(b, mesh)[0]
        rs = slice_plan(plan, tensors, mesh, rank, capacity=real.capacity).stages[0]
        assert rs.compute_layout == b.working_layout if b.sharded else rs.compute_layout == b.layout
    off = CostModelPlanner(LAYOUTS, model="llama3-8b", hardware="H100", world_size=64, ladder=False)
    assert off.ladder is None and off.plan_ladder(1, lengths) is None


def test_ladder_option_is_checked():
    with pytest.raises(Exception, match="ladder must be True, False or 'auto'"):
        CostModelPlanner(LAYOUTS, model="llama3-8b", hardware="H100", world_size=64, ladder="sometimes")


def test_a_ladder_stage_is_priced_per_block_plus_the_joint_exchange(lengths):
    planner = _planner(static_margin=0.0)
    _, ladder = planner.ladder.solve(lengths)
    assert isinstance(ladder, LadderGroups)
    per_block = ladder.block_seconds(lengths)
    pred = planner.predict(planner.plan_ladder(1, lengths))
    stage = next(s for s in pred.stages if s.layout.startswith("blocks["))
    assert stage.compute_seconds == pytest.approx(float(per_block.max()))  # the slowest block
    assert stage.stage_fixed == pytest.approx(ladder.exchange) and ladder.exchange > 0
    assert stage.switch_seconds == pytest.approx(ladder.switch_in)


def test_the_head_takes_the_documents_only_the_whole_world_finishes_in_time(lengths):
    """``head_size``: the longest documents whose time alone on a block smaller than the world
    would set the ladder's step run before it (deterministic, at most 32)."""
    planner = _planner(static_margin=0.0)
    k = planner.ladder.head_size(lengths)
    assert 0 <= k <= 32 and k == planner.ladder.head_size(lengths[::-1].copy())
    one_long = np.array([2048] * 100 + [256 * 1024] + [2048] * 100)
    assert planner.ladder.head_size(one_long) == 1
    assert planner.ladder.head_size(np.array([2048] * 200)) == 0


def _class(ladder, compute: str, sharded: bool = True, mode: int = 0) -> int:
    return next(j for j, (c, sh, m) in enumerate(ladder._classes)
                if ladder.computes[c].name == compute and sh == sharded and m == mode)


@pytest.mark.usefixtures("_all_gather_kv_pricing")
def test_a_class_is_repriced_at_the_block_sizes_it_is_given():
    """Size-aware pricing (benchmarks/2026-12-04-ladder-3.md): a sharded class's rate is its best
    block size's until an allocation gives it blocks; then its blocks' own (a copy sharded over
    fewer ranks holds fewer tokens: a document may no longer fit, and more gathers per token), and
    pairs of its small blocks merge when one block of twice the size prices lower. On the planner
    benchmark's 512 sft-longtail documents at 64 ranks this finds a ladder that clears the default
    margin (before: 43.35 s against the static 44.36 s, the guard fell back; now 38.09 s)."""
    ladder = _planner().ladder
    lengths = np.array([1024] * 300 + [8192] * 40 + [260_000])  # the last: held by 32 ranks, not by 16
    costs, fits = ladder.tables(lengths)
    big = np.where(fits, costs, np.inf)
    units = np.array([ladder._comp(i).tp * ladder._comp(i).cp for i in range(len(ladder._classes))], dtype=float)
    rates = np.stack([big[ks].min(axis=0) for ks in ladder._by_class])
    alone, rates = rates.copy(), rates * units[:, None]
    j, other = _class(ladder, "dp4xtp4xcp4"), _class(ladder, "dp16xtp4")
    r16, r32 = (big[ladder._entry_at[(j, s)]] * units[j] for s in (16, 32))
    assert np.isinf(r16[-1]) and np.isfinite(r32[-1]) and np.isfinite(rates[j]).all()
    re_rates, re_alone = ladder._repriced(big, units, rates, alone, ((j, 16), (other, 8)))
    # (to rounding: the harmonic mean of one size, 16 / (16 / r), is r within an ulp)
    assert np.allclose(re_rates[j], r16, rtol=1e-12) and (r16 >= rates[j]).all()
    assert np.array_equal(re_alone[j], big[ladder._entry_at[(j, 16)]]) and np.isinf(re_alone[j, -1])
    untouched = [i for i in range(len(ladder._classes)) if i not in (j, other)]
    assert np.array_equal(re_rates[untouched], rates[untouched])  # classes without a block keep theirs
    both = ladder._repriced(big, units, rates, alone, ((j, 16), (j, 32)))[0][j]  # two sizes in parallel:
    assert np.allclose(both[:-1], 48 / (16 / r16[:-1] + 32 / r32[:-1]))  # the rank-weighted harmonic mean
    assert both[-1] == pytest.approx(1.5 * r32[-1])  # only the 32 ranks hold the longest one
    # merging: two 16-rank blocks of the class become one of 32 ranks when that prices lower (here:
    # the longest document fits only there), tiling kept (chain sizes, largest first)
    rows = np.where(lengths < 4096, other, j)  # the 1K documents on the tp4 blocks, the rest on cp4
    blocks = ((other, 32), (j, 16), (j, 16))
    merged = ladder._widen(blocks, rows, big, units)
    assert merged == ((j, 32), (other, 32))  # largest first, the wider cp first among equals
    # the planner benchmark's batch (recipes/benchmark_planner.py, llama3-8b_64xH100_kv)
    planner = _planner()
    batch = token_batch("sft-longtail", min(256 * 1024, planner.longest_document()), 4 * 2**20, 0)[:512]
    plan = planner.plan(0, batch)
    decision = planner.last_decision
    assert any(s.blocks for s in plan.stages) and not decision.fell_back
    assert decision.predicted_gain > planner.static_margin  # kept: the guard's own rule, not a picked number


@pytest.mark.usefixtures("_all_gather_kv_pricing")
def test_a_head_of_one_round_runs_the_longest_documents_side_by_side_on_the_world():
    """``round_size`` (benchmarks/2026-12-06-ladder-4.md): where the world's widest groups are a
    quarter of it (70B on 1024 H100: ``dp4xtp2xcp128``, 256 ranks a group), four 512K documents run
    side by side in one world-wide stage in one document's time; a ladder has no block of the
    world's size, so without that head they took two rounds on two groups of 256 ranks (106.3 s).
    ``head_size``'s estimate alone does not pick it (the head's work is the same rank-seconds)."""
    planner = CostModelPlanner(["dp1024:fsdp", "dp16xcp64:fsdp", "dp16xtp2xcp32:fsdp", "dp4xtp2xcp128:kv:fsdp",
                                "dp4xtp2xcp128:kv32:fsdp"], model="llama3-70b", hardware="H100", ladder="auto",
                               static_margin=0.0)
    batch = token_batch("github", 524288, 16384 * 1024, 1)  # the long grid's second batch of this cell
    longest = np.argsort(-batch, kind="stable")[:5]
    assert batch[longest].tolist() == [524288] * 4 + [491549]
    assert planner.ladder.round_size(batch) == 4 and planner.ladder.head_size(batch) == 0
    assert planner.ladder.round_size(np.full(100, 2048)) == 0  # short documents: a head gains nothing
    secs, stages = planner.solve(batch)
    (head_opt, head), (_, ladder) = stages
    assert sorted(d for g in head for mb in g for d in mb) == sorted(longest[:4].tolist())
    assert head_opt.layout.dp == 4 and isinstance(ladder, LadderGroups)
    alone, _ = planner.ladder.solve(batch)  # the ladder over every document, no head: two rounds
    assert secs < alone, (secs, alone)  # the solver took the head because it prices lower


def test_lockstep_blocks_are_also_tried_split_into_blocks_of_one_dp_group():
    """``_split``: a sharded block of several dp groups runs lockstep rounds (each waits for its
    slowest group's micro-batch); the same ranks as blocks of one dp group each run on their own.
    Replicated blocks, blocks of one group and sizes the class cannot run stay as they are."""
    ladder = _planner().ladder
    cp4 = _class(ladder, "dp4xtp4xcp4")  # groups of 16 ranks
    tp4 = _class(ladder, "dp16xtp4")  # groups of 4 ranks: a copy sharded over 4 tp ranks is no sharded copy
    blocks = ((cp4, 32), (tp4, 16), (cp4, 16))
    split = ladder._split(blocks)
    assert split == ((cp4, 16), (cp4, 16), (cp4, 16), (tp4, 16))  # largest first, the wider cp first
    assert sum(s for _, s in split) == sum(s for _, s in blocks)
    assert ladder._split(((tp4, 32), (cp4, 16), (cp4, 16))) == ((tp4, 32), (cp4, 16), (cp4, 16))
    ladder._classes = [(c, not sh if c == ladder._classes[cp4][0] else sh, m) for c, sh, m in ladder._classes]
    assert ladder._split(((cp4, 32),)) == ((cp4, 32),)  # a replicated copy: no rounds to split
