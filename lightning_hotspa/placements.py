"""Where each parameter lives: its home sharding and its sharding in every layout.

A parameter role says which tensor dim tensor parallelism splits and what its gradient looks like
across tp ranks. Every placement in this project is "split one tensor dim over a PREFIX of the mesh
dims, replicate over the rest", so a placement is fully described by that prefix length:

* in a layout the prefix is the layout's tp dims (sharded roles) or empty (replicated roles);
* at home it is the longest prefix whose size product divides the tensor dim (ZeRO-3-like storage,
  never an uneven DTensor split: docs/DESIGN.md §7, trap "uneven shards").

Because tp dims are a prefix too, a layout chunk always contains this rank's home chunk, so
home -> layout needs only an all-gather of what is missing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from torch.distributed.tensor import Placement, Replicate, Shard

from .layout import Layout, LayoutError, MeshShape

__all__ = ["Role", "ROLES", "TPRole", "ParamSharding", "build_shardings", "role_of"]

GradState = Literal["shard", "replicate", "partial"]
#: The role names a model's tensor-parallel plan may use (``models.tp_plan`` explains each one).
TPRole = Literal["colwise", "rowwise", "vocab", "replicated", "replicated_partial", "sequence"]


@dataclass(frozen=True)
class Role:
    """``shard_dim``: the tensor dim tp splits (None: not split). ``tp_grad``: the working gradient
    across tp ranks: its own shard, identical copies, or partial sums that must be added."""

    name: str
    shard_dim: int | None
    tp_grad: GradState


ROLES: dict[str, Role] = {
    "colwise": Role("colwise", 0, "shard"),
    "rowwise": Role("rowwise", 1, "shard"),
    "vocab": Role("vocab", 0, "shard"),
    "replicated": Role("replicated", None, "replicate"),
    "replicated_partial": Role("replicated_partial", None, "partial"),
    # the same weight on every tp rank applied to this rank's sequence shard (sequence parallelism:
    # norms, a row-parallel bias): each rank's gradient covers its tokens only, a partial sum over tp
    "sequence": Role("sequence", None, "partial"),
}


def role_of(role: Role | str) -> Role:
    """The :class:`Role` named ``role``; an unknown name raises :class:`LayoutError` (a ValueError)."""
    if isinstance(role, Role):
        return role
    if role not in ROLES:
        raise LayoutError(f"unknown tensor-parallel role {role!r}; known roles: {sorted(ROLES)}")
    return ROLES[role]


@dataclass(frozen=True)
class ParamSharding:
    """One parameter's shape, role and shardings on a given mesh shape."""

    name: str
    shape: tuple[int, ...]
    role: Role
    mesh: MeshShape
    dim: int | None  # the tensor dim that is split at home and (for sharded roles) in layouts
    home_prefix: int  # number of leading mesh dims the home copy is split over

    def layout_prefix(self, layout: Layout) -> int:
        return len(self.mesh.tp_dims(layout)) if self.role.shard_dim is not None else 0

    def placements(self, prefix: int) -> list[Placement]:
        return [Shard(self.dim) if i < prefix else Replicate() for i in range(self.mesh.ndim)]

    def home_placements(self) -> list[Placement]:
        return self.placements(self.home_prefix)

    def layout_placements(self, layout: Layout) -> list[Placement]:
        return self.placements(self.layout_prefix(layout))

    def num_chunks(self, prefix: int) -> int:
        return math.prod(self.mesh.sizes[:prefix])

    def local_shape(self, prefix: int) -> tuple[int, ...]:
        if prefix == 0:
            return self.shape
        shape = list(self.shape)
        shape[self.dim] //= self.num_chunks(prefix)
        return tuple(shape)

    def interval(self, rank: int, prefix: int) -> tuple[int, int]:
        """[start, stop) of ``rank``'s chunk along ``dim`` (the whole dim for prefix 0)."""
        if self.dim is None:
            return (0, 1)
        length = self.shape[self.dim] // self.num_chunks(prefix)
        start = self.mesh.shard_index(rank, range(prefix)) * length
        return (start, start + length)

    def grad_states(self, layout: Layout) -> list[GradState]:
        """Per mesh dim, what the working gradient in ``layout`` is: shard / replicate / partial."""
        tp = len(self.mesh.tp_dims(layout))
        return [self.role.tp_grad if i < tp else "partial" for i in range(self.mesh.ndim)]


def build_shardings(
    shapes: Mapping[str, tuple[int, ...]], roles: Mapping[str, Role | str], mesh: MeshShape
) -> dict[str, ParamSharding]:
    """Validates every parameter against every layout and picks its home sharding."""
    missing = sorted(set(shapes) - set(roles))
    if missing:
        raise LayoutError(f"no role given for parameters {missing}")
    out: dict[str, ParamSharding] = {}
    for name, shape in shapes.items():
        role, shape = role_of(roles[name]), tuple(int(s) for s in shape)
        if role.shard_dim is not None:
            if len(shape) <= role.shard_dim:
                raise LayoutError(f"parameter {name!r} of shape {shape} has no dim {role.shard_dim} for role "
                                  f"{role.name!r}")
            dim = role.shard_dim
            for layout in mesh.layouts:
                if shape[dim] % layout.tp:
                    raise LayoutError(
                        f"parameter {name!r} (role {role.name!r}) has size {shape[dim]} on dim {dim}, "
                        f"which tp={layout.tp} of layout {layout} does not divide"
                    )
        else:
            dim = 0 if shape else None
        home_prefix = 0
        if dim is not None:
            acc = 1
            for i, size in enumerate(mesh.sizes):
                acc *= size
                if shape[dim] % acc:
                    break
                home_prefix = i + 1
        out[name] = ParamSharding(name, shape, role, mesh, dim, home_prefix)
    return out
