"""``HotSPaStrategy``: ``Trainer(strategy="hotspa")`` runs a whole step plan per optimizer step,
hot-switching the model between parallel layouts inside the step (docs/DESIGN.md §3-4).

One Lightning batch is this rank's slice of one step plan (:class:`RankPlan`). ``training_step``
walks its stages: switch the working parameters to the stage's layout, run the user's
``training_step`` on every micro-batch with the loss scaled to the global token mean, back-propagate,
and at the stage end reduce the working gradients into the switch engine's store, except when the
next stage has the same tp degree: a run of such stages shares working shards and gradient states,
so it accumulates into the same ``.grad`` and reduces once, at its last stage. Lightning then
zeroes ``.grad`` and calls :meth:`backward`, which hands the store to the home parameters; one
``optimizer.step()`` follows. The home parameters (fp32 DTensors sharded over the world) are what the
optimizer, checkpoints and ``module.parameters()`` see outside a step.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer import call
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only, rank_zero_warn
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from typing_extensions import override

from ..checks import check_int
from ..engine.switch import GradReport, SwitchEngine, build_home_parameters
from ..layout import Layout, LayoutError, MeshShape, WorldMesh, parse_layouts
from ..parallel.model import ParallelModel
from ..placements import build_shardings
from ..plan import MicroBatch, RankPlan, RankStage
from .checkpoint import (
    check_checkpoint_dirs,
    load_distributed_checkpoint,
    resolve_checkpoint,
    save_distributed_checkpoint,
)
from .precision import HotSPaPrecision
from .reliability import (
    NonFiniteLossError,
    StepTracker,
    check_nonfinite_policy,
    enable_nccl_flight_recorder,
)
from .stats import StageStats, step_metrics

__all__ = ["HotSPaStrategy", "default_layouts"]

#: what ``planner=`` accepts by name (anything else must be a Planner instance)
PLANNER_NAMES = ("rule", "cost", "cost-profiled")


def default_layouts(world_size: int) -> list[Layout]:
    """A nesting candidate set: pure data parallel, then tp2 with growing cp for longer documents."""
    if world_size & (world_size - 1):
        return [Layout(dp=world_size)]
    layouts, cp = [Layout(dp=world_size)], 1
    while 2 * cp <= world_size:
        layouts.append(Layout(dp=world_size // (2 * cp), tp=2, cp=cp))
        cp *= 2
    return layouts


class HotSPaStrategy(ParallelStrategy):
    """Hot-switching parallel layouts (dp x tp x cp) per length bucket inside one optimizer step.

    Args:
        layouts: candidate layouts (``Layout``, ``"dp2xtp2"`` or ``{"dp": 2, "tp": 2}``), or ``"auto"``.
        tokens_per_rank: activation-token capacity of one rank; a layout's micro-batch capacity is
            ``tokens_per_rank * tp * cp``.
        planner: ``"rule"`` (assign each document to the most data-parallel layout that holds it),
            ``"cost"`` (the cost-model solver, :class:`~lightning_hotspa.planner.CostModelPlanner`, with
            the ``hardware`` profile), ``"cost-profiled"`` (the same, refitting its coefficients to
            the measured stage times: :meth:`_observe_timings`), or a ready
            :class:`~lightning_hotspa.planner.base.Planner`.
        hardware: hardware profile name for ``planner="cost"`` (e.g. ``"cpu-gloo"``, ``"h200"``).
        activation_checkpointing: ``False``, ``True`` (all layouts), ``"auto"`` (layouts with
            tp*cp > 1, the long-sequence ones) or a list of layouts.
        default_layout: the layout plain (non-plan) batches, validation and prediction run in;
            default: the most data-parallel candidate.
        nonfinite: what a NaN/Inf micro-batch loss does, decided alike on every rank before the
            optimizer step: ``"stop"`` (default; raises ``NonFiniteLossError`` naming the step, stage,
            layout and micro-batch) or ``"skip"`` (no update for that step; logged with its plan).
        breadcrumb_dir: where each rank keeps its current step / stage / layout / micro-batch / phase
            as ``rank<N>.txt`` (also ``$HOTSPA_BREADCRUMB_DIR``). Default: off on gloo (a failed
            collective raises an error naming it), ``<default_root_dir>/hotspa_breadcrumbs`` on NCCL,
            whose watchdog aborts the process without a Python error.
        timeout: the process-group timeout (a ``timedelta`` or seconds): how long a rank waits in a
            collective for a peer that hangs (a peer that dies is noticed at once on gloo).
    """

    strategy_name = "hotspa"

    def __init__(
        self,
        layouts: Sequence[Layout | str | Mapping[str, int]] | str = "auto",
        *,
        tokens_per_rank: int = 4096,
        planner: Any = "rule",
        hardware: str = "cpu-gloo",
        activation_checkpointing: bool | str | Sequence[Layout | str] = False,
        default_layout: Layout | str | None = None,
        nonfinite: str = "stop",
        breadcrumb_dir: str | os.PathLike | None = None,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | float = default_pg_timeout,
    ) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin)
        if isinstance(layouts, str) and layouts != "auto":
            raise LayoutError(f"layouts must be 'auto' or a list of layouts, got {layouts!r}")
        self._layout_spec = layouts if layouts == "auto" else [Layout.parse(x) for x in layouts]
        if self._layout_spec != "auto" and not self._layout_spec:
            raise LayoutError("HotSPaStrategy(layouts=[]) is empty; give at least one layout or 'auto'")
        check_int(tokens_per_rank, "tokens_per_rank")
        if isinstance(activation_checkpointing, str) and activation_checkpointing != "auto":
            raise ValueError(f"activation_checkpointing must be a bool, 'auto' or a list of layouts, "
                             f"got {activation_checkpointing!r}")
        if isinstance(planner, str) and planner not in PLANNER_NAMES:
            raise ValueError(f"unknown planner {planner!r}; use one of {list(PLANNER_NAMES)} or a Planner instance")
        if not isinstance(planner, str) and not all(hasattr(planner, a) for a in ("layouts", "capacity", "plan")):
            raise ValueError(f"planner must be one of {list(PLANNER_NAMES)} or a Planner (layouts, capacity, plan); "
                             f"got {type(planner).__name__}")
        if planner in ("cost", "cost-profiled"):
            from ..planner.hardware import get_profile

            get_profile(hardware)  # an unknown profile name fails here, naming the known ones
        self.tokens_per_rank = tokens_per_rank
        self._planner_spec = planner
        self.hardware = hardware
        self._ac_spec = activation_checkpointing
        self._default_layout_spec = Layout.parse(default_layout) if default_layout is not None else None
        self._process_group_backend = process_group_backend
        self._timeout = _as_timeout(timeout)
        self.nonfinite = check_nonfinite_policy(nonfinite)
        self._breadcrumb_dir = breadcrumb_dir if breadcrumb_dir is not None else os.environ.get("HOTSPA_BREADCRUMB_DIR")
        self.tracker = StepTracker()  # this rank's breadcrumb and the step's micro-batch losses
        self.skipped_steps: list[dict[str, Any]] = []  # non-finite steps dropped under nonfinite="skip"
        self._skip_update = False
        self.num_nodes = 1
        self.world: WorldMesh | None = None
        self.layouts: tuple[Layout, ...] = ()
        self.mesh_shape: MeshShape | None = None
        self._planner: Any = None
        self.engine: SwitchEngine | None = None
        self.parallel: ParallelModel | None = None
        self.home: dict[str, nn.Parameter] = {}
        self.last_stage_stats: list[StageStats] = []
        self.last_metrics: dict[str, float] = {}  # the last step's metrics (same on every rank)
        self.last_step_table: Tensor | None = None  # the last step's gathered stage table (step_metrics)
        self._timed_steps = 0  # training steps this process ran (its first one is not a fair timing)

    # ------------------------------------------------------------------ Lightning plumbing
    @property
    @override
    def precision_plugin(self) -> Precision:
        return self._precision_plugin if self._precision_plugin is not None else HotSPaPrecision()

    @precision_plugin.setter
    @override
    def precision_plugin(self, plugin: Precision | None) -> None:
        self._precision_plugin = None if plugin is None else self._convert_precision(plugin)

    def _convert_precision(self, plugin: Precision) -> HotSPaPrecision:
        if isinstance(plugin, HotSPaPrecision):
            return plugin
        name = getattr(plugin, "precision", None)
        if type(plugin) is Precision:
            name = "32-true"
        return HotSPaPrecision(name)  # raises a clear error for anything unsupported

    @property
    def hotspa_precision(self) -> HotSPaPrecision:
        return self.precision_plugin  # type: ignore[return-value]

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # plain batches run in a pure data-parallel layout: every rank its own samples
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    @property
    def is_distributed(self) -> bool:
        return True

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = self._process_group_backend or _get_default_process_group_backend_for_device(
            self.root_device)
        kwargs: dict[str, Any] = {"timeout": self._timeout}
        if self.root_device.type != "cpu":
            kwargs["device_id"] = self.root_device
        enable_nccl_flight_recorder(self._process_group_backend)  # before the process group exists
        _init_dist_connection(self.cluster_environment, self._process_group_backend, **kwargs)
        self.tracker.rank = self.global_rank
        world_size = dist.get_world_size()
        specs = default_layouts(world_size) if self._layout_spec == "auto" else self._layout_spec
        try:
            self.layouts = parse_layouts(specs, world_size)
        except LayoutError as exc:
            raise LayoutError(f"{type(self).__name__}(layouts={[str(x) for x in specs]}): {exc} (devices x num_nodes; "
                              f"a run resumed on another number of ranks needs layouts for it, e.g. "
                              f"{[str(x) for x in default_layouts(world_size)]} or 'auto')") from None
        self.world = WorldMesh(self.layouts, device_type=self.root_device.type, timeout=self._timeout)
        self.mesh_shape = self.world.shape

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank

    @property
    def planner(self) -> Any:
        """The step planner the DataModule builds plans with (built on first use)."""
        if self._planner is None:
            if not self.layouts:
                raise RuntimeError("the planner is available once the processes are set up")
            self._planner = self._build_planner()
        return self._planner

    def _build_planner(self) -> Any:
        if self._planner_spec == "rule":
            from ..planner.rule import ThresholdPlanner

            return ThresholdPlanner(self.layouts, tokens_per_rank=self.tokens_per_rank)
        if self._planner_spec in ("cost", "cost-profiled"):
            from ..planner.solver import CostModelPlanner

            config = getattr(self.lightning_module, "config", None)
            if config is None:
                raise ValueError("planner='cost' needs the LightningModule's model config (a `config` attribute, "
                                 f"e.g. LlamaLM); {type(self.lightning_module).__name__} has none")
            return CostModelPlanner(self.layouts, model=config, hardware=self.hardware,
                                    tokens_per_rank=self.tokens_per_rank,
                                    activation_checkpointing=self._ac_spec,
                                    profiled=self._planner_spec == "cost-profiled")
        return self._planner_spec  # a Planner instance (names were checked in __init__)

    @property
    def default_layout(self) -> Layout:
        if self._default_layout_spec is not None:
            if self._default_layout_spec not in self.layouts:
                raise LayoutError(f"default_layout {self._default_layout_spec} is not among the layouts "
                                  f"{[str(x) for x in self.layouts]}")
            return self._default_layout_spec
        return max(self.layouts, key=lambda x: (x.dp, x.cp))

    def activation_checkpointing_for(self, layout: Layout) -> bool:
        spec = self._ac_spec
        if isinstance(spec, bool):
            return spec
        if spec == "auto":
            return layout.tp * layout.cp > 1
        return layout in {Layout.parse(x) for x in spec}

    # ------------------------------------------------------------------ setup
    @override
    def setup(self, trainer: Any) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        if not module.automatic_optimization:
            raise ValueError(f"{type(self).__name__} needs automatic optimization; "
                             f"{type(module).__name__}.automatic_optimization is False")
        if trainer.accumulate_grad_batches != 1:
            raise ValueError(f"{type(self).__name__} does not support accumulate_grad_batches="
                             f"{trainer.accumulate_grad_batches}: one step plan is one optimizer step; raise the "
                             f"data module's tokens_per_batch instead")
        self._build_home_state(module)
        self._open_breadcrumbs(trainer)
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            check_checkpoint_dirs(trainer, is_rank_zero=self.global_rank == 0, broadcast=self.broadcast)
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()

    def _open_breadcrumbs(self, trainer: Any) -> None:
        directory = self._breadcrumb_dir
        if directory is None and self._process_group_backend and "nccl" in self._process_group_backend:
            directory = os.path.join(trainer.default_root_dir, "hotspa_breadcrumbs")
        if directory is not None and self.tracker.path is None:
            path = self.tracker.open_file(directory, self.global_rank)
            rank_zero_info(f"hotspa: each rank's position in the step is kept in {path.parent}")

    def _roles(self, module: nn.Module) -> dict[str, str]:
        max_tp = max(x.tp for x in self.layouts)
        tp_plan = getattr(module, "tp_plan", None)
        if tp_plan is None:
            if max_tp > 1:
                raise LayoutError(f"layouts with tp={max_tp} need a tensor-parallel plan, but "
                                  f"{type(module).__name__} defines no tp_plan(tp) method")
            return {n: "replicated" for n, _ in module.named_parameters()}
        from ..models.tp_plan import param_roles

        # tp degrees nest, so a plan valid for the largest tp is valid for every layout
        return param_roles(module, tp_plan(max_tp))

    def _build_home_state(self, module: nn.Module) -> None:
        assert self.world is not None
        if self.home and all(p is self.home.get(n) for n, p in module.named_parameters()):
            return  # the same module again (fit, then validate): hooks and home state stay
        shapes = {n: tuple(p.shape) for n, p in module.named_parameters()}
        shardings = build_shardings(shapes, self._roles(module), self.world.shape)
        params = dict(module.named_parameters())
        on_meta = any(p.is_meta for p in params.values())
        init_parameter = getattr(module, "init_parameter", None)
        if on_meta and init_parameter is None:
            raise ValueError(f"{type(module).__name__} was built on the meta device but defines no "
                             f"init_parameter(name) to initialize its parameters from")

        def full(name: str, shape: tuple[int, ...]) -> Tensor:
            if on_meta:
                return init_parameter(name)
            p = params[name].detach()
            return (p.full_tensor() if isinstance(p, DTensor) else p).to("cpu")

        precision = self.hotspa_precision
        self.home = build_home_parameters(self.world, shardings, full, dtype=precision.home_dtype,
                                          device=self.root_device)
        roles = {n: s.role.name for n, s in shardings.items()}
        self.parallel = ParallelModel(module, roles, self.world)
        self.parallel.restore(self.home)
        module.to(self.root_device)  # buffers; parameters already live there
        self.engine = SwitchEngine(self.world, shardings, self.home, working_dtype=precision.working_dtype)

    @contextlib.contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Any:
        """``trainer.init_module(empty_init=True)`` builds on the meta device; ``setup`` then
        initializes each home shard from the module's ``init_parameter``."""
        with (torch.device("meta") if empty_init else contextlib.nullcontext()), \
                self.precision_plugin.tensor_init_context():
            yield

    @override
    def model_to_device(self) -> None:
        pass  # home parameters are created on the root device

    # ------------------------------------------------------------------ the step
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Tensor:
        batch, batch_idx = args[0], (args[1] if len(args) > 1 else kwargs.get("batch_idx", 0))
        self.tracker.begin_step(self.lightning_module.trainer.global_step, batch_idx,
                                len(batch.stages) if isinstance(batch, RankPlan) else 1)
        with self.tracker.guard():
            plan = batch if isinstance(batch, RankPlan) else self._plain_plan(batch)
            return self._run_plan(plan, batch_idx)

    def _plain_plan(self, batch: Any) -> RankPlan:
        """An ordinary batch: one stage in the default layout; loss weighted by this rank's target
        tokens if the batch says how many it has, else averaged over ranks as DDP does."""
        layout = self.default_layout
        if layout.tp > 1 or layout.cp > 1:
            raise LayoutError(f"plain batches of type {type(batch).__name__} need a pure data-parallel "
                              f"default layout, but it is {layout}; feed RankPlans from HotSPaDataModule")
        tokens = getattr(batch, "num_target_tokens", None)
        if tokens is not None:
            total = torch.tensor([float(tokens)], device=self.root_device)
            dist.all_reduce(total)
            global_tokens = int(total.item())
        else:
            global_tokens = -1
        return RankPlan(-1, (RankStage(layout, (batch,), self.activation_checkpointing_for(layout)),),
                        global_tokens, {"plain": True})

    def _loss_weight(self, mb: Any, plan: RankPlan, layout: Layout) -> float:
        if plan.global_target_tokens < 0:  # plain batch without token counts: mean over dp ranks
            return 1.0 / layout.dp
        if plan.global_target_tokens == 0:
            return 0.0
        return mb.num_target_tokens / plan.global_target_tokens

    def _run_plan(self, plan: RankPlan, batch_idx: int) -> Tensor:
        assert self.engine is not None and self.parallel is not None
        module = self.lightning_module
        trainer = module.trainer
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.root_device)
        stats: list[StageStats] = []
        carry = False  # the previous stage left its working gradients unreduced for this one
        try:
            for k, stage in enumerate(plan.stages):
                self.tracker.enter_stage(stage)
                t0 = time.perf_counter()
                report = self._switch_to(stage.layout, keep_grads=carry)
                # the same decision on every rank: the stage list is the global plan's
                carry = k + 1 < len(plan.stages) and self.engine.shares_gradients(stage.layout,
                                                                                  plan.stages[k + 1].layout)
                self.parallel.activate(stage.layout, self.engine.working,
                                       stage.activation_checkpointing or self.activation_checkpointing_for(stage.layout))
                t1 = time.perf_counter()
                for i, mb in enumerate(stage.micro_batches):
                    self.tracker.enter_micro_batch()
                    with self.parallel.micro_batch(mb if isinstance(mb, MicroBatch) else None), \
                            self.precision_plugin.train_step_context():
                        loss = module.training_step(mb, batch_idx)
                    loss = _as_scalar_loss(loss, module)
                    self.tracker.record_loss(loss, mb)
                    scaled = loss * self._loss_weight(mb, plan, stage.layout)
                    call._call_callback_hooks(trainer, "on_before_backward", scaled)
                    call._call_lightning_module_hook(trainer, "on_before_backward", scaled)
                    if i == len(stage.micro_batches) - 1 and not carry:  # reduce buckets while it runs
                        self.engine.overlap_next_backward()
                    module.backward(scaled)
                    call._call_callback_hooks(trainer, "on_after_backward")
                    call._call_lightning_module_hook(trainer, "on_after_backward")
                    loss_sum += scaled.detach().double() / stage.layout.tp  # tp ranks hold copies
                t2 = time.perf_counter()
                if carry:  # same tp next: keep accumulating, the run's last stage reduces once
                    grad_report, t3 = GradReport(stage.layout.name, 0, 0, 0.0), t2
                else:
                    self.tracker.enter_phase("reduce")
                    grad_report = self.engine.reduce_gradients()
                    t3 = time.perf_counter()
                stats.append(StageStats.measure(stage, report, grad_report, switch_s=t1 - t0,
                                                compute_s=t2 - t1, reduce_s=t3 - t2))
        finally:
            self.parallel.restore(self.home)
            self.engine.release()
        self.last_stage_stats = stats
        # the one small collective of the step: the exact global loss and the slowest rank's times
        self.tracker.enter_phase("metrics")
        loss, metrics, table = step_metrics(loss_sum, stats, self.root_device)
        self.last_step_table = table  # every rank's stage numbers: stats.gathered_observations reads it
        self._skip_update = self._check_finite(loss, plan, metrics)
        self.last_metrics = metrics
        self._observe_timings(plan, table)
        if metrics and not plan.extras.get("plain"):
            module.log_dict(metrics, on_step=True, on_epoch=False, sync_dist=False, rank_zero_only=True,
                            batch_size=1)
        return loss.to(torch.float64 if self.hotspa_precision.home_dtype == torch.float64 else torch.float32)

    def _observe_timings(self, plan: RankPlan, table: Tensor) -> None:
        """Profiled planner: every rank's stage seconds (from the step's one all-gather, identical
        on all ranks) become observations, then ``refit(plan.step)``: coefficients change only at
        multiples of its ``refit_every`` and plan steps ``>= plan.step + plan_lag``, on every rank
        and loader worker alike (planner/schedule.py). The clock is ``compute_s``: wall seconds of the
        stage's forwards and backwards (on an accelerator only as synchronized as the loss read makes it)."""
        planner = self._planner
        if planner is None or not getattr(planner, "profiled", False) or plan.step < 0 or plan.extras.get("plain"):
            return
        from .stats import gathered_observations

        self._timed_steps += 1
        if self._timed_steps > 1:  # a process' first step pays one-off costs (allocations, first switches)
            ac = [s.activation_checkpointing or self.activation_checkpointing_for(s.layout) for s in plan.stages]
            planner.observe(gathered_observations(table, self.last_stage_stats, ac))
        planner.refit(plan.step)

    def _check_finite(self, loss: Tensor, plan: RankPlan, metrics: dict[str, float]) -> bool:
        """True: drop this step's update. The gathered total is the same on every rank, and any
        NaN/Inf micro-batch loss makes it non-finite, so all ranks decide alike with no extra sync."""
        if bool(torch.isfinite(loss)):
            return False
        assert self.engine is not None
        self.engine.clear_grad_store()
        report = self.tracker.nonfinite_report(plan)  # a collective, on every rank together
        if self.nonfinite == "stop":
            raise NonFiniteLossError(f"{report}. Stopping before the optimizer step (nonfinite='stop'; "
                                     f"nonfinite='skip' drops such steps instead)")
        self.skipped_steps.append({"global_step": self.tracker.step, "batch_idx": self.tracker.batch_idx,
                                   "report": report})
        metrics["hotspa/skipped_steps"] = float(len(self.skipped_steps))
        rank_zero_warn(f"hotspa: skipping the update: {report} (nonfinite='skip')")
        return True

    def _switch_to(self, layout: Layout, keep_grads: bool = False) -> Any:
        assert self.engine is not None
        if self.engine.active is None:
            return self.engine.materialize(layout)
        return self.engine.switch(layout, keep_grads=keep_grads)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        """Gradients were computed and reduced inside ``training_step``; hand them to the home params
        now, after Lightning's ``zero_grad`` (docs/DESIGN.md §7, trap "Lightning's closure order")."""
        assert self.engine is not None
        if self._skip_update:  # a non-finite step under nonfinite="skip": no gradients, no update
            for p in self.home.values():
                p.grad = None
        else:
            self.engine.assign_home_grads()
        self.engine.clear_grad_store()
        self.tracker.enter_phase("optimizer")
        return closure_loss

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        with self.tracker.guard():  # clipping's all-reduce; the step itself (in the closure) is guarded there
            return super().optimizer_step(optimizer, closure, model, **kwargs)

    # ------------------------------------------------------------------ evaluation
    def _eval_step(self, hook: str, args: tuple, kwargs: dict) -> Any:
        assert self.engine is not None and self.parallel is not None
        module = self.lightning_module
        batch = args[0]
        rest = args[1:]
        stages = batch.stages if isinstance(batch, RankPlan) else (RankStage(self.default_layout, (batch,)),)
        if not isinstance(batch, RankPlan) and (self.default_layout.tp > 1 or self.default_layout.cp > 1):
            raise LayoutError(f"plain batches need a pure data-parallel default layout, got {self.default_layout}")
        output = None
        context = getattr(self.precision_plugin, _EVAL_CONTEXTS[hook])
        try:
            for stage in stages:
                self._switch_to(stage.layout)
                self.parallel.activate(stage.layout, self.engine.working)
                for mb in stage.micro_batches:
                    with self.parallel.micro_batch(mb if isinstance(mb, MicroBatch) else None), context():
                        output = getattr(module, hook)(mb, *rest, **kwargs)
        finally:
            self.parallel.restore(self.home)
            self.engine.release()
        return output

    def _eval_guard(self, hook: str) -> Any:
        trainer = getattr(self.lightning_module, "_trainer", None)
        self.tracker.between_steps(hook, trainer.global_step if trainer is not None else -1)
        return self.tracker.guard()

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._eval_guard("validation_step"):
            return self._eval_step("validation_step", args, kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._eval_guard("test_step"):
            return self._eval_step("test_step", args, kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._eval_guard("predict_step"):
            return self._eval_step("predict_step", args, kwargs)

    # ------------------------------------------------------------------ collectives
    @override
    def barrier(self, name: str | None = None) -> None:
        if not _distributed_is_initialized():
            return
        with self.tracker.guard(f"barrier {name!r}" if name else "a barrier"):
            if dist.get_backend() == "nccl":
                dist.barrier(device_ids=[self.root_device.index])
            else:
                dist.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        with self.tracker.guard("a broadcast"):
            dist.broadcast_object_list(box, src)
        return box[0]

    @override
    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        if isinstance(tensor, Tensor):
            if not tensor.is_floating_point() and isinstance(reduce_op, str) and reduce_op.lower() in ("mean", "avg"):
                tensor = tensor.double()  # Lightning's mean of an int tensor truncates (e.g. summed batch sizes)
            with self.tracker.guard("a reduce"):
                return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    @override
    def teardown(self) -> None:
        if self.parallel is not None and self.home:
            self.parallel.restore(self.home)
        assert self.cluster_environment is not None and self.accelerator is not None
        self.tracker.close_file()
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()

    # ------------------------------------------------------------------ checkpoints
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return self.lightning_module.state_dict()

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        pass  # loaded in load_checkpoint, where DCP reshards into this run's layouts

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(self.lightning_module, getattr(optimizer, "_optimizer", optimizer))

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass  # loaded in load_checkpoint

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint does not take storage_options")
        path = self.broadcast(str(filepath))
        checkpoint.setdefault("hotspa", {})["planner"] = (self.planner.state_dict()
                                                          if hasattr(self.planner, "state_dict") else {})
        checkpoint["hotspa"]["layouts"] = [x.name for x in self.layouts]
        checkpoint["hotspa"]["world_size"] = self.world_size
        self.tracker.between_steps(f"checkpoint save to {path}", checkpoint.get("global_step", -1))
        with self.tracker.guard("a checkpoint save"):
            save_distributed_checkpoint(checkpoint, path, is_rank_zero=self.global_rank == 0, barrier=self.barrier,
                                        broadcast=self.broadcast)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        path = str(resolve_checkpoint(self.broadcast(str(checkpoint_path))))
        checkpoint = load_distributed_checkpoint(path, self.lightning_module, self.optimizers)
        saved = checkpoint.get("hotspa", {})
        rank_zero_info(f"hotspa: resuming from {path} (epoch {checkpoint.get('epoch')}, global step "
                       f"{checkpoint.get('global_step')}; saved by {saved.get('world_size', '?')} ranks with layouts "
                       f"{saved.get('layouts', '?')}, now {self.world_size} ranks with {[x.name for x in self.layouts]})")
        planner_state = checkpoint.get("hotspa", {}).get("planner")
        if planner_state and hasattr(self.planner, "load_state_dict"):
            self.planner.load_state_dict(planner_state)
        return checkpoint

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        if self.global_rank == 0:
            import shutil
            from pathlib import Path

            path = Path(filepath)
            shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)


# Lightning's Precision names its per-hook contexts differently from the hooks themselves
_EVAL_CONTEXTS = {"validation_step": "val_step_context", "test_step": "test_step_context",
                  "predict_step": "predict_step_context"}


def _as_timeout(timeout: Any) -> timedelta:
    """A ``timedelta``, or seconds as a number (what a YAML config can say)."""
    if isinstance(timeout, timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise ValueError(f"timeout must be a datetime.timedelta or a number of seconds, got {timeout!r}")
    if not seconds > 0:
        raise ValueError(f"timeout must be positive, got {timeout!r}")
    return timeout if isinstance(timeout, timedelta) else timedelta(seconds=seconds)


def _as_scalar_loss(loss: Any, module: nn.Module) -> Tensor:
    if isinstance(loss, Mapping):
        loss = loss.get("loss")
    if not isinstance(loss, Tensor) or loss.numel() != 1 or not loss.requires_grad:
        what = type(loss).__name__ if not isinstance(loss, Tensor) else f"a tensor of shape {tuple(loss.shape)}" + (
            "" if loss.requires_grad else " without grad")
        raise ValueError(f"{type(module).__name__}.training_step must return a scalar loss tensor with a graph "
                         f"(the mean over its micro-batch's target tokens); got {what}")
    return loss.reshape(())  # finiteness is checked once per step, on every rank alike (_check_finite)

