"""Smoke of recipes/benchmark_hot_path.py's ``cp_exchange_bytes_per_layer`` part (a small document on a
fake world of 64): the KV ring's bytes per layer are what the cost model prices, all received while a
block kernel ran but the last dK / dV shift; a hybrid adds its Ulysses all-to-alls, exposed."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "benchmark_hot_path.py"


def _recipe():
    sys.path.insert(0, str(RECIPE.parent))
    try:
        spec = importlib.util.spec_from_file_location("benchmark_hot_path_smoke", RECIPE)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(RECIPE.parent))
    return module


def test_the_ring_exchange_per_layer_is_priced_and_hidden_but_its_tail():
    recipe = _recipe()
    ring = recipe.cp_exchange(64, "tp8xcp8:kv", 2048)
    priced = ring["cost_model_bytes"]["ring of K / V (of K / V and dK / dV in backward)"]
    step = ring["ring_exposed"]  # one shift: the last dK / dV, after the last kernel
    assert ring["ring_bytes"] == priced == 22 * step  # 7 forward, 7 + 8 backward
    assert ring["ring_overlapped"] == 21 * step and ring["ulysses_bytes"] == 0 == ring["exposed_bytes"] - step
    hybrid = recipe.cp_exchange(64, "tp8xcp8:kv2", 2048)
    assert hybrid["ring_bytes"] == hybrid["cost_model_bytes"]["ring of K / V (of K / V and dK / dV in backward)"]
    assert hybrid["ulysses_bytes"] > 0 and hybrid["exposed_bytes"] == hybrid["ulysses_bytes"] + hybrid["ring_exposed"]
