"""FP8 switch (parallel/fp8.py) in one process: validation, which layers convert, _scaled_mm runs."""

from __future__ import annotations

import logging

import pytest
import torch

from lightning_hotspa.models import Llama, LlamaConfig
from lightning_hotspa.parallel.fp8 import check_fp8, install_fp8, uninstall_fp8
from lightning_hotspa.tools.fp8_layouts import scaled_mm_counter

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


def test_gpu_check_fp8_part_dry_run(tmp_path) -> None:
    """gpu_check.py --parts fp8 on CPU (the dry run: never run on a GPU): every recipe ran _scaled_mm."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, str(root / "recipes" / "gpu_check.py"), "--dry-run", "--parts", "fp8",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    part = json.loads((tmp_path / "gpu_check.json").read_text())["parts"]["fp8"]
    assert part["status"] == "ok", part
    for recipe, cell in part["recipes"].items():
        assert cell["fp8_linears"] == 7 and cell["scaled_mm_calls"] >= 14 and cell["rel_error"] < 0.2, (recipe, cell)


def test_strategy_and_hydra_switch() -> None:
    """``HotSPaStrategy(runtime=RuntimeOptions(fp8=...))`` validates at construction; every strategy config
    names ``runtime.fp8`` (off)."""
    from pathlib import Path

    from omegaconf import OmegaConf

    from lightning_hotspa import HotSPaStrategy, RuntimeOptions

    with pytest.raises(ValueError, match="strategy.runtime.fp8='e4m3'"):
        HotSPaStrategy(runtime=RuntimeOptions(fp8="e4m3"))
    assert HotSPaStrategy(runtime={"fp8": "rowwise"}).fp8 == "rowwise" and HotSPaStrategy().fp8 is None
    folder = Path(__file__).resolve().parents[2] / "configs" / "strategy"
    for path in folder.glob("*.yaml"):
        assert OmegaConf.load(path).runtime.get("fp8", "missing") is None, path.name
