"""Activation checkpointing as a typed per-stage mode: parsing, names, the planner's options and
their prices (the runtime's equivalence: tests/distributed/test_parallel.py; memory: tests/unit/test_memory.py)."""

from __future__ import annotations

import pytest

from lightning_hotspa.activation_checkpointing import Checkpointing
from lightning_hotspa.layout import Layout
from lightning_hotspa.plan import PlanError, Stage
from lightning_hotspa.planner.cost.cost_model import AnalyticCostModel
from lightning_hotspa.planner.solve.solver import CostModelPlanner


def test_modes_parse_from_names_and_bools_and_name_a_bad_value() -> None:
    assert [Checkpointing.parse(x) for x in (False, True, "none", "selective", "full")] == [
        Checkpointing.NONE, Checkpointing.FULL, Checkpointing.NONE, Checkpointing.SELECTIVE, Checkpointing.FULL]
    for bad in ("sometimes", 1, None, "Full"):
        with pytest.raises(ValueError, match=f"got {bad!r}"):
            Checkpointing.parse(bad)
    assert Stage(Layout.parse("dp1"), ((),), "selective").activation_checkpointing is Checkpointing.SELECTIVE
    with pytest.raises(ValueError, match="got 'partial'"):
        Stage(Layout.parse("dp1"), ((),), "partial")


def test_stage_names_round_trip_through_the_suffix() -> None:
    assert [m.suffix for m in Checkpointing] == ["", "+sac", "+ac"]
    for mode in Checkpointing:
        assert Checkpointing.from_suffix("tp2xcp2:kv" + mode.suffix) == ("tp2xcp2:kv", mode)
    assert Checkpointing.NONE.stronger("selective") is Checkpointing.SELECTIVE
    assert Checkpointing.FULL.stronger(False) is Checkpointing.FULL and not Checkpointing.NONE


def test_auto_prices_three_options_per_replicated_layout_and_two_per_sharded_one() -> None:
    planner = CostModelPlanner(["dp4", "dp2xtp2", "dp4:fsdp"], model="tiny", world_size=4)
    labels = [o.label for o in planner._option_list]
    assert labels == ["dp4", "dp4+sac", "dp4+ac", "dp2xtp2", "dp2xtp2+sac", "dp2xtp2+ac", "dp4:fsdp", "dp4:fsdp+ac"]
    only = CostModelPlanner(["dp4", "dp2xtp2"], model="tiny", world_size=4, activation_checkpointing="selective")
    assert [o.label for o in only._option_list] == ["dp4+sac", "dp2xtp2+sac"]
    with pytest.raises(PlanError, match="'sometimes'"):
        CostModelPlanner(["dp4"], model="tiny", world_size=4, activation_checkpointing="sometimes")
    with pytest.raises(PlanError, match="sharded layout dp4:fsdp"):
        CostModelPlanner(["dp4:fsdp"], model="tiny", world_size=4, activation_checkpointing="selective")


@pytest.mark.parametrize("layout", ["dp8", "dp2xtp4", "dp2xcp4", "tp2xcp4:kv"])
def test_selective_prices_between_none_and_full(layout: str) -> None:
    """Time: selective recomputes the q/k/v GEMMs and the attention forward, full the whole block;
    memory: selective keeps more than full and less than none, so its capacity lies between."""
    cm, lay = AnalyticCostModel("llama3-8b", "H100", 8), Layout.parse(layout)
    none, sac, full = (cm.option(lay, m) for m in ("none", "selective", "full"))
    assert none.linear < sac.linear < full.linear
    assert none.quadratic < sac.quadratic == full.quadratic  # both recompute the attention forward
    assert none.capacity < sac.capacity < full.capacity
    m = cm.model
    qkv = m.hidden * (cm.attn_width + 2 * cm.kv_width)  # per layer: what selective recomputes
    extra = (cm._dense_seconds_per_token(lay, "selective") - cm._dense_seconds_per_token(lay, "none"))
    expected = cm._dense_seconds_per_token(lay, "none") * 2 * qkv * m.n_layers / (6 * cm.dense_params)
    assert extra == pytest.approx(expected)


def test_strategy_reads_the_three_modes_and_keeps_bools() -> None:
    from lightning_hotspa.adapter.lightning.strategy import HotSPaStrategy

    tp = Layout.parse("dp2xtp2")
    for spec, mode in (("selective", "selective"), ("full", "full"), ("none", "none"), (True, "full"), (False, "none")):
        strategy = HotSPaStrategy(["dp4", "dp2xtp2"], activation_checkpointing=spec)
        assert strategy.activation_checkpointing_for(tp) == mode
    listed = HotSPaStrategy(["dp4", "dp2xtp2"], activation_checkpointing=["dp2xtp2"])
    assert listed.activation_checkpointing_for(tp) is Checkpointing.FULL
    with pytest.raises(ValueError, match="'none', 'selective', 'full', 'auto'.*got 'sometimes'"):
        HotSPaStrategy(activation_checkpointing="sometimes")


def test_one_grammar_parses_activation_checkpointing_for_the_strategy_and_both_planners():
    from lightning_hotspa.activation_checkpointing import parse_checkpointing_spec
    from lightning_hotspa.adapter.lightning.layout_choice import check_checkpointing_spec
    from lightning_hotspa.planner.rule import ThresholdPlanner

    assert parse_checkpointing_spec("auto") == "auto"
    assert parse_checkpointing_spec(True) is Checkpointing.FULL
    assert parse_checkpointing_spec(["dp2xtp2"]) == (Layout.parse("dp2xtp2"),)
    expected = "activation_checkpointing must be 'none', 'selective', 'full', 'auto', a bool or a list of layouts, " \
               "got 'sometimes'"
    for parse in (check_checkpointing_spec, parse_checkpointing_spec):
        with pytest.raises(ValueError, match=expected):
            parse("sometimes")
    with pytest.raises(PlanError, match=expected):
        CostModelPlanner(["dp4"], model="tiny", world_size=4, activation_checkpointing="sometimes")
    with pytest.raises(PlanError, match=expected):
        ThresholdPlanner(["dp4"], 64, activation_checkpointing="sometimes")
    layouts = ["dp4", "dp2xtp2"]
    assert ThresholdPlanner(layouts, 64, activation_checkpointing="full").activation_checkpointing == {
        Layout.parse(x) for x in layouts}
    assert ThresholdPlanner(layouts, 64, activation_checkpointing=False).activation_checkpointing == frozenset()
    with pytest.raises(PlanError, match="'selective' is not built here"):
        ThresholdPlanner(layouts, 64, activation_checkpointing="selective")
