"""The context-parallel kind registry (lightning_hotspa/cp_kinds.py): every reader takes a kind from it,
and every implementation bound by a kind's name covers the registry exactly."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from lightning_hotspa.cp_kinds import CP_KINDS, check_bound, kind_of, parse_suffix
from lightning_hotspa.layout import Layout, LayoutError
from lightning_hotspa.model_shape import PRESET_SHAPES
from lightning_hotspa.parallel.core_attention import CP_ATTENTION
from lightning_hotspa.planner.candidates import cp_kinds
from lightning_hotspa.planner.cost.cost_model import AnalyticCostModel
from lightning_hotspa.planner.cost.cp_memory import MEMORY_TERMS


def test_each_split_of_cp_is_one_kind_and_its_name_reads_back() -> None:
    for cp in (1, 2, 3, 4, 6, 8, 12, 16):
        for cp_kv in (d for d in range(1, cp + 1) if cp % d == 0):
            lay = Layout(cp=cp, cp_kv=cp_kv)
            expected = "ulysses" if cp_kv == 1 else "kv" if cp_kv == cp else "hybrid"
            assert lay.cp_kind == kind_of(cp, cp_kv).name == expected, (cp, cp_kv)
            assert Layout.parse(lay.name) == lay
    assert [Layout.parse(n).name for n in ("cp4:kv1", "cp4:kv4", "tp2xcp8:kv2:fsdp4")] == [
        "cp4", "cp4:kv", "tp2xcp8:kv2:fsdp4"]


def test_a_bad_suffix_names_itself() -> None:
    with pytest.raises(ValueError, match=r"':ring' is no cp-kind suffix; registered: \[':kv', ':kv<m>'\]"):
        parse_suffix(":ring", 4)
    with pytest.raises(LayoutError, match="cannot parse layout 'cp4:ring'"):
        Layout.parse("cp4:ring")
    with pytest.raises(LayoutError, match="':kv' names a kind of context parallelism"):
        Layout.parse("dp4:kv")


def test_candidates_offer_what_each_kind_offers() -> None:
    assert cp_kinds(1, 1, 8) == [1]
    assert cp_kinds(1, 4, 8) == [1, 4]  # inside a node: no hybrid
    assert cp_kinds(1, 16, 8) == [1, 16, 2]  # Ulysses over 8 inside the node, KV gather over 2 nodes
    assert cp_kinds(2, 8, 8) == [1, 8, 2]
    assert cp_kinds(8, 4, 8) == [1, 4]  # tp fills the node: no Ulysses part fits in it


def test_every_kind_has_one_attention_call_and_one_set_of_memory_terms() -> None:
    assert set(CP_ATTENTION) == set(MEMORY_TERMS) == set(CP_KINDS)
    check_bound(CP_ATTENTION, "attention")
    with pytest.raises(ValueError, match=r"missing \['kv'\], not registered \[\]"):
        check_bound({k: v for k, v in CP_ATTENTION.items() if k != "kv"}, "attention")
    with pytest.raises(ValueError, match=r"missing \[\], not registered \['ring'\]"):
        check_bound({**MEMORY_TERMS, "ring": MEMORY_TERMS["kv"]}, "memory")


def test_each_kind_issues_collectives_over_its_parts() -> None:
    shape = PRESET_SHAPES["llama3-8b"]
    for name, ranks in (("dp8", []), ("cp8", [8]), ("cp8:kv", [8]), ("cp8:kv2", [4, 2])):
        lay = Layout.parse(name)
        found = [e.ranks for e in CP_KINDS[lay.cp_kind].exchanges(shape, lay.tp, lay.cp, lay.cp_kv)]
        assert found == ranks, name
    hybrid = CP_KINDS["hybrid"].exchanges(shape, 2, 8, 2)
    assert [(e.span, e.stride) for e in hybrid] == [(8, 2), (16, 8)]  # Ulysses inside, the gather outside it
    assert [e.recomputes_attention for e in hybrid] == [False, True]


def test_the_cost_model_prices_the_kinds_collectives(monkeypatch: pytest.MonkeyPatch) -> None:
    """The cost model reads a kind's collectives from its record: without them the hybrid costs
    what the same degrees cost without cp traffic (its ring re-runs no attention: the same quadratic)."""
    cm = AnalyticCostModel("llama3-8b", "H100", 16)
    lay = Layout.parse("tp2xcp8:kv2")
    with_exchanges = cm.option(lay, False, capacity=65536)
    record = CP_KINDS["hybrid"]
    monkeypatch.setitem(CP_KINDS, "hybrid", dataclasses.replace(record, exchanges=lambda *args: ()))
    without = cm.option(lay, False, capacity=65536)
    assert without.per_micro_batch < with_exchanges.per_micro_batch
    assert without.linear < with_exchanges.linear and without.quadratic == with_exchanges.quadratic
    assert without.ring_exchange == 0 < with_exchanges.ring_exchange


def test_the_ring_is_priced_hidden_behind_attention_where_the_runtime_overlaps_it() -> None:
    """Ours (HOTSPA: cp_comm_overlap) on H100: a document's ring exchange costs max(0, x s - h s^2) beyond
    its plain seconds (h: the attention of cp_kv - 1 of its cp_kv ring steps), so a long document hides it
    and a short one pays it; the last dK / dV shift of each layer stays exposed (in b). Without the overlap
    (a runtime that waits, or cpu-gloo, where nothing hides) all of it is in b and each ring step is a launch."""
    from lightning_hotspa.planner.cost.runtime_profile import HOTSPA

    lay = Layout.parse("tp8xcp8:kv")
    cm = AnalyticCostModel("llama3-8b", "H100", 64)
    opt = cm.option(lay, False, capacity=1 << 20)
    ex = CP_KINDS["kv"].exchanges(cm.model, 8, 8, 8)[0]
    step = ex.width / 8 * cm.param_bytes / 8 / cm.hardware.bandwidth(ex.span, ex.stride)  # one step, per token
    layers = cm.model.n_layers
    assert opt.ring_exchange == pytest.approx(3 * 7 * layers * step)
    attn = cm._attention_seconds(8 * 8 * cm.hardware.shard_efficiency(8, 8))
    assert opt.ring_hiding == pytest.approx(7 / 8 * attn) and opt.quadratic == pytest.approx(attn)
    s = np.array([1024.0, 1 << 20])
    plain = (opt.quadratic * s + opt.linear) * s
    assert opt.doc_seconds(s) - plain == pytest.approx(np.maximum(0, opt.ring_exchange * s - opt.ring_hiding * s * s))
    assert opt.doc_seconds(s)[0] > plain[0] and opt.doc_seconds(s)[1] == plain[1]  # short pays, long hides
    waits = AnalyticCostModel("llama3-8b", "H100", 64, runtime=dataclasses.replace(HOTSPA, cp_comm_overlap=False))
    exposed = waits.option(lay, False, capacity=1 << 20)
    assert exposed.ring_exchange == 0 and exposed.linear == pytest.approx(opt.linear + opt.ring_exchange)
    lat = cm.hardware.latency(ex.span)
    assert exposed.per_micro_batch - opt.per_micro_batch == pytest.approx(3 * (7 - 1) * layers * lat)
    gloo = AnalyticCostModel("small", "cpu-gloo", 8).option(Layout.parse("cp8:kv"), False, capacity=4096)
    assert gloo.ring_exchange == gloo.ring_hiding == 0


@pytest.mark.parametrize(("model", "tp", "u"), [("llama3-8b", 8, 4), ("llama3-8b", 4, 8), ("llama3-8b", 2, 8),
                                                ("llama3-8b", 2, 2), ("llama3-70b", 8, 8), ("llama7b", 4, 8)])
def test_the_ulysses_priced_width_is_what_exchange_qkv_moves(monkeypatch, model, tp, u) -> None:
    """The all-to-all's priced elements per token (``width / tp``) equal what ``parallel/ulysses.py`` sends: the
    fused q / k / v (kv heads repeated until u divides them) plus the output's q heads."""
    import torch

    from lightning_hotspa.parallel import ulysses

    shape = PRESET_SHAPES[model]
    sent: list[int] = []

    def fake_a2a(t, group):  # heads -> tokens: [T, H, d] -> [T * u, H / u, d]
        sent.append(t.numel())
        return torch.zeros(t.shape[0] * group.size, t.shape[1] // group.size, t.shape[2])

    monkeypatch.setattr(ulysses, "all_to_all_heads_to_tokens", fake_a2a)
    tokens, d = 4, shape.head_dim
    kv = shape.n_kv_heads // tp if shape.n_kv_heads % tp == 0 else 1  # tp_plan: the one kv head its q heads use
    q, k = torch.zeros(tokens, shape.n_heads // tp, d), torch.zeros(tokens, kv, d)
    ulysses.exchange_qkv(q, k, k.clone(), type("G", (), {"size": u})())
    moved = sum(sent) / tokens + shape.n_heads // tp * d  # and the output's all-to-all
    ex = CP_KINDS["ulysses"].exchanges(shape, tp, u, 1)[0]
    assert ex.width / tp == moved
