"""The timeline picture of a block stage: one lane per block (adapter/observability/timeline_png.py)."""

from __future__ import annotations

import numpy as np
import pytest

from lightning_hotspa.adapter.observability.timeline_png import block_lanes, draw_timeline, lane_timings
from lightning_hotspa.layout import Layout, MeshShape
from lightning_hotspa.plan import Block, Stage, StepPlan, block_dp_groups

pytestmark = pytest.mark.fast


def _plan_and_mesh():
    layouts = [Layout.parse(x) for x in ("dp4", "dp2xcp2:kv", "dp2xcp2:kv:fsdp2")]
    mesh = MeshShape.for_layouts(layouts, 4)
    cp2, dp4 = layouts[1], layouts[0]
    blocks = (Block(cp2, block_dp_groups(cp2, mesh, (0, 1)), (((0,),),), sharded=True),
              Block(dp4, block_dp_groups(dp4, mesh, (2, 3)), (((1,), (2,)), ((3,),))))
    plan = StepPlan(0, (40, 8, 9, 7), (Stage(cp2, (), blocks=blocks),))
    return plan, mesh


def test_a_block_stage_draws_one_lane_per_block(tmp_path):
    plan, mesh = _plan_and_mesh()
    lanes = block_lanes(plan, mesh)
    assert [ranks for _, ranks in lanes] == [(0, 1), (2, 3)]
    assert lanes[0][0] == "block 0: ranks 0-1 dp2xcp2:kv sharded" and "replicated" in lanes[1][0]
    timings = np.zeros((4, 1, 3))
    timings[:, 0, 1] = [1.0, 1.2, 0.5, 0.7]  # compute seconds per rank
    timings[:, 0, 2] = 0.1
    per_lane = lane_timings(timings, lanes)
    assert per_lane.shape == (2, 1, 3) and per_lane[:, 0, 1].tolist() == [1.2, 0.7]  # each block's slowest rank
    path = draw_timeline(timings, ["blocks"], [""], tmp_path / "t.png", step=3, lanes=lanes)
    assert path.exists() and path.stat().st_size > 0
    assert block_lanes(StepPlan(0, (4,), (Stage(Layout.parse("dp4"), (((0,),), (), (), ())),)), mesh) == []
