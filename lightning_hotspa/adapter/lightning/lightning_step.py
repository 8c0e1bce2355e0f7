"""Lightning's side of one training step: what the strategy adds around the engine's step runner.

Lightning calls ``strategy.training_step`` once per batch; inside, the runner runs every
micro-batch. The user's ``training_step`` is the loss callable, and the backward hooks Lightning
would call around its own backward (``on_before_backward`` / ``on_after_backward``, callbacks then
the module) are called here around each micro-batch's backward, with the scaled loss.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Mapping
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor

from ...engine.records import StepResult
from ...engine.step_runner import StepHooks
from ...group_collectives import world_collectives
from ...layout import Layout, LayoutError
from ...plan import RankPlan, RankStage
from ..observability.stats import block_metrics, stage_doc_tokens, step_metrics
from .lightning_compat import accumulates, call_callback_hooks, call_module_hook, forget_logged, trainer_results
from .reliability import StepTracker

__all__ = ["LightningStepHooks", "as_scalar_loss", "check_trainer", "open_breadcrumbs", "plain_plan", "run_eval_step",
           "run_training_step"]


class LightningStepHooks(StepHooks):
    """Breadcrumbs, the precision plugin's context and Lightning's backward hooks."""

    def __init__(self, trainer: Any, module: Any, tracker: StepTracker, precision: Any) -> None:
        self.trainer, self.module, self.tracker, self.precision = trainer, module, tracker, precision

    def enter_stage(self, stage: Any) -> None:
        self.tracker.enter_stage(stage)

    def enter_micro_batch(self, micro_batch: Any) -> None:
        self.tracker.enter_micro_batch()

    def enter_phase(self, phase: str) -> None:
        self.tracker.enter_phase(phase)

    def compute_context(self) -> contextlib.AbstractContextManager:
        return self.precision.train_step_context()

    def record_loss(self, loss: Tensor, micro_batch: Any) -> None:
        self.tracker.record_loss(loss, micro_batch)

    def backward(self, scaled_loss: Tensor) -> None:
        call_callback_hooks(self.trainer, "on_before_backward", scaled_loss)
        call_module_hook(self.trainer, "on_before_backward", scaled_loss)
        self.module.backward(scaled_loss)
        call_callback_hooks(self.trainer, "on_after_backward")
        call_module_hook(self.trainer, "on_after_backward")


def as_scalar_loss(loss: Any, module: Any) -> Tensor:
    """What ``training_step`` returned (a tensor or ``{"loss": tensor}``) as a 0-d loss with a graph."""
    if isinstance(loss, Mapping):
        loss = loss.get("loss")
    if not isinstance(loss, Tensor) or loss.numel() != 1 or not loss.requires_grad:
        what = type(loss).__name__ if not isinstance(loss, Tensor) else f"a tensor of shape {tuple(loss.shape)}" + (
            "" if loss.requires_grad else " without grad")
        raise ValueError(f"{type(module).__name__}.training_step must return a scalar loss tensor with a graph "
                         f"(the mean over its micro-batch's target tokens); got {what}")
    return loss.reshape(())  # finiteness is checked once per step, on every rank alike (the runner)


def plain_plan(batch: Any, layout: Layout, device: torch.device, activation_checkpointing: bool) -> RankPlan:
    """An ordinary batch: one stage in the default layout; loss weighted by this rank's target
    tokens if the batch says how many it has, else averaged over ranks as DDP does."""
    if layout.tp > 1 or layout.cp > 1:
        raise LayoutError(f"plain batches of type {type(batch).__name__} need a pure data-parallel "
                          f"default layout, but it is {layout}; feed RankPlans from HotSPaDataModule")
    tokens = getattr(batch, "num_target_tokens", None)
    if tokens is not None:
        total = torch.tensor([float(tokens)], device=device)
        world_collectives().all_reduce(total)
        global_tokens = int(total.item())
    else:
        global_tokens = -1
    return RankPlan(-1, (RankStage(layout, (batch,), activation_checkpointing),), global_tokens, {"plain": True})


def check_trainer(trainer: Any, module: Any, owner: str) -> None:
    """What a step plan per optimizer step rules out."""
    if not module.automatic_optimization:
        raise ValueError(f"{owner} needs automatic optimization; "
                         f"{type(module).__name__}.automatic_optimization is False")
    clip = getattr(trainer, "gradient_clip_val", None)
    if clip is not None and (isinstance(clip, bool) or not isinstance(clip, (int, float)) or not 0 <= clip < math.inf):
        raise ValueError(f"Trainer(gradient_clip_val={clip!r}): must be a finite number >= 0, or 0 / None for no "
                         f"clipping (Lightning skips clipping for a negative value without a word)")


def open_breadcrumbs(tracker: StepTracker, directory: Any, backend: str | None, trainer: Any, rank: int) -> None:
    """The per-rank breadcrumb file: where asked, and by default on NCCL (whose watchdog aborts
    the process without a Python error)."""
    if directory is None and backend and "nccl" in backend:
        directory = os.path.join(trainer.default_root_dir, "hotspa_breadcrumbs")
    if directory is not None and tracker.path is None:
        path = tracker.open_file(directory, rank)
        rank_zero_info(f"hotspa: each rank's position in the step is kept in {path.parent}")


def run_training_step(strategy: Any, batch: Any, batch_idx: int) -> tuple[StepResult, dict[str, float]]:
    """One Lightning batch through the strategy's step runner: the user's ``training_step`` is the
    loss callable; then the profiled planner's feedback and the step's metrics, logged on rank 0.
    Returns the step's records and its metrics."""
    module, layout = strategy.lightning_module, strategy.default_layout
    plan = batch if isinstance(batch, RankPlan) else plain_plan(
        batch, layout, strategy.root_device, strategy.activation_checkpointing_for(layout))
    hooks = LightningStepHooks(module.trainer, module, strategy.tracker, strategy.precision_plugin)
    results = trainer_results(module.trainer)
    forget_logged(results, "hotspa/")  # a stage that does not run in this step must log nothing

    def loss_of(mb: Any) -> Tensor:
        loss = as_scalar_loss(module.training_step(mb, batch_idx), module)
        strategy.metric_sync.after_micro_batch(results)
        return loss

    scale, carry_out = 1.0, False
    if module.trainer.accumulate_grad_batches > 1:  # this batch's share of the window; sum before reducing
        scale = strategy.accumulation.scale(plan.global_target_tokens, module.trainer.accumulate_grad_batches)
        carry_out = accumulates(module.trainer)
    with strategy.metric_sync.step(results):
        result = strategy.runner.run(plan, loss_of, hooks, on_nonfinite=strategy.nonfinite, scale=scale,
                                     carry_out=carry_out)
    strategy.metric_sync.finish(results, strategy.reduce, strategy.root_device)
    global_plan = plan.extras.get("global_plan")
    metrics = step_metrics(result.records, stage_doc_tokens(global_plan, len(plan.stages)), result.between_s)
    metrics.update(block_metrics(result.records, global_plan, result.table, strategy.mesh_shape))
    if result.skip_update:
        metrics["hotspa/skipped_steps"] = float(len(strategy.nonfinite.skipped_steps))
    if strategy.built_planner is not None:
        strategy.profiling.after_step(strategy.built_planner, plan, result)
    if metrics and not plan.extras.get("plain"):
        module.log_dict(metrics, on_step=True, on_epoch=False, sync_dist=False, rank_zero_only=True, batch_size=1)
    return result, metrics


# Lightning's Precision names its per-hook contexts differently from the hooks themselves
_EVAL_CONTEXTS = {"validation_step": "val_step_context", "test_step": "test_step_context",
                  "predict_step": "predict_step_context"}


def run_eval_step(strategy: Any, hook: str, args: tuple, kwargs: dict) -> Any:
    """``validation_step`` / ``test_step`` / ``predict_step`` of every micro-batch, each stage in its
    layout (a plain batch in the default layout, which must then be pure data parallel). Returns the
    last output, except for ``predict_step`` of a step plan: every micro-batch's output, in document
    order (by each micro-batch's first document), with a vocab-parallel head's logits gathered."""
    trainer = getattr(strategy.lightning_module, "_trainer", None)
    strategy.tracker.between_steps(hook, trainer.global_step if trainer is not None else -1)
    batch, rest = args[0], args[1:]
    layout = strategy.default_layout
    if not isinstance(batch, RankPlan) and (layout.tp > 1 or layout.cp > 1):
        raise LayoutError(f"plain batches need a pure data-parallel default layout, got {layout}")
    plan = batch if isinstance(batch, RankPlan) else RankPlan(-1, (RankStage(layout, (batch,)),), -1)
    fn = getattr(strategy.lightning_module, hook)
    results = trainer_results(trainer)
    outputs: list[tuple[int, int, Any]] = []

    def output_of(mb: Any) -> Any:
        output = fn(mb, *rest, **kwargs)
        strategy.metric_sync.after_micro_batch(results)
        doc_ids = getattr(mb, "doc_ids", ())
        outputs.append((min(doc_ids) if doc_ids else -1, len(outputs), output))
        return output

    predicting = hook == "predict_step"
    with strategy.tracker.guard():
        with strategy.metric_sync.step(results), \
                (strategy.parallel.full_logits() if predicting else contextlib.nullcontext()):
            output = strategy.runner.run_forward(plan, output_of,
                                                 getattr(strategy.precision_plugin, _EVAL_CONTEXTS[hook]))
        strategy.metric_sync.finish(results, strategy.reduce, strategy.root_device)
    if predicting and isinstance(batch, RankPlan):
        return [o for _, _, o in sorted(outputs, key=lambda t: (t[0], t[1]))]
    return output
