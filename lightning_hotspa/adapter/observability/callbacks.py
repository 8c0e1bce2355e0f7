"""Lightning callbacks that make a HotSPa run legible: per-bucket metrics, plan tables, timelines,
the current plan in the progress bar, and a summary table at the end.

``HotSPaStrategy`` already logs the measured numbers of every stage (``hotspa/<stage>/...``, one small
all-gather per step) and keeps them as typed records (``strategy.last_step``, a :class:`StepResult`:
every rank's stage numbers, the same on every rank). :class:`HotSPaMonitor` adds what needs the
model or the plan: model FLOPs and MFU, the cost model's predicted time next to the measured one,
the exact step loss, the step plan as a table, and a timeline picture; the plan is the one the
step ran (``batch.extras["global_plan"]``), never re-derived. Everything scalar goes through
``LightningModule.log_dict``, so every logger (W&B, CSV, ...) gets the same numbers; tables and
images go to W&B when it is a logger and to files in ``output_dir`` always. All of it runs on rank 0
and needs no communication. The strategy is read as a :class:`MonitoredStrategy` (what the callbacks
need of ``HotSPaStrategy``): observability/ sits below ``adapter/lightning/`` and imports nothing from it.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import lightning as L
import numpy as np
import torch
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import Tqdm
from lightning.pytorch.loggers import WandbLogger

from ...checks import check_int
from ...engine.records import StageRecord, StepResult, rank_stage_fields
from ...layout import Layout
from ...plan import RankPlan, StepPlan
from ...planner.base import PricedPlanner
from .epochs import epoch_text
from .stats import monitor_metrics
from .telemetry import RunSummary, detect_hardware, records_as_rows, stage_flops
from .timeline_png import PARTS, block_lanes, draw_timeline

__all__ = ["HotSPaMonitor", "HotSPaProgressBar", "MonitoredStrategy", "epoch_text", "plan_text"]

Predictor = Callable[[StepPlan], list[float | None]]


def _nonneg_int(name: str, value: Any) -> int:
    return check_int(value, f"HotSPaMonitor: {name}", minimum=0, hint=" (0 = never)")


@runtime_checkable
class MonitoredStrategy(Protocol):
    """What the callbacks read of a HotSPa strategy (``HotSPaStrategy`` is one; checked by
    tests/unit/test_architecture.py). Its ``planner`` is read too, after this check: a property that
    builds the planner on first use has no place in an ``isinstance`` test."""

    last_step: StepResult | None  # the last training step's typed records (every rank)
    layouts: tuple[Layout, ...]  # the run's layouts (empty before the processes are set up)
    tokens_per_rank: int

    def activation_checkpointing_for(self, layout: Layout) -> Any:
        """What the strategy adds to a stage's own checkpointing flag in ``layout``."""

    def planning_context(self) -> Any:
        """What the DataModule plans with (None before set-up)."""


def last_step_of(trainer: L.Trainer) -> StepResult | None:
    """The typed records of the step that just ran (None outside a HotSPa strategy)."""
    strategy = trainer.strategy
    return strategy.last_step if isinstance(strategy, MonitoredStrategy) else None


def plan_text(batch: RankPlan, records: Sequence[StageRecord] = ()) -> str:
    """``bucket->layout xN`` per stage in run order; N = micro-batches of the whole step where known."""
    counts = {r.order: int(r.micro_batches) for r in records}
    parts = []
    for k, stage in enumerate(batch.stages):
        name = stage.layout.name
        count = counts.get(k, len(stage.micro_batches))
        parts.append(f"{stage.label + '->' if stage.label else ''}{name} x{count}")
    return ", ".join(parts)


def _rank_timings(result: StepResult) -> np.ndarray:
    """``[ranks, stages, 3]`` seconds of (switch, compute, reduce) from the step's gathered table."""
    rows = rank_stage_fields(result.table, len(result.stages))
    return np.array([[[cols[f"{p}_s"] for p in PARTS] for cols in row] for row in rows], dtype=np.float64)


class HotSPaMonitor(L.Callback):
    """Per-bucket MFU and predicted-vs-measured time, plan tables, timelines and a final summary.

    Args:
        every_n_steps: compute MFU / predictions (from the global plan the step ran).
        table_every_n_steps: log the step plan as a table (0: never).
        timeline_every_n_steps: draw the stage timeline across ranks (0: never); also the first and
            the last step.
        hardware: a profile name of ``lightning_hotspa.planner.cost.hardware`` (None: detect).
        peak_flops_per_device: FLOP/s of one device for MFU (None: the profile's peak).
        predict: price each step with the cost model (the planner's own if it has ``predict``).
        output_dir: where ``timeline/``, ``plan_table.csv`` and ``summary.json`` go.
        skip_first_steps: steps left out of the summary's throughput (start-up).
    """

    def __init__(self, *, every_n_steps: int = 1, table_every_n_steps: int = 10, timeline_every_n_steps: int = 10,
                 hardware: str | None = None, peak_flops_per_device: float | None = None, predict: bool = True,
                 output_dir: str | None = None, skip_first_steps: int = 1, print_summary: bool = True) -> None:
        self.every_n_steps = max(1, _nonneg_int("every_n_steps", every_n_steps))
        self.table_every = _nonneg_int("table_every_n_steps", table_every_n_steps)
        self.timeline_every = _nonneg_int("timeline_every_n_steps", timeline_every_n_steps)
        self._hardware_spec, self._peak_spec, self._predict_spec = hardware, peak_flops_per_device, predict
        self._output_dir_spec = output_dir
        self.print_summary = print_summary
        self.summary = RunSummary(skip_first=_nonneg_int("skip_first_steps", skip_first_steps))
        self.hardware: str | None = None
        self.peak_flops_per_device: float | None = None
        self.output_dir: Path = Path(output_dir or ".")
        self.timeline_paths: list[Path] = []
        self.table_path: Path | None = None
        self._flops_per_token: Callable[[int], float] | None = None
        self._predictor: Predictor | None = None
        self._warned: set[str] = set()

    # ------------------------------------------------------------------ setup
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        device = trainer.strategy.root_device
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
        self.hardware, self.peak_flops_per_device = detect_hardware(
            self._hardware_spec, self._peak_spec, device.type, name)
        self.summary.peak_flops_total = (self.peak_flops_per_device * trainer.world_size
                                         if self.peak_flops_per_device else None)
        self.output_dir = Path(self._output_dir_spec or trainer.default_root_dir)
        config = getattr(pl_module, "config", None)
        fn = getattr(config, "flops_per_token", None) or getattr(pl_module, "flops_per_token", None)
        self._flops_per_token = fn if callable(fn) else None
        if self._predict_spec and trainer.global_rank == 0:
            self._predictor = self._build_predictor(trainer, pl_module)

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(f"HotSPaMonitor: {message}", stacklevel=2)

    def _build_predictor(self, trainer: L.Trainer, pl_module: L.LightningModule) -> Predictor | None:
        """The planner's ``predict``; where it cannot price plans, a cost-model planner built for that."""
        strategy = trainer.strategy
        if not isinstance(strategy, MonitoredStrategy) or not strategy.layouts:
            return None
        planner, pricing = strategy.planner, None
        config = getattr(pl_module, "config", None)

        def price(plan: StepPlan) -> Any:
            nonlocal pricing
            prediction = planner.predict(plan) if isinstance(planner, PricedPlanner) else None
            if prediction is None and pricing is None:
                if self.hardware is None or config is None:
                    return None
                from ...planner.solve.solver import CostModelPlanner

                pricing = CostModelPlanner(strategy.layouts, model=config, hardware=self.hardware,
                                           tokens_per_rank=strategy.tokens_per_rank, activation_checkpointing="auto")
            return prediction if prediction is not None else pricing.predict(plan)

        def predict(plan: StepPlan) -> list[float | None] | None:
            # price what runs: the stage's flag or the strategy's setting
            stages = tuple(dataclasses.replace(s, activation_checkpointing=s.activation_checkpointing
                                               or strategy.activation_checkpointing_for(s.layout)) for s in plan.stages)
            prediction = price(dataclasses.replace(plan, stages=stages))
            return None if prediction is None else [s.seconds + s.switch_seconds for s in prediction.stages]

        return predict

    # ------------------------------------------------------------------ per step
    def _due(self, every: int, trainer: L.Trainer) -> bool:
        step = trainer.global_step
        return every > 0 and (step == 1 or step % every == 0 or step == trainer.max_steps)

    @staticmethod
    def _logged_step(trainer: L.Trainer) -> int | None:
        """The step value Lightning gives this batch's scalars (``trainer/global_step`` in W&B: the
        optimizer steps done before it), where Lightning writes them to the loggers at all (not while
        accumulating; every ``log_every_n_steps``); None elsewhere. Tables and images go there too,
        so one step's metrics, plan table and timeline share one step value."""
        loop = trainer.fit_loop
        if loop._should_accumulate() or not trainer._logger_connector.should_update_logs:
            return None
        return int(loop.epoch_loop._batches_that_stepped)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if not isinstance(batch, RankPlan) or batch.extras.get("plain") or trainer.global_rank != 0:
            return
        result = last_step_of(trainer)
        step = trainer.global_step
        loss = _loss_of(outputs)
        if loss is not None:
            self.summary.add_loss(loss)
        stages = [(s.layout.name, s.label) for s in batch.stages]
        flops = predicted = None
        plan = batch.extras.get("global_plan")
        if step % self.every_n_steps == 0 or step == 1:
            if not isinstance(plan, StepPlan):
                self._warn_once("plan", "the batches carry no global plan (extras['global_plan']); "
                                        "no MFU or predictions")
            elif len(plan.stages) == len(stages):
                flops, predicted = self._flops(plan), self._predicted(plan)
        plan_stats = batch.extras.get("stages") or ()
        records = [dataclasses.replace(r, step=step, flops=_at(flops, r.order), predicted_s=_at(predicted, r.order),
                                       plan=dict(plan_stats[r.order]) if r.order < len(plan_stats) else {})
                   for r in (result.records if result is not None else ())]
        step_s = result.step_s if result is not None and records else None
        self._log_step(pl_module, records, step_s, loss, batch.extras.get("planner"))
        self.summary.add(step, records, step_s)
        logged = self._logged_step(trainer)
        if self._due(self.table_every, trainer):
            self._log_table(trainer, logged, records)
        if result is not None and result.stages and self._due(self.timeline_every, trainer):
            lanes = block_lanes(plan, trainer.strategy.mesh_shape) if isinstance(plan, StepPlan) and getattr(
                trainer.strategy, "mesh_shape", None) is not None else []
            self._log_timeline(trainer, step, logged, _rank_timings(result), stages, predicted, lanes)

    def _flops(self, plan: StepPlan) -> list[float | None] | None:
        if self._flops_per_token is None:
            return None
        return list(stage_flops(plan.doc_lengths, [s.doc_ids for s in plan.stages], self._flops_per_token))

    def _predicted(self, plan: StepPlan) -> list[float | None] | None:
        if self._predictor is None:
            return None
        try:
            return self._predictor(plan)
        except Exception as exc:  # a layout the cost model cannot price: stop predicting, say why
            self._warn_once("predict", f"cost model failed, predictions stop ({type(exc).__name__}: {exc})")
            self._predictor = None
            return None

    def _log_step(self, pl_module: L.LightningModule, records: Sequence[StageRecord], step_s: float | None,
                  loss: float | None, planner_notes: Mapping[str, float] | None) -> None:
        out = monitor_metrics(records, step_s, loss, self.summary.peak_flops_total, planner_notes)
        if out:
            pl_module.log_dict(out, on_step=True, on_epoch=False, rank_zero_only=True, batch_size=1)

    def _log_table(self, trainer: L.Trainer, logged: int | None, records: Sequence[StageRecord]) -> None:
        """The plan table: a CSV row per stage always; a W&B table at ``logged`` (None: Lightning writes
        no scalars for this batch, so neither does the table go to W&B)."""
        rows = records_as_rows(records, self.summary.peak_flops_total)
        if not rows:
            return
        columns = list(rows[0])
        self.table_path = self.output_dir / "plan_table.csv"
        self.table_path.parent.mkdir(parents=True, exist_ok=True)
        new = not self.table_path.exists()
        with self.table_path.open("a", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=columns)
            if new:
                writer.writeheader()
            writer.writerows(rows)
        for logger in trainer.loggers if logged is not None else ():
            if isinstance(logger, WandbLogger):
                logger.log_table("hotspa/plan", columns=columns, data=[[r[c] for c in columns] for r in rows],
                                 step=logged)

    def _log_timeline(self, trainer: L.Trainer, step: int, logged: int | None, timings: np.ndarray,
                      stages: Sequence[tuple[str, str]],
                      predicted: Sequence[float | None] | None, lanes: Sequence[tuple[str, Sequence[int]]] = ()
                      ) -> None:
        path = self.output_dir / "timeline" / f"step_{step:06d}.png"
        try:
            draw_timeline(timings, [s[0] for s in stages], [s[1] for s in stages], path, step=step,
                          predicted_s=predicted, lanes=lanes or None)
        except Exception as exc:  # a plot must never stop training
            self._warn_once("timeline", f"could not draw the timeline ({type(exc).__name__}: {exc})")
            return
        self.timeline_paths.append(path)
        for logger in trainer.loggers if logged is not None else ():
            if isinstance(logger, WandbLogger):
                logger.log_image("hotspa/timeline", [str(path)], step=logged)

    # ------------------------------------------------------------------ end of run
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_rank != 0:
            return
        self.output_dir.mkdir(parents=True, exist_ok=True)
        summary = {**self.summary.as_dict(), "hardware": self.hardware,
                   "peak_flops_per_device": self.peak_flops_per_device,
                   "timelines": [str(p) for p in self.timeline_paths]}
        (self.output_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        if not self.print_summary:
            return
        lines = ["", self.summary.format_table()]
        if self.timeline_paths:
            lines.append(f"timeline PNGs ({len(self.timeline_paths)}): {self.timeline_paths[-1].parent}/, "
                         f"last: {self.timeline_paths[-1]}")
        if self.table_path is not None:
            lines.append(f"plan tables: {self.table_path}")
        lines.append(f"summary: {self.output_dir / 'summary.json'}")
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                from .wandb_run import offline_run_message

                lines.append(offline_run_message(logger))
            elif getattr(logger, "log_dir", None):
                lines.append(f"{type(logger).__name__}: {logger.log_dir}")
        print("\n".join(lines), flush=True)


def _at(values: Sequence[float | None] | None, i: int) -> float | None:
    return values[i] if values is not None and i < len(values) else None


def _loss_of(outputs: Any) -> float | None:
    loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
    if isinstance(loss, torch.Tensor) and loss.numel() == 1:
        return float(loss.detach())
    return None


class HotSPaProgressBar(TQDMProgressBar):
    """Lightning's bar plus the current step's plan (bucket -> layout x micro-batches) and tokens/s.

    Shown on rank 0 only (Lightning disables it elsewhere). Differences from Lightning's bar: the
    epoch reads ``Epoch <n>/<total>`` counted from 1, the total from ``max_epochs`` or, for a run
    bounded by ``max_steps``, the epochs those steps span (:func:`epoch_text`); one redraw per
    step (Lightning redraws once for the count and once for the metrics, which a log that is not a
    terminal keeps as two lines); and ``leave=False`` by default, as in Lightning (``leave=True``
    there opens a new bar at every epoch start and leaves the first one open).
    """

    def __init__(self, refresh_rate: int = 1, leave: bool = False, show_plan: bool = True) -> None:
        super().__init__(refresh_rate=refresh_rate, leave=leave)
        self.leave_bars = leave
        self.show_plan = show_plan
        self._plan = ""

    def init_train_tqdm(self) -> Tqdm:
        """Lightning's train bar, first drawn when the epoch starts and names it (Lightning's draws
        ``Training: 0/?`` at once, a line of its own in a log)."""
        bar = Tqdm(desc=self.train_description, position=2 * self.process_position, disable=self.is_disabled,
                   leave=True, dynamic_ncols=True, file=sys.stdout, smoothing=0, bar_format=self.BAR_FORMAT,
                   delay=float("inf"))  # no draw on creation
        bar.delay = 0  # later redraws (and close) as usual
        return bar

    def on_train_epoch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if self.leave_bars:
            self.train_progress_bar = self.init_train_tqdm()
        bar, total = self.train_progress_bar, self.total_train_batches
        if bar.disable and not self.is_disabled:  # the last epoch's line was finished (_finish): a new one
            bar.disable = False
        bar.set_description(epoch_text(trainer), refresh=False)
        bar.reset(total=None if total == float("inf") else total)  # one redraw, with the true epoch
        bar.initial = 0

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self.show_plan and isinstance(batch, RankPlan):
            result = last_step_of(trainer)
            self._plan = plan_text(batch, result.records if result is not None else ())
        bar, n = self.train_progress_bar, batch_idx + 1
        if bar is not None and not bar.disable and self.refresh_rate > 0 and (
                n % self.refresh_rate == 0 or n == bar.total):
            bar.set_postfix(self.get_metrics(trainer, pl_module), refresh=False)
            bar.n = n
            bar.refresh()
        if bar is not None and not bar.disable and (n == bar.total or 0 < trainer.max_steps <= trainer.global_step):
            self._finish(bar)

    @staticmethod
    def _finish(bar: Tqdm) -> None:
        """Ends the bar's line once its last redraw is out (Lightning's close would draw it again, after
        the run's summary, and the log lines before it would land on the bar's line)."""
        bar.fp.write("\n")
        bar.fp.flush()
        bar.disable = True

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        bar = self.train_progress_bar
        if bar is not None and not bar.disable:
            self._finish(bar)
        super().on_train_end(trainer, pl_module)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.leave_bars and not self.train_progress_bar.disable:  # the last step's redraw already shows
            self._finish(self.train_progress_bar)  # the epoch's final numbers

    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        items = super().get_metrics(trainer, pl_module)
        items.pop("v_num", None)
        tps = trainer.callback_metrics.get("hotspa/tokens_per_s")
        if tps is not None:
            items["tok/s"] = f"{float(tps):.0f}"
        if self._plan:
            items["plan"] = self._plan
        return items
