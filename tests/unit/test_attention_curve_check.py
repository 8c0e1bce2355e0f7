"""gpu_check part (h)'s speed cells price each length on the profile's curve and fit the measured one: run here
with the one ``documents`` kernel that runs on CPU (``sdpa``, priced as fa2), its figures CPU ones."""

from __future__ import annotations

import importlib
import sys
import time
from pathlib import Path

import pytest
import torch

from lightning_hotspa.planner.cost.attention_curves import fit_saturating
from lightning_hotspa.planner.cost.hardware import get_profile

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


@pytest.fixture
def hopper():
    sys.path.insert(0, str(RECIPES))
    try:
        yield importlib.import_module("gpu_check_hopper")
    finally:
        sys.path.remove(str(RECIPES))
        for name in ("gpu_check_hopper", "gpu_check_common"):
            sys.modules.pop(name, None)


def test_speed_cells_price_each_length_and_fit_the_measured_curve(hopper):
    common = sys.modules["gpu_check_common"]
    budget = common.Budget(120.0, time.monotonic() + 120.0)
    out = hopper._documents("sdpa", torch.device("cpu"), torch.float32, [32, 128], "H100", budget)
    assert out["status"] == "ok" and out["match"]
    h100 = get_profile("H100")
    for cell in out["speed"]:
        n = cell["length"]
        assert cell["priced_as"] == "fa2"
        assert cell["profile_efficiency"] == pytest.approx(0.175 * n / (n + h100.attention_half_length_for("fa2")))
    curve = out["curve"]
    assert curve["profile_half_length"] == 314.0 and curve["profile_efficiency_long"] == 0.175
    again = fit_saturating("sdpa", [c["length"] for c in out["speed"]], [c["tflops"] for c in out["speed"]])
    assert curve["half_length"] == again.half_length and curve["max_residual"] == pytest.approx(0.0, abs=1e-9)


def test_a_curve_needs_two_distinct_positive_lengths():
    with pytest.raises(ValueError, match=r"\[512, 512\]"):
        fit_saturating("fa2", [512, 512], [100.0, 110.0])
    with pytest.raises(ValueError, match="-3"):
        fit_saturating("fa2", [512, 1024], [-3.0, 110.0])
