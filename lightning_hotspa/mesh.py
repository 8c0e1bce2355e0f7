"""The ONE world mesh of the run and its process groups (collective construction).

:class:`~lightning_hotspa.layout.MeshShape` is the pure arithmetic (which ranks share a group); this
module builds the ``DeviceMesh`` and the ``dist.new_group`` process groups from it, and says what a
rank needs of them for one layout (:class:`LayoutGroups`). A rank's shard index inside a multi-dim
group is not its rank order in a ``dist.new_group`` (which sorts ranks); :class:`RankGroup` carries
the mapping (docs/DESIGN.md §7).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from functools import cached_property

from .layout import Layout, LayoutError, MeshShape, require_member

__all__ = ["RankGroup", "LayoutGroups", "WorldMesh"]


@dataclass(frozen=True)
class RankGroup:
    """A process group over some mesh dims, seen from one rank.

    ``ranks`` are in shard-index order (DTensor's chunk order); ``group`` is None for a group of one.
    ``slot_of_shard[i]`` is the group rank (collective output slot) of the member with shard index i.
    """

    dims: tuple[int, ...]
    ranks: tuple[int, ...]
    index: int
    group: object | None

    @property
    def size(self) -> int:
        return len(self.ranks)

    @cached_property
    def slot_of_shard(self) -> tuple[int, ...]:
        sorted_ranks = sorted(self.ranks)  # dist.new_group orders members by global rank
        return tuple(sorted_ranks.index(r) for r in self.ranks)

    @property
    def in_shard_order(self) -> bool:
        return all(i == s for i, s in enumerate(self.slot_of_shard))


@dataclass(frozen=True)
class LayoutGroups:
    """What the compute path needs for one layout on this rank."""

    layout: Layout
    tp: RankGroup
    cp: RankGroup
    dp: RankGroup
    # the two parts of cp (``layout.cp_kv``): Ulysses over cp_ulysses, then all-gather-KV over cp_kv;
    # a rank's cp index is ``cp_ulysses.index * cp_kv.size + cp_kv.index`` (nested shard order)
    cp_ulysses: RankGroup | None = None
    cp_kv: RankGroup | None = None

    @property
    def tp_rank(self) -> int:
        return self.tp.index

    @property
    def cp_rank(self) -> int:
        return self.cp.index

    @property
    def dp_rank(self) -> int:
        return self.dp.index


class WorldMesh:
    """The one ``DeviceMesh`` of the run plus a process group for every contiguous range of its dims.

    Built collectively (every rank, same arguments) after ``init_process_group``. Groups are created
    eagerly and in the same order on every rank, since ``dist.new_group`` must be called by all.
    ``timeout`` is their collective timeout: ``dist.new_group`` does not inherit the default group's,
    it takes torch's 30-minute default, so a hung peer in a tp / cp / dp collective would block that
    long (the ``DeviceMesh``'s own sub-groups, used off the step's hot path, keep torch's default).
    """

    def __init__(self, layouts: Iterable[Layout | str | Mapping[str, int]], device_type: str = "cpu",
                 timeout: timedelta | None = None) -> None:
        import torch.distributed as dist
        from torch.distributed.device_mesh import DeviceMesh

        if not dist.is_initialized():
            raise RuntimeError("WorldMesh needs an initialized default process group")
        self.rank = dist.get_rank()
        self.shape = MeshShape.for_layouts(layouts, dist.get_world_size())
        self.layouts = self.shape.layouts
        self.device_type = device_type
        self.timeout = timeout
        self.device_mesh = DeviceMesh(device_type, self.shape.mesh_tensor(), mesh_dim_names=self.shape.dim_names)
        self._groups: dict[tuple[int, ...], RankGroup] = {}
        for start in range(self.shape.ndim):
            for stop in range(start + 1, self.shape.ndim + 1):
                self._groups[tuple(range(start, stop))] = self._create_group(tuple(range(start, stop)))

    def _create_group(self, dims: tuple[int, ...]) -> RankGroup:
        import torch.distributed as dist

        mine = None
        seen: set[tuple[int, ...]] = set()
        for rank in range(self.shape.world_size):  # every block, same order on every rank
            ranks = self.shape.group_ranks(rank, dims)
            key = tuple(sorted(ranks))
            if key in seen:
                continue
            seen.add(key)
            # the description names the group in NCCL's watchdog / flight-recorder errors (a timeout)
            desc = f"hotspa mesh dims {list(dims)} ranks {key[0]}..{key[-1]} ({len(key)})"
            pg = dist.new_group(list(key), timeout=self.timeout, group_desc=desc) if len(key) > 1 else None
            if self.rank in ranks:
                mine = RankGroup(dims, ranks, ranks.index(self.rank), pg)
        assert mine is not None
        return mine

    def group(self, dims: Iterable[int]) -> RankGroup:
        """This rank's group over a contiguous range of mesh dims (empty range: a group of one)."""
        dims = tuple(dims)
        if not dims:
            return RankGroup((), (self.rank,), 0, None)
        if dims not in self._groups:
            raise LayoutError(f"mesh dims {dims} are not a contiguous range of {self.shape.sizes}")
        return self._groups[dims]

    def layout_groups(self, layout: Layout) -> LayoutGroups:
        """This rank's tp / cp / dp groups (and the two parts of cp) of ``layout``, one of the mesh's."""
        require_member(layout, self.layouts, among="this mesh's layouts ")
        return LayoutGroups(
            layout,
            tp=self.group(self.shape.tp_dims(layout)),
            cp=self.group(self.shape.cp_dims(layout)),
            dp=self.group(self.shape.dp_dims(layout)),
            cp_ulysses=self.group(self.shape.cp_ulysses_dims(layout)),
            cp_kv=self.group(self.shape.cp_kv_dims(layout)),
        )
