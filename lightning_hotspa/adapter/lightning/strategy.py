"""``HotSPaStrategy``: ``Trainer(strategy="hotspa")`` runs a whole step plan per optimizer step,
hot-switching the model between parallel layouts inside the step (docs/DESIGN.md §3-4).

One Lightning batch is this rank's slice of one step plan (:class:`RankPlan`); ``training_step``
hands it to the engine's :class:`StepRunner`. Lightning then zeroes ``.grad`` and calls
:meth:`backward`, which hands the reduced gradients to the home parameters (fp32 DTensors sharded
over the world: what the optimizer, checkpoints and ``module.parameters()`` see outside a step).
The Lightning plumbing only; each other job is a module of its own (planner_factory, home_state,
lightning_step, nonfinite, profiling, layout_choice beside it; ``checkpoints.hooks``, ``observability.stats``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from torch import Tensor, nn
from typing_extensions import override

from ...activation_checkpointing import Checkpointing
from ...checks import check_int
from ...data.context import PlanningContext
from ...engine.buckets import bucket_defaults
from ...engine.records import StepResult
from ...engine.step_runner import StepRunner
from ...engine.switch import SwitchEngine
from ...layout import Layout, MeshShape
from ...mesh import WorldMesh
from ...parallel.fp8 import check_fp8
from ...parallel.model import ParallelModel
from ...plan import RankPlan
from ...planner.base import Planner, PricedPlanner
from ..checkpoints.dcp_state import check_checkpoint_dirs
from ..checkpoints.hooks import StrategyCheckpoints
from ..checkpoints.nodes import placement_for
from ..observability.epochs import number_lightning_bars
from ..observability.quiet_logs import filter_unactionable_warnings
from .accumulation import GradAccumulation
from .compile_blocks import check_compile_spec, compile_blocks
from .grad_norms import naming_our_grad_norm
from .guarded_collectives import GuardedCollectives
from .home_state import build_home_state
from .launch_checks import CheckingLauncher
from .layout_choice import (
    check_checkpointing_layouts,
    check_checkpointing_spec,
    checkpointing_for,
    choose_default_layout,
    default_layouts,
    parse_layout_spec,
    resolve_layouts,
)
from .lightning_compat import (
    accumulates,
    default_process_group_backend,
    init_dist_connection,
)
from .lightning_step import check_trainer, open_breadcrumbs, run_eval_step, run_training_step
from .metric_sync import StepMetricSync
from .nccl_runtime import apply_allocator_settings
from .nonfinite import NonFiniteHandler
from .planner_factory import PLANNER_NAMES, build_planner, check_planner_spec
from .precision import HotSPaPrecision, as_hotspa_precision
from .profiling import ProfilingFeedback
from .reliability import StepTracker, as_timeout, check_breadcrumb_dir, enable_nccl_flight_recorder, subgroup_timeout
from .strategy_options import ReliabilityOptions, RuntimeOptions, as_options, moved_keywords

__all__ = ["PLANNER_NAMES", "HotSPaStrategy", "ReliabilityOptions", "RuntimeOptions", "default_layouts"]


_REDUCE_DTYPES = {"fp32": None, "bf16": torch.bfloat16}


class HotSPaStrategy(GuardedCollectives, StrategyCheckpoints, ParallelStrategy):
    """Hot-switching parallel layouts (dp x tp x cp) per length bucket inside one optimizer step.

    Args:
        layouts: candidate layouts (``Layout``, ``"dp2xtp2"`` or ``{"dp": 2, "tp": 2}``), or ``"auto"``.
        tokens_per_rank: activation-token capacity of one rank; a layout's micro-batch capacity is
            ``tokens_per_rank * tp * cp``.
        planner: ``"rule"`` (each document to the most data-parallel layout that holds it),
            ``"cost"`` (the cost-model solver, :class:`~lightning_hotspa.planner.CostModelPlanner`),
            ``"cost-profiled"`` (the same, refitting its coefficients to the measured stage times),
            ``"cost-measured"`` (issue 53: its guard trusts each option's measured speed,
            :mod:`~lightning_hotspa.planner.profiled.measured_planner`; its exploration budget: an instance),
            or a ready :class:`~lightning_hotspa.planner.base.Planner`.
        hardware: hardware profile name for ``planner="cost"`` (e.g. ``"cpu-gloo"``, ``"h200"``);
            default: the profile of the device it runs on (``cpu-gloo`` on CPU).
        activation_checkpointing: ``"none"`` / ``"selective"`` / ``"full"`` for all layouts (``False`` /
            ``True`` mean none / full), ``"auto"`` (the cost planner decides per stage among the three;
            other planners: full where tp*cp > 1) or a list of layouts that checkpoint fully (each one
            of the candidate layouts, else a LayoutError naming it).
        default_layout: the layout plain (non-plan) batches, validation and prediction run in;
            default: the most data-parallel candidate.
        nonfinite: what a NaN/Inf micro-batch loss does, decided alike on every rank before the
            optimizer step: ``"stop"`` (default; raises ``NonFiniteLossError`` naming the step, stage,
            layout and micro-batch) or ``"skip"`` (no update for that step; logged with its plan).
        timeout: the process-group timeout (a ``timedelta`` or seconds): how long a rank waits in a
            collective for a peer that hangs (a peer that dies is noticed at once on gloo).
        runtime: :class:`~.strategy_options.RuntimeOptions` (or a dict of its fields): compile_blocks, fp8,
            tp_regather, fsdp_reduce_dtype, the collective buckets, process_group_backend.
        reliability: :class:`~.strategy_options.ReliabilityOptions` (or a dict): subgroup_timeout, breadcrumb_dir.

    Lightning's own plumbing (accelerator, devices, cluster environment, checkpoint IO, precision) comes
    from the Trainer; a keyword that moved names its new place (``strategy_options.MOVED``).
    """

    strategy_name = "hotspa"

    @moved_keywords
    def __init__(
        self,
        layouts: Sequence[Layout | str | Mapping[str, int]] | str = "auto",
        *,
        tokens_per_rank: int = 4096,
        planner: Any = "rule",
        hardware: str | None = None,
        activation_checkpointing: bool | str | Sequence[Layout | str] = False,
        default_layout: Layout | str | None = None,
        nonfinite: str = "stop",
        timeout: timedelta | float = default_pg_timeout,
        runtime: RuntimeOptions | Mapping[str, Any] | None = None,
        reliability: ReliabilityOptions | Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__()  # accelerator, devices, environment, checkpoint IO, precision: set by the Trainer
        filter_unactionable_warnings()  # every rank builds a strategy: once per process
        run, rel = as_options(runtime, "runtime"), as_options(reliability, "reliability")
        self.runtime, self.reliability = run, rel
        self._layout_spec = parse_layout_spec(layouts)
        check_int(tokens_per_rank, "tokens_per_rank")
        check_planner_spec(planner, hardware)
        self.tokens_per_rank, self.hardware = tokens_per_rank, hardware
        self._planner_spec, self._ac_spec = planner, check_checkpointing_spec(activation_checkpointing)
        self._default_layout_spec = Layout.parse(default_layout) if default_layout is not None else None
        self._process_group_backend = run.process_group_backend
        self._timeout = as_timeout(timeout)
        self._subgroup_timeout = (None if rel.subgroup_timeout is None
                                  else as_timeout(rel.subgroup_timeout, "subgroup_timeout"))
        breadcrumb_dir = rel.breadcrumb_dir
        if breadcrumb_dir is not None and not isinstance(breadcrumb_dir, (str, os.PathLike)):
            raise TypeError(f"breadcrumb_dir must be a folder path (str or os.PathLike) or None, got "
                            f"{breadcrumb_dir!r}")
        check_breadcrumb_dir(breadcrumb_dir if breadcrumb_dir is not None else os.environ.get("HOTSPA_BREADCRUMB_DIR"))
        if self._layout_spec != "auto":  # explicit layouts: an activation_checkpointing list is checked now
            check_checkpointing_layouts(self._ac_spec, self._layout_spec, type(self).__name__)
        self._compile = check_compile_spec(run.compile_blocks)
        # collective bucket sizes (None: the backend's default, engine/buckets.py); checked here, sized at setup
        self._bucket_args = (run.bucket_mb, run.switch_buckets_in_flight, run.reduce_buckets_in_flight)
        bucket_defaults(run.process_group_backend, *self._bucket_args)
        if run.fsdp_reduce_dtype not in _REDUCE_DTYPES:
            raise ValueError(f"fsdp_reduce_dtype must be one of {sorted(_REDUCE_DTYPES)}, got "
                             f"{run.fsdp_reduce_dtype!r}")
        self._fsdp_reduce_dtype = _REDUCE_DTYPES[run.fsdp_reduce_dtype]
        if not isinstance(run.tp_regather, bool):
            raise TypeError(f"tp_regather must be True or False, got {run.tp_regather!r}")
        self._tp_regather = run.tp_regather
        self.fp8 = check_fp8(run.fp8)
        self._breadcrumb_dir = breadcrumb_dir if breadcrumb_dir is not None else os.environ.get("HOTSPA_BREADCRUMB_DIR")
        self.tracker = StepTracker()  # this rank's breadcrumb and the step's micro-batch losses
        self.nonfinite = NonFiniteHandler(nonfinite, self.tracker)
        self.profiling = ProfilingFeedback()
        self.metric_sync = StepMetricSync()  # sync_dist logging: one reduction per step (metric_sync.py)
        self._skip_update = False
        self.accumulation = GradAccumulation()
        self.num_nodes = 1
        self.world: WorldMesh | None = None
        self.layouts: tuple[Layout, ...] = ()
        self.mesh_shape: MeshShape | None = None
        self._planner: Planner | None = None
        self.engine: SwitchEngine | None = None
        self.parallel: ParallelModel | None = None
        self.runner: StepRunner | None = None
        self.home: dict[str, nn.Parameter] = {}
        self.last_step: StepResult | None = None  # the last training step's typed records (every rank)
        self.last_metrics: dict[str, float] = {}  # the last step's logged metrics (same on every rank)

    @property
    def skipped_steps(self) -> list[dict[str, Any]]:
        """Non-finite steps dropped under ``nonfinite="skip"``."""
        return self.nonfinite.skipped_steps

    @property
    def built_planner(self) -> Planner | None:
        """The planner if something has asked for it yet (the DataModule does at setup)."""
        return self._planner

    # ------------------------------------------------------------------ Lightning plumbing
    @property
    @override
    def precision_plugin(self) -> Precision:
        return self._precision_plugin if self._precision_plugin is not None else HotSPaPrecision()

    @precision_plugin.setter
    @override
    def precision_plugin(self, plugin: Precision | None) -> None:
        self._precision_plugin = None if plugin is None else as_hotspa_precision(plugin)

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
        if self._layout_spec != "auto":  # the world is known here, before any process starts
            resolve_layouts(self._layout_spec, self.num_processes * self.num_nodes, type(self).__name__)
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = CheckingLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    @override
    def setup_environment(self) -> None:
        if self.root_device.type == "cuda":  # before the first CUDA allocation; the user's setting wins
            apply_allocator_settings()
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = self._process_group_backend or default_process_group_backend(
            self.root_device)
        kwargs: dict[str, Any] = {"timeout": self._timeout}
        if self.root_device.type != "cpu":
            kwargs["device_id"] = self.root_device
        enable_nccl_flight_recorder(self._process_group_backend)  # before the process group exists
        init_dist_connection(self.cluster_environment, self._process_group_backend, **kwargs)
        self.tracker.rank = self.global_rank
        world_size = dist.get_world_size()
        self.layouts = resolve_layouts(self._layout_spec, world_size, type(self).__name__,
                                       module=self.lightning_module)
        check_checkpointing_layouts(self._ac_spec, self.layouts, type(self).__name__)
        self.world = WorldMesh(self.layouts, device_type=self.root_device.type,
                               timeout=subgroup_timeout(self._process_group_backend, self._timeout,
                                                        self._subgroup_timeout))
        self.mesh_shape = self.world.shape
        self.checkpoints = placement_for(self)  # the rank -> node map and where checkpoints live

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank

    @property
    def planner(self) -> Planner:
        """The step planner the DataModule builds plans with (built on first use)."""
        if self._planner is None:
            if not self.layouts:
                raise RuntimeError("the planner is available once the processes are set up")
            self._planner = build_planner(self._planner_spec, self.layouts, tokens_per_rank=self.tokens_per_rank,
                                          hardware=self.hardware, device=self._device_or_cpu(),
                                          module=self.lightning_module, activation_checkpointing=self._ac_spec,
                                          tp_regather=self._tp_regather)
        return self._planner

    def _device_or_cpu(self) -> torch.device:  # no Trainer has given devices yet (a bare strategy)
        return self.root_device if self.parallel_devices else torch.device("cpu")

    def planning_context(self) -> PlanningContext | None:
        """What the DataModule plans with; None until the processes are set up."""
        if not self.layouts or self.mesh_shape is None:
            return None
        return PlanningContext(self.planner, self.mesh_shape, self.global_rank, self.world_size)

    @property
    def default_layout(self) -> Layout:
        return choose_default_layout(self._default_layout_spec, self.layouts)

    def activation_checkpointing_for(self, layout: Layout) -> Checkpointing:
        """What the strategy adds to a stage's own flag. Under ``"auto"`` a planner that decides
        checkpointing per stage (the cost planner) is followed: forcing it on every tp*cp > 1 layout
        would recompute stages it planned (and priced) without recomputation."""
        if self._ac_spec == "auto" and isinstance(self._planner, PricedPlanner) and self._planner.decides_checkpointing:
            return Checkpointing.NONE
        return checkpointing_for(self._ac_spec, layout)

    # ------------------------------------------------------------------ setup
    @override
    def setup(self, trainer: Any) -> None:
        assert self.accelerator is not None and self.model is not None and self.world is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        check_trainer(trainer, module, type(self).__name__)
        number_lightning_bars(trainer)  # Lightning's Rich bar under max_steps alone: not "Epoch 0/-2"
        if self._precision_plugin is None:
            self._precision_plugin = HotSPaPrecision()
        self.hotspa_precision.enable_autocast(self.root_device.type if getattr(module, "tp_plan", None) is None
                                              else None)
        if not (self.home and all(p is self.home.get(n) for n, p in module.named_parameters())):
            # a new module (not fit, then validate on the same one: hooks and home state stay)
            state = build_home_state(module, self.world, home_dtype=self.hotspa_precision.home_dtype,
                                     working_dtype=self.hotspa_precision.working_dtype, device=self.root_device,
                                     grad_accum_dtype=self.hotspa_precision.grad_accum_dtype,
                                     buckets=bucket_defaults(self._process_group_backend,
                                                             *self._bucket_args).engine_kwargs(),
                                     tp_regather=self._tp_regather,
                                     # compiled blocks: tp's plain collectives (the column regions' gloo
                                     # ring is not traceable yet; DESIGN §7 "torch.compile" (4))
                                     tp_overlap=self._compile is None, fp8=self.fp8)
            self.home, self.parallel, self.engine = state.home, state.parallel, state.engine
            self.runner = StepRunner(self.engine, self.parallel, device=self.root_device,
                                     activation_checkpointing=self.activation_checkpointing_for,
                                     fsdp_reduce_dtype=self._fsdp_reduce_dtype)
            if self._compile is not None:
                # after the parallel forwards: they are traced
                compile_blocks(module, self._compile, len(self.world.layouts))
        open_breadcrumbs(self.tracker, self._breadcrumb_dir, self._process_group_backend, trainer, self.global_rank)
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            check_checkpoint_dirs(trainer, is_rank_zero=self.global_rank == 0, broadcast=self.broadcast,
                                  probe=self.checkpoints.mode, local=self.checkpoints.local)
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()

    @contextlib.contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Any:
        """``init_module(empty_init=True)``: on the meta device; ``setup`` inits each home shard."""
        with (torch.device("meta") if empty_init else contextlib.nullcontext()), \
                self.precision_plugin.tensor_init_context():
            yield

    @override
    def model_to_device(self) -> None:  # home parameters are created on the root device
        pass

    # ------------------------------------------------------------------ the step
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Tensor:
        assert self.runner is not None
        batch, batch_idx = args[0], (args[1] if len(args) > 1 else kwargs.get("batch_idx", 0))
        module = self.lightning_module
        self.tracker.begin_step(module.trainer.global_step, batch_idx,
                                len(batch.stages) if isinstance(batch, RankPlan) else 1)
        with self.tracker.guard():
            result, self.last_metrics = run_training_step(self, batch, batch_idx)
            self.last_step, self._skip_update = result, result.skip_update
            return result.loss.to(torch.float64 if self.hotspa_precision.home_dtype == torch.float64
                                   else torch.float32)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        """Gradients were computed and reduced inside ``training_step``; hand them to the home params
        now, after Lightning's ``zero_grad`` (docs/DESIGN.md §7, trap "Lightning's closure order")."""
        assert self.engine is not None
        trainer = self.lightning_module.trainer
        if trainer.accumulate_grad_batches > 1:  # N batches per optimizer step, summed by the engine
            self.accumulation.finish(self.home, self.engine, skip=self._skip_update, last=not accumulates(trainer))
        else:
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
        with self.tracker.guard(), naming_our_grad_norm():  # guard: clipping's all-reduce (the step: the closure)
            return super().optimizer_step(optimizer, closure, model, **kwargs)

    # ------------------------------------------------------------------ evaluation
    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return run_eval_step(self, "validation_step", args, kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return run_eval_step(self, "test_step", args, kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return run_eval_step(self, "predict_step", args, kwargs)

    @override
    def teardown(self) -> None:
        if self.parallel is not None and self.home:
            self.parallel.restore(self.home)
        assert self.cluster_environment is not None and self.accelerator is not None
        self.tracker.close_file()
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()


