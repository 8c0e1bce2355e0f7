"""The memory estimator for a pipeline stage (tools/memory_pipeline.py): the real step's pp path under
FakeTensorMode on 4 fake ranks, next to the cost model's per-stage prediction."""

from __future__ import annotations

import pytest
from helpers import SMALLISH

from lightning_hotspa.layout import Layout, LayoutError
from lightning_hotspa.planner.cost.cost_model import AnalyticCostModel
from lightning_hotspa.tools.memory import CHUNK_KERNEL
from lightning_hotspa.tools.memory_pipeline import estimate_pipeline_stage, stage_prediction, stage_rank


def test_stage_rank_is_the_lowest_rank_of_the_stage_and_bad_stages_are_named():
    assert [stage_rank(Layout.parse("tp2xpp2"), 4, s) for s in (0, 1)] == [0, 2]
    assert [stage_rank(Layout.parse("pp4"), 4, s) for s in range(4)] == [0, 1, 2, 3]
    with pytest.raises(LayoutError, match="stage 2 is not one of its 2 pipeline stages"):
        stage_rank(Layout.parse("dp2xpp2"), 4, 2)
    with pytest.raises(LayoutError, match="layout dp4 is not pipelined"):
        estimate_pipeline_stage(SMALLISH, 4, "dp4", 256)


def test_each_stage_holds_its_own_parameters_and_agrees_with_the_model():
    """tp2xpp2, 1024 tokens per micro-batch, 1F1B's steady state (4 micro-batches): the first stage holds 2
    micro-batches' activations, the last 1 and the loss head's; each stage's peak within 5 % of its
    prediction."""
    layout = Layout.parse("tp2xpp2")
    cm = AnalyticCostModel(SMALLISH, "H100", 4, chunk_kernel=CHUNK_KERNEL["cpu"])
    first, last = (estimate_pipeline_stage(SMALLISH, 4, layout, 1024, stage=s) for s in (0, 1))
    assert (first["rank"], last["rank"], first["micro_batches"]) == (0, 2, 4)
    full_working = SMALLISH.num_params() * 2 / layout.tp  # bf16, every layer
    for got in (first, last):  # its own stage's layers only (+ the embedding or the head)
        assert got["working_params_peak"] < 0.75 * full_working, (got["working_params_peak"], full_working)
    assert first["peak"]["activations"] > last["peak"]["activations"]
    for s, got in enumerate((first, last)):
        predicted = stage_prediction(cm, layout, False, 1024, s)
        assert abs(got["peak_bytes"] / predicted - 1) < 0.05, (s, got["peak"], predicted)


def test_a_stage_peak_does_not_grow_with_the_micro_batch_count():
    """The runtime allocates a receive buffer at its receive and drops it after its micro-batch's backward
    (parallel/pipeline.py): torch's own stage keeps every micro-batch's activation and gradient buffers for
    the schedule's life, so the first stage's peak grew by a gradient buffer per micro-batch (and the last
    stage's by an activation buffer)."""
    layout = Layout.parse("tp2xpp2")
    boundary = 512 // layout.tp * SMALLISH.hidden * 2  # one received activation or gradient (bf16)
    for stage in (0, 1):
        four, eight = (estimate_pipeline_stage(SMALLISH, 4, layout, 512, stage=stage, micro_batches=m)["peak_bytes"]
                       for m in (4, 8))
        # only the step's per-micro-batch index and loss weight grow (a few bytes each)
        assert 0 <= eight - four < boundary / 100, (stage, four, eight, boundary)
    with pytest.raises(ValueError, match="micro_batches=0"):
        estimate_pipeline_stage(SMALLISH, 4, layout, 512, micro_batches=0)
