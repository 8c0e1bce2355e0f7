"""The home state of a LightningModule: its parameters as fp32 DTensors sharded over the world.

Built once per module at ``setup``: every parameter's tensor-parallel role (from the module's
``tp_plan``), its shardings on the world mesh, the home parameters (each initialized in full, from
the module's weights or, for a module built on the meta device, its ``init_parameter(name)``, and
cut to this rank's shard, or only this rank's region where ``init_parameter`` takes one: tiled
seeds or a checkpoint slice read from disk), the :class:`ParallelModel` that points the module's layers at them, and
the :class:`SwitchEngine` that moves them between layouts. The optimizer, checkpoints and
``module.parameters()`` see these home parameters outside a step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_debug, rank_zero_info
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from ...engine.home import build_home_parameters, region_initializer
from ...engine.switch import SwitchEngine
from ...layout import LayoutError
from ...mesh import WorldMesh
from ...parallel.model import ParallelModel, uninstall_parallel
from ...placements import build_shardings

__all__ = ["HomeState", "build_home_state", "param_roles_of"]


@dataclass
class HomeState:
    home: dict[str, nn.Parameter]
    parallel: ParallelModel
    engine: SwitchEngine


def param_roles_of(module: nn.Module, max_tp: int) -> dict[str, str]:
    """Each parameter's tensor-parallel role; all ``replicated`` for a module without ``tp_plan``
    (allowed only when no layout has tp > 1)."""
    tp_plan = getattr(module, "tp_plan", None)
    if tp_plan is None:
        if max_tp > 1:
            raise LayoutError(f"layouts with tp={max_tp} need a tensor-parallel plan, but "
                              f"{type(module).__name__} defines no tp_plan(tp) method")
        return {n: "replicated" for n, _ in module.named_parameters()}
    from ...models.tp_plan import param_roles

    # tp degrees nest, so a plan valid for the largest tp is valid for every layout
    return param_roles(module, tp_plan(max_tp))


def build_home_state(module: nn.Module, world: WorldMesh, *, home_dtype: torch.dtype,
                     working_dtype: torch.dtype | None, device: torch.device,
                     grad_accum_dtype: torch.dtype | None = None, buckets: dict | None = None,
                     tp_regather: bool = True, tp_overlap: bool = True, fp8: str | None = None) -> HomeState:
    """Home parameters, parallel model and switch engine of ``module`` on ``world``; ``buckets``: the
    engine's bucket keyword arguments (``engine.buckets.BucketSizes.engine_kwargs``); ``tp_regather``:
    ``ParallelModel``'s (False keeps the column regions' gathered inputs); ``tp_overlap``: ``ParallelModel``'s
    (False under ``compile_blocks``: the column regions' gloo ring does not trace yet); ``fp8``: its
    torchao float8 recipe (None: off; parallel/fp8.py)."""
    shapes = {n: tuple(p.shape) for n, p in module.named_parameters()}
    roles = param_roles_of(module, max(x.tp for x in world.layouts))
    shardings = build_shardings(shapes, roles, world.shape)
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

    # a module that can initialize (or read from disk) one region alone: each rank makes only its shard
    init_shard = region_initializer(init_parameter) if on_meta else None
    home = build_home_parameters(world, shardings, full, dtype=home_dtype, device=device, init_shard=init_shard)
    uninstall_parallel(module)  # a module an earlier Trainer ran: its old forwards give way to ours
    parallel = ParallelModel(module, {n: s.role.name for n, s in shardings.items()}, world, tp_regather=tp_regather,
                             tp_overlap=tp_overlap, fp8=fp8)
    if fp8 is not None:
        rank_zero_info(f"hotspa: fp8 {fp8}: {len(parallel.fp8_linears)} linear layers run their GEMMs in FP8 "
                       f"(torchao; the rest in the working precision, parallel/fp8.py)")
    if parallel.loss_parallel:
        rank_zero_debug(f"hotspa: {type(module).__name__}.vocab_parallel_loss is True: under tp its "
                       f"loss_fn gets vocab-sharded logits (a vocab-parallel cross entropy)")
    parallel.restore(home)
    module.to(device)  # buffers; parameters already live there
    return HomeState(home, parallel, SwitchEngine(world, shardings, home, working_dtype=working_dtype,
                                                  grad_accum_dtype=grad_accum_dtype, **(buckets or {})))
