"""One rank's step plan, executed: the only place the step loop is written.

Per stage: switch the working parameters to the stage's layout (keeping the working gradients when
the previous stage had the same tp degree), run every micro-batch's forward and backward through
the caller's loss callable with the loss scaled to the global token mean
(``num_target_tokens / global_target_tokens``), and at the stage end reduce the working gradients
into the switch engine's store, except when the next stage shares gradients with this one: such a
run accumulates into the same ``.grad`` and reduces once, at its last stage; ``carry_out`` extends
such a run into the next :meth:`StepRunner.run` (gradient accumulation over Lightning batches: the
working copy and its unreduced gradients outlive the call, as DDP's ``no_sync``). The reduction of the
last backward of a reducing stage starts while that backward runs
(:meth:`SwitchEngine.overlap_next_backward`). Then the step's one small collective gathers every
rank's loss and stage numbers (:func:`.records.gather_step`), and a non-finite global loss goes to
the caller's policy (a callable: the engine does not know what "stop" or "skip" mean).

One kind of stage: every stage is entered with every rank's working layout
(``RankStage.working_layouts``; :meth:`SwitchEngine.enter_stage`), computes in this rank's compute
layout, and ends with :meth:`SwitchEngine.reduce_stage`. What differs is data, decided alike on
every rank from the global plan: one layout on every rank (a uniform stage, a legacy mixed-cp
stage) switches and may share gradients with its neighbour; a block stage (each block its own copy,
sharded over its ranks or replicated; docs/DESIGN.md §4, "Blocks") materializes every rank's copy
from home and ends with the joint reduction, never sharing.

The runner knows no Lightning: the strategy, the CLI's calibration and the benchmark recipes all
call it, each adding what it needs through :class:`StepHooks` (Lightning's backward hooks, the
precision context, breadcrumbs, a barrier before timing).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from ..layout import Layout
from ..parallel.model import ParallelModel
from ..plan import MicroBatch, RankPlan, idle_micro_batch
from .fsdp import ShardedUnits
from .records import StageStats, StepResult, gather_step
from .switch import GradReport, SwitchEngine, SwitchReport
from .timing import Clock, clock_for, cpu_seconds

__all__ = ["LossFn", "NonFinitePolicy", "StepHooks", "StepRunner", "loss_weight"]

#: one micro-batch -> its scalar loss (the mean over its target tokens), with a graph
LossFn = Callable[[Any], Tensor]
#: (global loss, plan) -> True to drop the step's update; may raise instead
NonFinitePolicy = Callable[[Tensor, RankPlan], bool]


class StepHooks:
    """What a caller adds around the loop; every method defaults to doing nothing special."""

    def enter_stage(self, stage: Any) -> None:
        """A stage begins (before its switch)."""

    def enter_micro_batch(self, micro_batch: Any) -> None:
        """A micro-batch's forward begins."""

    def enter_phase(self, phase: str) -> None:
        """``"reduce"`` (a stage's gradient reduction) or ``"metrics"`` (the step's gather)."""

    def before_compute(self, stage: Any) -> None:
        """The stage's layout is active and its micro-batches are about to run (e.g. a barrier)."""

    def compute_context(self) -> contextlib.AbstractContextManager:
        """Entered around each micro-batch's forward (e.g. an autocast context)."""
        return contextlib.nullcontext()

    def record_loss(self, loss: Tensor, micro_batch: Any) -> None:
        """The micro-batch's unscaled loss, before its backward."""

    def backward(self, scaled_loss: Tensor) -> None:
        """Back-propagate the scaled loss."""
        scaled_loss.backward()


def loss_weight(micro_batch: Any, plan: RankPlan, layout: Layout) -> float:
    """This micro-batch's share of the global token-mean loss: its target tokens over the step's.
    A plan without token counts (``global_target_tokens < 0``) averages over the dp ranks, as DDP."""
    if plan.global_target_tokens < 0:
        return 1.0 / layout.dp
    if plan.global_target_tokens == 0:
        return 0.0
    return micro_batch.num_target_tokens / plan.global_target_tokens


class StepRunner:
    """Executes one rank's :class:`RankPlan` with a :class:`SwitchEngine` and a :class:`ParallelModel`.

    Args:
        activation_checkpointing: per layout, what its stages recompute (a :class:`Checkpointing` mode or bool; a
            stage's own flag also turns it on).
        clock: the seam stage seconds are read from (default: the device's own, :func:`clock_for`).
        cpu_clock: this process' CPU seconds, kept beside the device seconds.
        overlap: start a stage's gradient reduction during its last backward.
        share_gradients: let a run of same-tp stages accumulate and reduce once (else every
            stage reduces at its end).
        fsdp_reduce_dtype: the dtype fsdp units reduce-scatter their gradients in (None: fp32;
            ``torch.bfloat16`` halves the bytes, summing in bf16).
        pipeline_schedule: the schedule of pp layouts' stages (:data:`..parallel.pipeline.SCHEDULES`).
        pipeline_virtual: pipeline stages per rank (None: the schedule's default, 2 if interleaved).
    """

    def __init__(self, engine: SwitchEngine, parallel: ParallelModel, *, device: torch.device | str = "cpu",
                 activation_checkpointing: Callable[[Layout], Any] | None = None, clock: Clock | None = None,
                 cpu_clock: Callable[[], float] = cpu_seconds, overlap: bool = True,
                 share_gradients: bool = True, fsdp_reduce_dtype: torch.dtype | None = None,
                 pipeline_schedule: str = "1f1b", pipeline_virtual: int | None = None) -> None:
        self.engine, self.parallel = engine, parallel
        self.device = torch.device(device)
        self.activation_checkpointing = activation_checkpointing or (lambda layout: False)
        self.clock = clock if clock is not None else clock_for(self.device)
        self.cpu_clock = cpu_clock
        self.overlap, self.share_gradients = overlap, share_gradients
        #: the model's fsdp units, when some layout shards its working copy (:mod:`.fsdp`)
        self.units = ShardedUnits(engine, parallel.module, reduce_dtype=fsdp_reduce_dtype) \
            if any(x.fsdp for x in engine.world.layouts) else None
        #: the working layouts of a stage whose gradients the last run left unreduced (``carry_out``)
        self.carried: tuple[Layout, ...] | None = None
        #: pp layouts' stages and schedules (:mod:`..parallel.pipeline`); None: no pp layout
        self.pipeline = None
        if any(x.pp > 1 for x in engine.world.layouts):
            from ..parallel.pipeline import PipelineRunner

            self.pipeline = PipelineRunner(parallel, pipeline_schedule, pipeline_virtual, self.device)
            world = engine.world

            def owned(layout: Layout, rank: int) -> frozenset[str]:  # a stage's index is its rank's pp slot
                ranks = world.shape.group_ranks(rank, tuple(world.shape.pp_dims(layout)))
                return self.pipeline.owned(layout, sorted(ranks).index(rank))

            engine.pipeline_owned = owned

    def _prefetch(self) -> contextlib.AbstractContextManager:
        """A forward's context: fsdp units prefetch the next unit's gather (:mod:`.fsdp`)."""
        return self.units.forward_prefetch() if self.units is not None else contextlib.nullcontext()

    def _fsdp_bytes(self) -> int:
        return sum(self.units.bytes.values()) if self.units is not None else 0

    @staticmethod
    def _order(stage: Any, rounds: int) -> list[int]:
        """The order a stage's micro-batches run in: a replicated copy runs the plan's first (the
        solver's costliest) micro-batch LAST, so the backward that hides the gradient reduction
        (:meth:`SwitchEngine.overlap_next_backward`) is the longest the stage has, as the cost model
        prices it (``planner/cost/grad_exposure.py``); a sharded copy keeps the plan's order (its idle
        and lockstep rounds follow it)."""
        if stage.compute_layout.fsdp or rounds != len(stage.micro_batches) or rounds < 2:
            return list(range(rounds))
        return [*range(1, rounds), 0]

    def _idle(self, layout: Layout) -> MicroBatch:
        """The micro-batch of an idle round (fsdp stages: fewer micro-batches than the busiest group),
        cp-sliced for ``layout``, the stage's compute layout on this rank."""
        cp_rank = self.engine.world.shape.rank_coords(layout, self.engine.world.rank)[2]
        return idle_micro_batch(layout.cp, cp_rank, layout.tp).to(self.device)

    def enter(self, stage: Any, keep_grads: bool = False) -> SwitchReport:
        """The working copy of ``stage``: every rank's working layout (:meth:`SwitchEngine.enter_stage`:
        a switch when it is one layout everywhere, each block's own copy from home otherwise)."""
        return self.engine.enter_stage(stage.working_layouts, keep_grads=keep_grads)

    def flush(self) -> None:
        """Reduces gradients a run left unreduced (``carry_out``) into the engine's store and drops
        that working copy; nothing if none is carried."""
        if self.carried is not None:
            self.carried = None
            try:
                self.engine.reduce_stage()
            finally:
                self.engine.release()

    def run(self, plan: RankPlan, loss_fn: LossFn, hooks: StepHooks | None = None, *,
            on_nonfinite: NonFinitePolicy | None = None, scale: float = 1.0, carry_out: bool = False) -> StepResult:
        """Forward/backward of every micro-batch of ``plan``, gradients reduced into the engine's
        store (added to what it holds); the working parameters are dropped and the home ones restored
        at the end (also on error).

        Args:
            plan: this rank's step plan.
            loss_fn: one micro-batch -> its scalar token-mean loss.
            hooks: the caller's additions around the loop.
            on_nonfinite: the policy for a non-finite global loss.
            scale: a factor on every micro-batch's loss weight (gradient accumulation: this plan's
                share of the optimizer step's window); the reported loss stays the plan's own.
            carry_out: leave the last stage's working gradients unreduced (and its working copy
                alive) for the next run, which accumulates into them if its first stage shares
                gradients with it (else reduces them first); a block stage reduces anyway.
        """
        hooks = hooks or StepHooks()
        engine, parallel, clock = self.engine, self.parallel, self.clock
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        marks: list[tuple[Any, Any, Any, Any]] = []
        parts: list[tuple[SwitchReport, GradReport, float, bool, int]] = []
        # the previous stage (or run) left its working gradients unreduced for this one; the same
        # decision on every rank: every rank's working layouts are the global plan's
        carry = self.carried is not None and bool(plan.stages) and self.share_gradients and \
            engine.stages_share_gradients(self.carried, plan.stages[0].working_layouts)
        kept = False  # this run leaves its last stage's working copy and gradients to the next
        start = clock.mark()  # the step's start: the first stage's before_s runs from here
        try:
            if not carry:
                self.flush()
            self.carried = None
            for k, stage in enumerate(plan.stages):
                hooks.enter_stage(stage)
                t0 = clock.mark()
                report = self.enter(stage, keep_grads=carry)
                nxt = plan.stages[k + 1] if k + 1 < len(plan.stages) else None
                if nxt is not None:
                    carry = self.share_gradients and \
                        engine.stages_share_gradients(stage.working_layouts, nxt.working_layouts)
                else:
                    carry = carry_out and self.share_gradients and len(set(stage.working_layouts)) == 1
                # ac follows this rank's working copy's layout (one copy for every block of a mixed-cp
                # stage, so every rank's backward gathers alike; a block's own) and the plan's mode
                ac = stage.activation_checkpointing.stronger(
                    self.activation_checkpointing(stage.working_layout(engine.world.rank)))
                parallel.activate(stage.compute_layout, engine.working, ac)
                hooks.before_compute(stage)
                t1, c1 = clock.mark(), self.cpu_clock()
                fsdp_start = self._fsdp_bytes()
                real = len(stage.micro_batches)
                rounds = 0 if stage.compute_layout.pp > 1 else stage.num_rounds
                if stage.compute_layout.pp > 1:  # torch's schedule runs every micro-batch's forward and backward
                    loss_sum += self._run_pipeline(stage, plan, scale, hooks)
                idle = self._idle(stage.compute_layout) if rounds > real else None  # built once per stage
                for n, i in enumerate(self._order(stage, rounds)):
                    mb = stage.micro_batches[i] if i < real else idle
                    if i < real:
                        hooks.enter_micro_batch(mb)
                    with parallel.micro_batch(mb if isinstance(mb, MicroBatch) else None), hooks.compute_context(), \
                            self._prefetch():
                        loss = loss_fn(mb)
                    if i < real:
                        hooks.record_loss(loss, mb)
                    weight = loss_weight(mb, plan, stage.compute_layout) if i < real else 0.0
                    scaled = loss * (weight * scale)
                    if self.overlap and n == rounds - 1 and not carry:
                        engine.overlap_next_backward()  # reduce buckets while the last backward runs
                    if i < real:
                        hooks.backward(scaled)
                        own = scaled if scale == 1.0 else loss * weight  # the plan's own loss share
                        loss_sum += own.detach().double() / stage.compute_layout.tp  # tp ranks hold copies
                    else:  # an idle round: its collectives only (zero gradients)
                        scaled.backward()
                    if self.units is not None:  # fsdp: a backward re-gather no unit consumed
                        self.units.end_backward()
                t2, cpu_s = clock.mark(), self.cpu_clock() - c1
                fsdp_end = self._fsdp_bytes()
                if carry:  # same tp next: keep accumulating, the run's last stage reduces once
                    grad_report = GradReport(stage.layout, 0, 0, 0.0)
                else:  # a block copy's joint exchange (the next stage's copy comes from home) or the layout's
                    hooks.enter_phase("reduce")
                    grad_report = engine.reduce_stage()
                marks.append((t0, t1, t2, t2 if carry else clock.mark()))
                parts.append((report, grad_report, cpu_s, ac, fsdp_end - fsdp_start))
            kept = carry
        finally:
            parallel.restore(engine.home)
            if kept:
                self.carried = plan.stages[-1].working_layouts
            else:
                engine.release()
        stats = []
        ends = [start, *(m[3] for m in marks)]  # each stage's before_s: from the previous stage's end
        for k, (stage, (t0, t1, t2, t3), (report, grad_report, cpu_s, ac, fsdp)) in enumerate(
                zip(plan.stages, marks, parts)):
            stats.append(StageStats.measure(
                stage, report, grad_report, order=k, switch_s=clock.seconds(t0, t1), compute_s=clock.seconds(t1, t2),
                reduce_s=clock.seconds(t2, t3), compute_cpu_s=cpu_s, activation_checkpointing=ac,
                fsdp_bytes=fsdp, before_s=clock.seconds(ends[k], t0)))
        hooks.enter_phase("metrics")  # the one small collective of the step
        loss, records, table = gather_step(loss_sum, stats, self.device, plan.step)
        finite = bool(torch.isfinite(loss))
        skip = False
        if not finite and on_nonfinite is not None:
            engine.clear_grad_store()
            skip = bool(on_nonfinite(loss, plan))
        return StepResult(plan.step, loss, tuple(stats), records, table, finite, skip)

    def _run_pipeline(self, stage: Any, plan: RankPlan, scale: float, hooks: StepHooks) -> Tensor:
        """A pp stage's micro-batches through the pipeline schedule; this rank's share of the plan's loss."""
        layout = stage.compute_layout
        weights = [loss_weight(mb, plan, layout) * scale for mb in stage.micro_batches]
        for mb in stage.micro_batches:
            hooks.enter_micro_batch(mb)
        with hooks.compute_context():
            own = self.pipeline.run(layout, stage.micro_batches, weights, record=hooks.record_loss)
        return (own / scale if scale else own * 0) / layout.tp  # tp ranks hold copies of one loss

    def run_forward(self, plan: RankPlan, fn: Callable[[Any], Any],
                    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext) -> Any:
        """Evaluation: ``fn`` on every micro-batch of every stage in its layout, no gradients
        reduced; returns the last output."""
        output = None
        self.flush()  # an evaluation inside an accumulation window: what was carried goes to the store
        try:
            for stage in plan.stages:
                if stage.compute_layout.pp > 1:
                    from ..layout import LayoutError

                    raise LayoutError(f"evaluation (run_forward) in the pipelined layout {stage.compute_layout} is "
                                      f"not built; evaluate in a layout without pp")
                self.enter(stage)
                self.parallel.activate(stage.compute_layout, self.engine.working)
                for mb in stage.micro_batches:
                    with self.parallel.micro_batch(mb if isinstance(mb, MicroBatch) else None), context(), \
                            self._prefetch():
                        output = fn(mb)
                for _ in range(stage.num_rounds - len(stage.micro_batches)):
                    self.units.idle_forward()  # fsdp: the busier dp groups' gathers
        finally:
            self.parallel.restore(self.engine.home)
            self.engine.release()
        return output
