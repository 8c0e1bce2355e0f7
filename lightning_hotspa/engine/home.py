"""The home state: each rank's shard of every parameter, as DTensor ``nn.Parameter``s.

Start-up scales with the shard when the caller can initialize a region of a parameter alone
(``init_shard``, e.g. :func:`lightning_hotspa.models.init.init_parameter`'s tiled scheme, whose values
do not depend on the region asked for): each rank then generates only the rows (or columns) it holds,
on CPU, and moves that shard to its device. Without ``init_shard`` every rank builds each FULL
parameter and slices it (one parameter at a time, so peak memory is one full tensor).
Either way the result equals the single-process model (docs/DESIGN.md §7, trap "random init of sharded DTensors").
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..layout import LayoutError
from ..mesh import WorldMesh
from ..placements import ParamSharding
from .gradients import sub_chunk

__all__ = ["build_home_parameters", "region_initializer", "InitShard"]

#: ``(name, shape, dim, start, stop) -> tensor``: the parameter's slice ``[start, stop)`` along ``dim``
#: (``dim`` None: the whole parameter), equal to that slice of its full initial value
InitShard = Callable[[str, tuple[int, ...], "int | None", int, int], torch.Tensor]


def region_initializer(init_parameter: Callable[..., torch.Tensor]) -> InitShard | None:
    """An :data:`InitShard` from a module's ``init_parameter(name, *, dim, start, stop)``, or None if
    it takes no region (then each rank must build full parameters)."""
    try:
        params = inspect.signature(init_parameter).parameters
    except (TypeError, ValueError):
        return None
    if not {"dim", "start", "stop"} <= set(params):
        return None
    return lambda name, shape, dim, start, stop: init_parameter(name, dim=dim, start=start, stop=stop)


def build_home_parameters(
    world: WorldMesh,
    shardings: Mapping[str, ParamSharding],
    init_full: Callable[[str, tuple[int, ...]], torch.Tensor] | None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    *,
    init_shard: InitShard | None = None,
) -> dict[str, nn.Parameter]:
    """Home params as DTensor ``nn.Parameter``s holding this rank's shard of each parameter.

    ``init_shard`` (preferred) generates only this rank's slice; else ``init_full`` builds the full
    tensor, which is cut (one parameter at a time).
    """
    if init_full is None and init_shard is None:
        raise ValueError("build_home_parameters needs init_full or init_shard")
    out: dict[str, nn.Parameter] = {}
    rank = world.rank
    for name, sharding in shardings.items():
        expected = sharding.local_shape(sharding.home_prefix)
        if init_shard is not None:
            start, stop = sharding.interval(rank, sharding.home_prefix)
            if sharding.home_prefix == 0 or sharding.dim is None:
                local = init_shard(name, sharding.shape, None, 0, 0)
            else:
                local = init_shard(name, sharding.shape, sharding.dim, start, stop)
            what = "init_shard"
        else:
            full = init_full(name, sharding.shape)
            if tuple(full.shape) != sharding.shape:
                raise LayoutError(f"init for {name!r} returned shape {tuple(full.shape)}, expected {sharding.shape}")
            local = sub_chunk(full, sharding, 0, sharding.home_prefix, rank).to(device, dtype).contiguous().clone()
            del full
            what = "init_full"
        if tuple(local.shape) != tuple(expected):
            raise LayoutError(f"{what} for {name!r} returned shape {tuple(local.shape)}, expected this "
                              f"rank's shard {tuple(expected)}")
        local = local.to(device, dtype).contiguous()
        dt = DTensor.from_local(local, world.device_mesh, sharding.home_placements(), run_check=False,
                                shape=torch.Size(sharding.shape),
                                stride=torch.empty(sharding.shape, device="meta").stride())
        out[name] = nn.Parameter(dt)
    return out
