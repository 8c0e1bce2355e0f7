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

from .group_collectives import GroupCollectives, collectives_for
from .layout import Layout, LayoutError, MeshShape, require_member

__all__ = ["RankGroup", "LayoutGroups", "WorldMesh"]


def _can_split() -> bool:
    """True where ``dist.split_group`` can make a range's groups in one call: an NCCL default group
    bound to a device (``init_process_group(device_id=...)``, as the strategy does on GPUs); gloo and
    the fake backend create one ``new_group`` per block instead."""
    import torch.distributed as dist

    default = dist.distributed_c10d._get_default_group()
    return (hasattr(dist, "split_group") and getattr(default, "bound_device_id", None) is not None
            and dist.get_backend(default) == "nccl")


@dataclass(frozen=True)
class RankGroup:
    """A process group over some mesh dims, seen from one rank.

    ``ranks`` are in shard-index order (DTensor's chunk order); ``group`` is None for a group of one.
    ``slot_of_shard[i]`` is the group rank (collective output slot) of the member with shard index i.
    ``desc`` names it in errors (mesh dims and ranks).
    """

    dims: tuple[int, ...]
    ranks: tuple[int, ...]
    index: int
    group: object | None
    desc: str = ""  # names the group in errors: its mesh dims and ranks

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

    @cached_property
    def backend(self) -> str | None:
        """The process group's backend (``"gloo"``, ``"nccl"``, ...), asked once; None for a group of one."""
        if self.group is None:
            return None
        import torch.distributed as dist

        return str(dist.get_backend(self.group))

    @cached_property
    def comm(self) -> GroupCollectives:
        """This group's row collectives, chosen once from :attr:`backend` (:mod:`.group_collectives`)."""
        return collectives_for(self)


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
    #: the pipeline group (ranks differing only on the pp dims; a stage's index is its slot in it)
    pp: RankGroup | None = None

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
    """The one ``DeviceMesh`` of the run plus the process groups over the mesh-dim ranges it uses.

    Built collectively (every rank, same arguments) after ``init_process_group``. Only the ranges
    something calls are created (docs/DESIGN.md §7, trap "Only the groups a run uses"): every layout's tp,
    cp, dp and cp parts here, and what the switch engine's moves and reductions need when it is built
    (:meth:`create_groups`, at setup). Creation is eager and in the same order on every rank, since
    ``dist.new_group`` must be called by all; a range asked for at run time that was not created
    raises (:meth:`group`), it is never created on first use (that could deadlock). ``timeout`` is
    their collective timeout: ``dist.new_group`` does not inherit the default group's, it takes
    torch's 30-minute default, so a hung peer in a tp / cp / dp collective would block that long (the
    ``DeviceMesh``'s own sub-groups, used off the step's hot path, keep torch's default).
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
        #: ``dist.new_group`` calls this rank made (every rank makes the same ones: world-wide creations)
        self.creations = 0
        self.create_groups(self.layout_ranges())

    def layout_ranges(self) -> list[tuple[int, int]]:
        """The ``[start, stop)`` mesh-dim ranges of every layout's tp, cp, dp, two cp parts and pp."""
        out = []
        for lay in self.layouts:
            for dims in (self.shape.tp_dims(lay), self.shape.cp_dims(lay), self.shape.dp_dims(lay),
                         self.shape.cp_ulysses_dims(lay), self.shape.cp_kv_dims(lay), self.shape.pp_dims(lay)):
                out.append((dims.start, dims.stop))
        return out

    def create_groups(self, ranges: Iterable[tuple[int, int]]) -> int:
        """Creates the groups of the ``[start, stop)`` mesh-dim ranges not created yet; returns how many.

        Collective: every rank must call it with the same ranges (their order does not matter: they
        are created sorted). Empty ranges are skipped (a group of one needs no process group).

        Args:
            ranges: ``(start, stop)`` pairs with ``0 <= start <= stop <= ndim``.
        """
        wanted = set()
        for start, stop in ranges:
            if not 0 <= start <= stop <= self.shape.ndim:
                raise LayoutError(f"mesh dims [{start}, {stop}) are not a range of the {self.shape.ndim} dims "
                                  f"of mesh {self.shape.sizes}")
            if stop > start and tuple(range(start, stop)) not in self._groups:
                wanted.add((start, stop))
        for start, stop in sorted(wanted):
            self._groups[tuple(range(start, stop))] = self._create_group(tuple(range(start, stop)))
        return len(wanted)

    @property
    def group_ranges(self) -> list[tuple[int, int]]:
        """The ``[start, stop)`` mesh-dim ranges whose groups exist, sorted."""
        return sorted((d[0], d[-1] + 1) for d in self._groups)

    @property
    def process_group_count(self) -> int:
        """Process groups this rank belongs to (groups of one excluded)."""
        return sum(g.group is not None for g in self._groups.values())

    def _create_group(self, dims: tuple[int, ...]) -> RankGroup:
        """This rank's group over ``dims``: every block of it created (by all ranks, same order)."""
        import torch.distributed as dist

        blocks: dict[tuple[int, ...], None] = {}  # insertion-ordered set
        mine: tuple[int, ...] = ()
        for rank in range(self.shape.world_size):  # every block, same order on every rank
            ranks = self.shape.group_ranks(rank, dims)
            blocks.setdefault(tuple(sorted(ranks)))
            if rank == self.rank:
                mine = ranks
        # the description names the group in NCCL's watchdog / flight-recorder errors (a timeout)
        desc = f"hotspa mesh dims {list(dims)} ranks {min(mine)}..{max(mine)} ({len(mine)})"
        pg = None
        if len(mine) > 1 and _can_split():  # one ncclCommSplit of the default communicator for all blocks
            pg = dist.split_group(parent_pg=None, split_ranks=[list(b) for b in blocks], timeout=self.timeout,
                                  group_desc=f"hotspa mesh dims {list(dims)} ({len(mine)} ranks per group)")
            self.creations += 1
        elif len(mine) > 1:
            for key in blocks:
                made = dist.new_group(list(key), timeout=self.timeout,
                                      group_desc=f"hotspa mesh dims {list(dims)} ranks {key[0]}..{key[-1]} "
                                                 f"({len(key)})")
                self.creations += 1
                if self.rank in key:
                    pg = made
        return RankGroup(dims, mine, mine.index(self.rank), pg, desc)

    def group(self, dims: Iterable[int], layout: Layout | None = None) -> RankGroup:
        """This rank's group over a contiguous range of mesh dims (empty range: a group of one).

        Args:
            dims: the mesh dims, a contiguous increasing range.
            layout: the layout that asks (named in the error if the group was never created).
        """
        dims = tuple(dims)
        if not dims:
            return RankGroup((), (self.rank,), 0, None)
        if dims != tuple(range(dims[0], dims[0] + len(dims))) or not 0 <= dims[0] <= dims[-1] < self.shape.ndim:
            raise LayoutError(f"mesh dims {dims} are not a contiguous range of the dims of mesh {self.shape.sizes}")
        if dims not in self._groups:
            who = f"layout {layout} needs" if layout is not None else "asked for"
            raise LayoutError(f"{who} a process group over mesh dims {list(dims)} of mesh {self.shape.sizes}, "
                              f"but setup created none for them (created: {self.group_ranges}); groups are made "
                              f"at setup only (WorldMesh.create_groups), never on first use")
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
            pp=self.group(self.shape.pp_dims(layout)),
        )
