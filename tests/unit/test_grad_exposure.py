"""The gradient reduction priced as it runs: the model's exposed share against the fake world's count."""

from __future__ import annotations

import dataclasses

import pytest

from lightning_hotspa.engine.buckets import MB, bucket_defaults
from lightning_hotspa.layout import Layout
from lightning_hotspa.model_shape import describe_model
from lightning_hotspa.models import LlamaConfig
from lightning_hotspa.planner.cost.cost_model import AnalyticCostModel
from lightning_hotspa.planner.cost.grad_exposure import (
    REDUCE_BUCKET_BYTES,
    exposed_seconds,
    exposed_share,
    reduce_buckets,
)
from lightning_hotspa.planner.cost.runtime_profile import HOTSPA
from lightning_hotspa.tools.reduce_exposure import measure_reduce_buckets


def test_bucket_sizes_are_the_runtimes():
    assert REDUCE_BUCKET_BYTES["cpu"] == bucket_defaults("gloo").bucket_mb * MB
    assert REDUCE_BUCKET_BYTES["cuda"] == bucket_defaults("nccl").bucket_mb * MB


def test_exposed_seconds_by_hand():
    # two buckets of 1 s: the first ready with half of 2 s of backward left, the second at its end
    assert exposed_seconds([1.0, 1.0], [0.5, 0.0], 2.0) == pytest.approx(1.0)
    assert exposed_seconds([1.0, 1.0], [0.5, 0.0], 0.0) == pytest.approx(2.0)  # nothing hides
    assert exposed_seconds([3.0, 1.0], [0.5, 0.0], 2.0) == pytest.approx(3.0)  # the network is the bottleneck


@pytest.mark.parametrize("layout", ["dp8", "dp4xtp2", "dp2xtp4"])
def test_model_agrees_with_the_fake_world(layout):
    """Each bucket's bytes and the backward GEMM work left when it launches, on the real code path
    (8 fake ranks, llama7b's widths, 3 layers, NCCL's 100 MiB buckets), against the model's; and the
    exposed share for a backward of 1/2, 1, 2 and 100 x the reduction's seconds."""
    config = dataclasses.replace(LlamaConfig.preset("llama7b"), n_layers=3)
    par = Layout.parse(layout)
    measured = measure_reduce_buckets(config, par, 8)
    model = reduce_buckets(describe_model(config), par.tp, REDUCE_BUCKET_BYTES["cuda"])
    assert measured["at_end"] == 0  # every bucket launched from the backward's hooks
    real = [b for b in measured["buckets"] if b[0] > 2**20]  # the norms' own bucket under tp: a few KiB
    assert [round(b / 2**20) for b, _ in real] == [round(b / 2**20) for b, _ in model if b > 2**20]
    for hide in (0.5, 1.0, 2.0, 100.0):
        assert exposed_share(model, hide) == pytest.approx(exposed_share(measured["buckets"], hide), abs=2e-3)
    # what no backward hides: at least the embedding's bucket, launched with no GEMM left
    assert exposed_share(model, 100.0) >= model[-1][0] / sum(b for b, _ in model)


def test_cost_model_prices_only_the_exposed_part():
    par = Layout.parse("dp8xtp8")
    ours = AnalyticCostModel("llama3-8b", "H100", 64)
    exposed, full = ours.grad_reduce_seconds(par), ours.grad_reduce_full_seconds(par)
    assert 0 < exposed < 0.5 * full
    assert ours.option(par, False).stage_fixed == exposed
    # a runtime that does not overlap it pays all of it; so does cpu-gloo, where nothing hides
    waits = AnalyticCostModel("llama3-8b", "H100", 64, runtime=dataclasses.replace(HOTSPA, dp_reduce_overlap=False))
    assert waits.grad_reduce_seconds(par) == full
    cpu = AnalyticCostModel("tiny", "cpu-gloo", 4)
    assert cpu.grad_reduce_seconds(Layout.parse("dp4")) == cpu.grad_reduce_full_seconds(Layout.parse("dp4"))
    # a sharded copy reduce-scatters per unit (priced in the micro-batch), its HSDP replicas at the stage end
    hsdp = Layout.parse("dp16xtp2:fsdp8")
    assert ours.grad_reduce_seconds(hsdp) == ours.grad_reduce_full_seconds(hsdp) > 0
