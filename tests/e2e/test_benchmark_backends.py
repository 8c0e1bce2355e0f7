"""recipes/benchmark_backends.py: the single-device backend benchmark runs on CPU, its efficiency fit
recovers known efficiencies, and bad arguments end with a message naming the value."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from lightning_hotspa.models.config import LlamaConfig

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("benchmark_backends", ROOT / "recipes" / "benchmark_backends.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _counted_flops_per_token(config: LlamaConfig, length: int) -> float:
    """Forward + backward FLOPs per token as torch's FlopCounterMode counts them on the real model,
    with the attention matmuls (``bmm`` on CPU) halved: the attention is causal. SDPA runs its math
    kernel here: the counter has no formula for the CPU flash kernel the model takes by default
    (it would count no attention at all)."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from lightning_hotspa.models import build_llama
    from lightning_hotspa.plan import pack_micro_batch

    model = build_llama(config, seed=0)
    mb = pack_micro_batch([torch.randint(0, config.vocab_size, (length,))])
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(mb.input_ids, mb.position_ids, mb.cu_seqlens, mb.max_seqlen).float().sum().backward()
    ops = {str(k): v for k, v in counter.get_flop_counts()["Global"].items()}
    return (counter.get_total_flops() - ops.get("aten.bmm", 0) / 2) / length


def test_runs_every_cpu_backend_and_reports_unavailable_ones(bench) -> None:
    import time

    t0 = time.perf_counter()
    out = bench.main(["--device", "cpu", "--preset", "tiny", "--lengths", "32,128", "--tokens", "256",
                      "--steps", "1", "--warmup", "0", "--backends", "sdpa,flash_varlen"])
    wall = time.perf_counter() - t0
    assert out["skipped"] == {"flash_varlen": "unavailable on this machine"}
    cells = out["backends"]["sdpa"]["cells"]
    assert [(c["length"], c["tokens"]) for c in cells] == [(32, 256), (128, 256)]
    assert 0 < sum(c["seconds"] for c in cells) < wall  # measured steps, inside this call
    config = LlamaConfig.preset("tiny")
    for c in cells:
        # the FLOPs behind the MFU, against an independent count (the analytic formula is within 0.5 %)
        implied = c["mfu"] * out["peak_flops"] * c["seconds"] / c["tokens"]
        assert implied == pytest.approx(_counted_flops_per_token(config, c["length"]), rel=0.01), c["length"]


def test_fit_recovers_the_efficiencies_that_made_the_times(bench) -> None:
    config, peak = LlamaConfig.preset("small"), 1e12
    dense = 6.0 * config.num_params(include_embedding=False)
    cells = []
    for length in (256, 1024, 4096):
        per_token = dense / (peak * 0.6) + (config.flops_per_token(length) - dense) / (peak * 0.3)
        cells.append({"length": length, "tokens": 8192, "seconds": per_token * 8192})
    cells.append({"length": 8192, "tokens": 8192, "error": "out of memory"})  # ignored by the fit
    fit = bench.fit_efficiencies(config, cells, peak)
    assert fit == pytest.approx({"dense_efficiency": 0.6, "attention_efficiency": 0.3})
    assert bench.fit_efficiencies(config, cells[:1], peak) is None  # one length: no fit


@pytest.mark.parametrize(("argv", "message"), [
    (["--lengths", "2k"], "'2k'"),
    (["--lengths", "64", "--tokens", "32"], "--tokens=32"),
    (["--backends", "magic"], "magic"),
    (["--steps", "0"], "--steps must be >= 1, got 0"),
])
def test_bad_arguments_name_the_value(bench, argv, message) -> None:
    with pytest.raises(SystemExit, match=message):
        bench.main(["--device", "cpu", "--preset", "tiny", *argv])
