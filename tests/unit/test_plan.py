"""Step-plan vocabulary: packing, cp slicing, validation, and a rank's slice of a plan."""

from collections import Counter

import pytest
import torch

from lightning_hotspa.layout import Layout, LayoutError, MeshShape
from lightning_hotspa.plan import (
    IGNORE_INDEX,
    MicroBatch,
    PlanError,
    Stage,
    StepPlan,
    pack_micro_batch,
    single_stage_plan,
    slice_plan,
)

FOUNDATION = ["dp4", "dp2xtp2", "tp4", "dp2xcp2", "tp2xcp2"]


def _docs(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 255, (n,), generator=g) for n in lengths]


def test_pack_shifts_labels_inside_documents():
    a, b = torch.tensor([5, 6, 7]), torch.tensor([8, 9])
    mb = pack_micro_batch([a, b], doc_ids=(3, 1))
    assert mb.input_ids.tolist() == [5, 6, 7, 8, 9]
    assert mb.labels.tolist() == [6, 7, IGNORE_INDEX, 9, IGNORE_INDEX]
    assert mb.position_ids.tolist() == [0, 1, 2, 0, 1]
    assert mb.cu_seqlens.tolist() == [0, 3, 5] and mb.cu_seqlens.dtype == torch.int32
    assert mb.max_seqlen == 3 and mb.num_target_tokens == 3 and mb.doc_ids == (3, 1)
    assert mb.cp_cu_seqlens is None


@pytest.mark.parametrize("cp", [2, 4])
def test_cp_slices_take_balanced_chunks_and_rebuild_the_row(cp):
    lengths = [7, 16, 1, 13]
    docs = _docs(lengths)
    slices = [pack_micro_batch(docs, cp, r) for r in range(cp)]
    # documents padded to a multiple of 2*cp (7 -> 8, 16, 1 -> 2cp, 13 -> 16), worked out by hand
    whole_row = {2: [0, 8, 24, 28, 44], 4: [0, 8, 24, 32, 48]}[cp]
    for r, mb in enumerate(slices):
        # rank r holds chunks r and 2cp-1-r of each document
        assert mb.cp_cu_seqlens.tolist() == whole_row
        bounds = mb.cu_seqlens.tolist()
        full = mb.cp_cu_seqlens.tolist()
        for d in range(len(lengths)):
            padded = full[d + 1] - full[d]
            c = padded // (2 * cp)
            pos = mb.position_ids[bounds[d]:bounds[d + 1]].tolist()
            assert pos == list(range(r * c, (r + 1) * c)) + list(range((2 * cp - 1 - r) * c, (2 * cp - r) * c))
    # every real token and every target appears exactly once across the cp ranks
    for d, doc in enumerate(docs):
        seen = {}
        for mb in slices:
            lo, hi = mb.cu_seqlens[d].item(), mb.cu_seqlens[d + 1].item()
            rows = zip(mb.position_ids[lo:hi].tolist(), mb.input_ids[lo:hi].tolist(), mb.labels[lo:hi].tolist())
            for p, t, lab in rows:
                assert p not in seen
                seen[p] = (t, lab)
        for p in range(len(doc)):
            assert seen[p][0] == doc[p].item()
            assert seen[p][1] == (doc[p + 1].item() if p + 1 < len(doc) else IGNORE_INDEX)
        assert all(seen[p][1] == IGNORE_INDEX for p in seen if p >= len(doc))  # padding has no loss
    assert sum(mb.num_target_tokens for mb in slices) == sum(n - 1 for n in lengths)


def test_no_padding_without_cp():
    mb = pack_micro_batch(_docs([3, 5]))
    assert mb.num_tokens == 8


def _mb(**changes):
    base = dict(input_ids=torch.tensor([1, 2, 3]), labels=torch.tensor([2, 3, -100]),
                position_ids=torch.tensor([0, 1, 2]), cu_seqlens=torch.tensor([0, 3], dtype=torch.int32),
                max_seqlen=3, num_target_tokens=2)
    base.update(changes)
    return MicroBatch(**base)


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(labels=torch.tensor([2, 3])), "labels has 2 tokens, input_ids has 3"),
        (dict(input_ids=torch.tensor([[1, 2, 3]])), "input_ids must be a 1-D tensor"),
        (dict(input_ids=torch.tensor([1.0, 2.0, 3.0])), "input_ids must have dtype"),
        (dict(cu_seqlens=torch.tensor([0, 2], dtype=torch.int32)), "must start at 0 and end at 3"),
        (dict(cu_seqlens=torch.tensor([0, 0, 3], dtype=torch.int32)), "strictly increasing"),
        (dict(max_seqlen=2), "max_seqlen is 2 but the longest document is 3"),
        (dict(num_target_tokens=3), "num_target_tokens is 3 but labels hold 2"),
        (dict(cp_size=2, cp_rank=2), "cp_rank=2 is not within cp_size=2"),
        (dict(cp_size=2, cp_rank=0), "needs cp_cu_seqlens"),
        (dict(input_ids=torch.tensor([], dtype=torch.long)), "empty"),
    ],
)
def test_micro_batch_validation_names_the_value(changes, match):
    with pytest.raises(PlanError, match=match):
        _mb(**changes)


def test_stage_and_plan_validation():
    dp2 = Layout(dp=2, tp=2)
    with pytest.raises(PlanError, match="has 1 dp groups of micro-batches; the layout has dp=2"):
        Stage(dp2, (((0,),),))
    with pytest.raises(PlanError, match="empty micro-batch"):
        Stage(dp2, (((0,), ()), ((1,),)))
    ok = Stage(dp2, (((0,),), ((1, 2),)))
    with pytest.raises(PlanError, match=r"missing \[3\], repeated \[\]"):
        StepPlan(0, (4, 5, 6, 7), (ok,))
    with pytest.raises(PlanError, match=r"missing \[\], repeated \[1\]"):
        StepPlan(0, (4, 5, 6), (ok, Stage(Layout(dp=4), (((1,),), (), (), ()))))
    with pytest.raises(PlanError, match="mixes world sizes"):
        StepPlan(0, (4, 5, 6), (Stage(Layout(dp=2), (((0, 1, 2),), ())), Stage(dp2, ((), ()))))
    with pytest.raises(PlanError, match="names document 9"):
        StepPlan(0, (4,), (Stage(Layout(dp=1), (((0, 9),),)),))
    plan = StepPlan(0, (4, 5, 6), (ok,))
    assert plan.global_target_tokens == 3 + 4 + 5


def _mixed_plan(lengths):
    """Every foundation layout appears as a stage; dp groups get uneven work."""
    ids = list(range(len(lengths)))
    stages = [
        Stage(Layout(dp=4), (((ids[0], ids[1]),), ((ids[2],),), (), ((ids[3],), (ids[4],)))),
        Stage(Layout(dp=2, tp=2), (((ids[5],),), ((ids[6],),))),
        Stage(Layout(tp=4), (((ids[7], ids[8]),),)),
        Stage(Layout(dp=2, cp=2), (((ids[9],),), ())),
        Stage(Layout(tp=2, cp=2), (((ids[10], ids[11]), (ids[12],)),)),
    ]
    return StepPlan(3, tuple(lengths), tuple(stages))


def test_slice_plan_every_token_once_and_tp_ranks_identical():
    lengths = [5, 9, 3, 12, 7, 30, 17, 40, 33, 50, 21, 64, 47]
    docs = _docs(lengths, seed=1)
    plan = _mixed_plan(lengths)
    mesh = MeshShape.for_layouts(FOUNDATION, 4)
    slices = [slice_plan(plan, docs, mesh, r) for r in range(4)]
    assert all(len(s.stages) == 5 and s.global_target_tokens == sum(n - 1 for n in lengths) for s in slices)
    tokens = Counter()
    targets = 0
    for stage_index, stage in enumerate(plan.stages):
        layout = stage.layout
        owners = {}
        for r in range(4):
            dp, tp, cp = mesh.rank_coords(layout, r)
            key = (dp, cp)
            mbs = slices[r].stages[stage_index].micro_batches
            if key in owners:  # a tp peer: identical inputs
                other = slices[owners[key]].stages[stage_index].micro_batches
                assert all(torch.equal(a.input_ids, b.input_ids) for a, b in zip(mbs, other))
                continue
            owners[key] = r
            for mb in mbs:
                assert mb.cp_size == layout.cp and mb.cp_rank == cp
                real = mb.labels != IGNORE_INDEX
                targets += int(real.sum())
                for d_local, doc_id in enumerate(mb.doc_ids):
                    lo, hi = mb.cu_seqlens[d_local].item(), mb.cu_seqlens[d_local + 1].item()
                    for p, t in zip(mb.position_ids[lo:hi].tolist(), mb.input_ids[lo:hi].tolist()):
                        if p < lengths[doc_id]:
                            tokens[(doc_id, p, t)] += 1
    expected = Counter((d, p, t) for d, doc in enumerate(docs) for p, t in enumerate(doc.tolist()))
    assert tokens == expected
    assert targets == plan.global_target_tokens


def test_slice_plan_rejects_foreign_layouts_and_wrong_doc_count():
    mesh = MeshShape.for_layouts(["dp4", "tp4"], 4)
    plan = single_stage_plan(0, [3, 4], Layout(dp=2, tp=2))
    with pytest.raises(LayoutError, match="uses layout dp2xtp2, which is not among"):
        slice_plan(plan, _docs([3, 4]), mesh, 0)
    with pytest.raises(PlanError, match="has 2 documents, got 1 token arrays"):
        slice_plan(single_stage_plan(0, [3, 4], Layout(dp=4)), _docs([3]), mesh, 0)


def _cp_rank_plan():
    mesh = MeshShape.for_layouts(["dp2", "cp2"], 2)
    plan = StepPlan(step=3, doc_lengths=(3, 4, 5), stages=(
        Stage(Layout(dp=2), (((0,),), ((1,),))), Stage(Layout(cp=2), (((2,),),))))
    return slice_plan(plan, _docs([3, 4, 5]), mesh, 1)


TENSOR_FIELDS = {"input_ids", "labels", "position_ids", "cu_seqlens", "cp_cu_seqlens"}


def test_rank_plan_maps_every_tensor_and_keeps_the_rest():
    """Moving and pinning go through ``map_tensors``: every tensor (cp slices included) must be
    mapped, and nothing else may change."""
    rp = _cp_rank_plan()
    made = []

    def fn(t: torch.Tensor) -> torch.Tensor:
        made.append(t.clone())
        return made[-1]

    mapped = rp.map_tensors(fn)
    assert (mapped.step, mapped.global_target_tokens) == (rp.step, rp.global_target_tokens)
    assert [s.layout for s in mapped.stages] == [s.layout for s in rp.stages]
    assert [m.doc_ids for m in mapped.micro_batches] == [(1,), (2,)]
    fresh = {id(t) for t in made}
    for before, after in zip(rp.micro_batches, mapped.micro_batches):
        tensors = {k: v for k, v in vars(after).items() if isinstance(v, torch.Tensor)}
        assert set(tensors) == TENSOR_FIELDS - ({"cp_cu_seqlens"} if before.cp_size == 1 else set())
        for name, t in tensors.items():
            assert id(t) in fresh and torch.equal(t, getattr(before, name)), name
        assert (after.max_seqlen, after.num_target_tokens, after.cp_size, after.cp_rank) == (
            before.max_seqlen, before.num_target_tokens, before.cp_size, before.cp_rank)


def test_rank_plan_to_and_pin_memory_reach_every_tensor(monkeypatch):
    rp = _cp_rank_plan()
    calls = []
    monkeypatch.setattr(torch.Tensor, "to", lambda t, *a, **k: calls.append((a, k)) or t)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t: calls.append("pin") or t)
    rp.to("cuda:1", non_blocking=True)
    n = sum(getattr(m, f) is not None for m in rp.micro_batches for f in TENSOR_FIELDS)
    assert n == 9  # a dp micro-batch (4 tensors) and a cp slice (5)
    assert calls == [(("cuda:1",), {"non_blocking": True})] * n
    calls.clear()
    rp.pin_memory()
    assert calls == ["pin"] * n


def test_idle_rounds_only_where_a_shard_group_spans_dp_groups():
    """dp4:fsdp and dp4:fsdp2 (shards across dp groups) give the group without micro-batches the
    busiest group's rounds; dp2xcp2:fsdp2 (the shard is its cp pair) and a replicated layout none."""
    layouts = ["dp4:fsdp", "dp4:fsdp2", "dp2xcp2:fsdp2", "dp4"]
    mesh = MeshShape.for_layouts(layouts, 4)
    lengths = list(range(8, 24))  # 4 documents per stage, each planned once
    stages = []
    for i, x in enumerate(layouts):
        a, b, c, d = range(4 * i, 4 * i + 4)
        groups = (((a,), (b,)), ((c,),), (), ((d,),)) if x.startswith("dp4") else (((a,), (b,), (c,)), ((d,),))
        stages.append(Stage(Layout.parse(x), groups))
    plan = StepPlan(0, tuple(lengths), tuple(stages))
    docs = _docs(lengths)
    rounds = {x: [slice_plan(plan, docs, mesh, r).stages[i].num_rounds for r in range(4)]
              for i, x in enumerate(layouts)}
    own = {x: [len(stages[i].micro_batches[mesh.rank_coords(Layout.parse(x), r)[0]]) for r in range(4)]
           for i, x in enumerate(layouts)}  # each rank's own dp group's micro-batches
    assert rounds == {"dp4:fsdp": [2, 2, 2, 2], "dp4:fsdp2": [2, 2, 2, 2],
                      "dp2xcp2:fsdp2": own["dp2xcp2:fsdp2"], "dp4": own["dp4"]}, rounds
    assert sorted(own["dp2xcp2:fsdp2"]) == [1, 1, 3, 3] and sorted(own["dp4"]) == [0, 1, 1, 2]
