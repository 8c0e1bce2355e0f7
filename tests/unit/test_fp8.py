"""FP8 switch (parallel/fp8.py) in one process: validation, which layers convert, _scaled_mm runs."""

from __future__ import annotations

import logging

import pytest
import torch

from lightning_hotspa.models import Llama, LlamaConfig
from lightning_hotspa.parallel.fp8 import check_fp8, install_fp8, uninstall_fp8
from lightning_hotspa.testing.fp8_layouts import scaled_mm_counter

pytest.importorskip("torchao")


@pytest.mark.parametrize("bad", ["fp8", "Tensorwise", 8, "delayed"])
def test_a_bad_recipe_names_the_value(bad) -> None:
    with pytest.raises(ValueError, match=repr(bad).replace("'", ".")):
        check_fp8(bad)


def test_off_values() -> None:
    assert [check_fp8(v) for v in (None, "none", "null", "", False)] == [None] * 5
    assert check_fp8("rowwise") == "rowwise"


def test_missing_torchao_is_a_clear_error(monkeypatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    with pytest.raises(ImportError, match="needs torchao"):
        check_fp8("tensorwise")


def test_block_projections_convert_and_the_rest_stays(caplog) -> None:
    """Tiny Llama: 7 projections per block convert; embedding and head stay; under tp2 the FFN (176 wide,
    88 per shard) stays bf16 with a log line naming it."""
    model = Llama(LlamaConfig.preset("tiny"))
    names = install_fp8(model, "tensorwise")
    assert len(names) == 14 and all(n.startswith("layers.") for n in names)
    assert uninstall_fp8(model) == 14 and not hasattr(model.layers[0].attention.wq, "_hotspa_fp8")
    with caplog.at_level(logging.INFO, logger="lightning_hotspa.parallel.fp8"):
        names = install_fp8(model, "tensorwise", max_tp=2)
    assert len(names) == 8 and "layers.0.feed_forward.w1" in caplog.text and "not divisible by 32" in caplog.text


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_a_step_runs_scaled_mm_close_to_bf16(recipe) -> None:
    cfg = LlamaConfig.preset("tiny")
    torch.manual_seed(0)
    ids = torch.randint(0, 256, (64,))
    pos, cu = torch.arange(64), torch.tensor([0, 64])
    losses = []
    for fp8 in (None, recipe):
        torch.manual_seed(0)
        model = Llama(cfg).to(torch.bfloat16)
        if fp8:
            install_fp8(model, fp8)
        with scaled_mm_counter() as calls:
            loss = model(ids, pos, cu, 64, labels=torch.roll(ids, -1))
            loss.backward()
        losses.append(float(loss.detach()))
    per_step = {"tensorwise": 42, "rowwise": 42, "rowwise_with_gw_hp": 28}[recipe]  # 14 layers x 3 or 2 GEMMs
    assert calls["calls"] == per_step
    assert abs(losses[1] - losses[0]) / losses[0] <= 0.03
