"""Issue 53's probes on 4 gloo ranks: a probe plan the measured planner builds (a slice of the batch under a
never-run layout, the rest under the reference static) trains like the single process."""

from __future__ import annotations

import numpy as np
from helpers import LENGTHS, check_against_single_process, fit_and_compare

from lightning_hotspa.plan import StepPlan
from lightning_hotspa.planner.profiled.measured_planner import MeasuredCostPlanner
from lightning_hotspa.planner.solve.plan_stages import plain_stage

PROBE_LAYOUTS = ["dp2xcp2", "cp4", "dp2xtp2"]


def probe_plans() -> list[StepPlan]:
    """Per batch of :data:`helpers.LENGTHS`, the probe of one never-run layout against dp2xcp2."""
    planner = MeasuredCostPlanner(PROBE_LAYOUTS, model="tiny", world_size=4, hardware="cpu-gloo", ladder=False,
                                  mixed_rounds=False, activation_checkpointing="none")
    plans = []
    for step, (lengths, probed) in enumerate(zip(LENGTHS, ["cp4", "dp2xtp2", "cp4"])):
        arr = np.asarray(lengths)
        _, _, stages = next(x for x in planner.candidates(arr, None, "dp2xcp2", {}) if x[0].name == probed)
        plans.append(StepPlan(step, tuple(lengths), tuple(plain_stage(o, g, arr) for o, g in stages)))
    return plans


def test_probe_plans_slice_the_batch_under_the_probed_layout():
    for plan, probed in zip(probe_plans(), ["cp4", "dp2xtp2", "cp4"]):
        assert [s.layout.name for s in plan.stages] == ["dp2xcp2", probed]
        docs = [sorted(d for g in s.micro_batches for mb in g for d in mb) for s in plan.stages]
        assert sorted(docs[0] + docs[1]) == list(range(len(plan.doc_lengths)))
        assert 1 <= len(docs[1]) <= len(plan.doc_lengths) // 8 + 1


def run_probe_plans():
    return fit_and_compare(PROBE_LAYOUTS, len(LENGTHS), plans=probe_plans())


def test_probe_plans_match_the_single_process_on_4_ranks(ranks):
    """The invariant for probe plans: per step the gradients equal the single process's from the same
    weights at 1e-5 (fp32), the losses too, and the weights after the 3 steps at 1e-4."""
    check_against_single_process(ranks(4).run(run_probe_plans)[0], len(LENGTHS), 1e-5, 1e-5, 1e-4)
