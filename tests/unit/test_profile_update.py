"""Shard-efficiency curves in hardware profiles, and applying a measured profile-update file."""

from __future__ import annotations

import dataclasses
import json

import pytest

from lightning_hotspa.layout import Layout
from lightning_hotspa.planner.cost.cost_model import AnalyticCostModel
from lightning_hotspa.planner.cost.hardware import PROFILES, get_profile
from lightning_hotspa.planner.cost.profile_update import ProfileUpdateError, apply_profile_update, main


def test_no_curve_means_perfect_division_as_before():
    for profile in PROFILES.values():
        assert profile.tp_efficiency == profile.cp_efficiency == ()
        assert all(profile.shard_efficiency(tp, cp) == 1.0 for tp in (1, 2, 4, 8) for cp in (1, 2, 8))


def test_curve_interpolates_in_log2_and_holds_past_its_ends():
    h = dataclasses.replace(get_profile("H200"), tp_efficiency=((8, 0.6), (2, 0.9)), cp_efficiency=[(2, 0.8)])
    assert h.tp_efficiency == ((2, 0.9), (8, 0.6))  # sorted, tuples
    assert h.shard_efficiency(1, 1) == 1.0
    assert h.shard_efficiency(4, 1) == pytest.approx(0.75)  # halfway between 2 and 8 in log2
    assert h.shard_efficiency(16, 1) == pytest.approx(0.6)
    assert h.shard_efficiency(2, 4) == pytest.approx(0.9 * 0.8)


def test_cost_model_divides_compute_by_the_efficiency():
    base = get_profile("H200")
    slow = dataclasses.replace(base, tp_efficiency=((2, 0.5),))
    par = Layout.parse("dp4xtp2")
    before = AnalyticCostModel("llama7b", base, 8).option(par, False)
    after = AnalyticCostModel("llama7b", slow, 8).option(par, False)
    assert after.quadratic == pytest.approx(2 * before.quadratic)  # attention: compute only
    assert after.linear > before.linear
    dp = Layout.parse("dp8")
    assert (AnalyticCostModel("llama7b", slow, 8).option(dp, False)
            == AnalyticCostModel("llama7b", base, 8).option(dp, False))


@pytest.mark.parametrize(("curve", "message"), [
    (((0, 0.9),), "degree must be an int >= 1, got 0"),
    (((2, 2.5),), "efficiency at degree 2 must be in"),
    (((2, 0.9), (2, 0.8)), "repeats a degree"),
    ((2, 0.9), "must be \\(degree, efficiency\\) pairs"),
])
def test_bad_curves_are_refused_by_name(curve, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(get_profile("H200"), tp_efficiency=curve)


def test_update_file_applies_to_its_base_profile(tmp_path):
    update = {"profile": "H200", "set": {"dense_efficiency": 0.6, "tp_efficiency": [[2, 0.95], [8, 0.8]]},
              "measured": {"date": "2026-12-01", "device": "NVIDIA H200"}}
    path = tmp_path / "h200_profile_update.json"
    path.write_text(json.dumps(update))
    profile = get_profile(str(path))
    assert profile.name == "H200" and profile.dense_efficiency == 0.6
    assert profile.tp_efficiency == ((2, 0.95), (8, 0.8))
    assert profile.attention_efficiency == get_profile("H200").attention_efficiency
    assert "UPDATED" in profile.source and "NVIDIA H200" in profile.source
    printed = main([str(path)])  # the CLI prints the fields to paste into hardware.py
    assert printed["dense_efficiency"] == 0.6 and printed["tp_efficiency"] == ((2, 0.95), (8, 0.8))


def test_bad_updates_name_what_is_wrong(tmp_path):
    with pytest.raises(ProfileUpdateError, match="memory_bytes"):
        apply_profile_update("H200", {"set": {"memory_bytes": 1}})
    with pytest.raises(ProfileUpdateError, match="'set' mapping"):
        apply_profile_update("H200", {"dense_efficiency": 0.5})
    with pytest.raises(ProfileUpdateError, match="dense_efficiency must be > 0"):
        apply_profile_update("H200", {"set": {"dense_efficiency": 0.0}})
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(ProfileUpdateError, match="not JSON"):
        get_profile(str(bad))
    with pytest.raises(ProfileUpdateError, match="cannot read"):
        get_profile(str(tmp_path / "missing.json"))
