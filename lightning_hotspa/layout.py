"""Parallel layouts and the arithmetic of the ONE world mesh that hosts all of them.

A layout is a ``dp x tp x cp`` factorization of the world. DTensor cannot redistribute between two
different ``DeviceMesh`` objects, so the world is factorized once into mesh dims and every layout is a
role assignment of those dims: tp takes a PREFIX of the dims, cp the dims right after, dp the rest.

Mesh dim 0 is the most local (consecutive ranks) and is the OUTER split when DTensor shards one tensor
dim over several mesh dims. With tp always on a prefix, a smaller tp uses the first dims of a larger
tp, so tp degrees nest: tp up is a local slice, tp down an all-gather of exactly the missing part
(docs/DESIGN.md §7, trap "nested sharding order"). The price is that a rank's shard index inside a
multi-dim group is not its rank order in a ``dist.new_group`` (which sorts ranks);
:class:`~lightning_hotspa.mesh.RankGroup` carries the mapping.

Everything here is pure integer arithmetic, so data-loader workers can compute a rank's coordinates
without process groups; the mesh and its process groups are built in :mod:`lightning_hotspa.mesh`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .checks import check_int, is_int
from .cp_kinds import CP_KINDS, CP_SUFFIX, kind_of, parse_suffix

__all__ = ["Layout", "LayoutError", "MeshShape", "parse_layouts", "require_member"]


class LayoutError(ValueError):
    """A layout or a set of layouts that cannot be used; the message names the offending value."""


_ROLE = r"(dp|tp|cp|pp)(\d+)"
_LAYOUT_RE = re.compile(rf"^{_ROLE}(?:\s*[x×*]\s*{_ROLE})*(?:{CP_SUFFIX})?(?::fsdp(\d+)?)?$")
_PART_RE = re.compile(_ROLE)
_KV_RE = re.compile(rf"(?:{CP_SUFFIX})$")  # a cp kind's name suffix (cp_kinds.py)
_FSDP_RE = re.compile(r":fsdp(\d+)?$")


@dataclass(frozen=True, kw_only=True)
class Layout:
    """One parallel strategy: data x tensor x context (x pipeline) parallel degrees (product = world size).

    Keyword-only: ``Layout(dp=2, tp=2)``; ``Layout.parse("dp2xtp2")`` reads a name.

    ``cp_kv`` says how context parallelism is done, its kind (:mod:`lightning_hotspa.cp_kinds`, the
    registry): 1 (default) is Ulysses over all ``cp`` ranks; ``cp_kv == cp`` is all-gather-KV over all
    of them (name suffix ``:kv``); in between is the hybrid, Ulysses over the ``cp // cp_kv`` most
    local cp ranks (inside a node) and all-gather-KV over ``cp_kv`` groups of them (``:kv<cp_kv>``).

    ``fsdp`` (name suffix ``:fsdp``): the working copy is also sharded over the layout's dp and cp
    ranks (ZeRO-3 / FSDP inside the layout) and gathered layer by layer; False: each tp shard of the
    working copy is replicated over dp and cp (more memory, no per-layer traffic).

    ``fsdp_shard`` (suffix ``:fsdp<n>``): over how many dp x cp ranks the working copy is sharded,
    the ``n`` most local ones after the tp group (cp ranks first, then dp), replicated over the rest
    (HSDP: the per-layer gathers stay inside a node while the model is split over it). It defaults
    to all ``dp * cp`` of them (plain ``:fsdp``); it is ``dp * cp`` or a proper divisor > 1 of it.

    ``pp`` (name part ``pp<n>``): pipeline stages over the OUTERMOST mesh dims (after tp, cp and dp:
    a stage's tp ranks stay node-local); run by :mod:`lightning_hotspa.parallel.pipeline` with
    ``torch.distributed.pipelining``. A sharded copy (``:fsdp``) with ``pp > 1`` is refused
    (:meth:`check_runnable`).
    """

    dp: int = 1
    tp: int = 1
    cp: int = 1
    pp: int = 1
    cp_kv: int = 1
    fsdp: bool = False
    fsdp_shard: int = 0

    def __post_init__(self) -> None:
        for field in ("dp", "tp", "cp", "pp", "cp_kv"):
            check_int(getattr(self, field), f"Layout.{field}", error=LayoutError)
        if not isinstance(self.fsdp, bool):
            raise LayoutError(f"Layout.fsdp must be True or False, got {self.fsdp!r}")
        if self.fsdp and self.dp * self.cp == 1:
            raise LayoutError(f"layout {self.name}: fsdp shards the working copy over the dp and cp ranks, but "
                              f"dp = cp = 1")
        self._check_fsdp_shard()
        if self.cp % self.cp_kv:
            raise LayoutError(f"Layout.cp_kv={self.cp_kv} must divide cp={self.cp} (the all-gather-KV part of "
                              f"context parallelism is a factor of it)")

    def _check_fsdp_shard(self) -> None:
        """Normalizes ``fsdp_shard`` 0 to ``dp * cp`` and rejects a shard count that does not divide it."""
        shard, group = self.fsdp_shard, self.dp * self.cp
        if not is_int(shard):
            raise LayoutError(f"Layout.fsdp_shard must be an int, got {shard!r}")
        if not self.fsdp:
            if shard:
                raise LayoutError(f"Layout.fsdp_shard={shard} shards a working copy, but fsdp is False "
                                  f"(write e.g. 'dp8:fsdp{shard}')")
            return
        if shard == 0:
            object.__setattr__(self, "fsdp_shard", group)  # frozen: normalize once, so equal layouts compare equal
        elif shard < 2 or group % shard:
            name = Layout(dp=self.dp, tp=self.tp, cp=self.cp, pp=self.pp, cp_kv=self.cp_kv).name
            raise LayoutError(f"layout {name}:fsdp{shard}: fsdp_shard={shard} must be > 1 and divide dp*cp = "
                              f"{group} (the ranks the working copy is sharded over)")

    def check_runnable(self) -> Layout:
        """This layout if the runtime can run it; a :class:`LayoutError` naming it if it pairs ``pp > 1``
        with a sharded working copy (``:fsdp``): the per-unit gathers and reduce-scatters run inside the
        pipeline schedule's own forward / backward order, which the fsdp units do not follow (not built)."""
        if self.pp != 1 and self.fsdp:
            raise LayoutError(f"layout {self.name}: pipeline parallelism (pp={self.pp}) with a sharded working "
                              f"copy (:fsdp) is not built (the fsdp units' per-unit gathers do not follow the "
                              f"pipeline schedule's order); use {self.degrees.name} (a replicated copy per stage)")
        return self

    @property
    def world_size(self) -> int:
        """Ranks the layout covers: ``dp * tp * cp * pp``."""
        return self.dp * self.tp * self.cp * self.pp

    @property
    def shards(self) -> int:
        """How many ways the working weights are split before any fsdp sharding (``tp * pp``)."""
        return self.tp * self.pp

    @property
    def cp_ulysses(self) -> int:
        """The Ulysses (head-scattering) part of cp: all of it by default, 1 for pure all-gather-KV."""
        return self.cp // self.cp_kv

    @property
    def token_granule(self) -> int:
        """A micro-batch capacity that is a multiple of this holds its micro-batches after
        ``pack_micro_batch``'s sequence-parallel padding (a rank's ``tokens / cp``, even under cp,
        made a multiple of tp): ``tp`` without cp, ``cp * lcm(2, tp)`` with it."""
        return self.tp if self.cp == 1 else self.cp * math.lcm(2, self.tp)

    @property
    def cp_kind(self) -> str:
        """The name of its kind of context parallelism in :data:`~lightning_hotspa.cp_kinds.CP_KINDS`:
        ``"ulysses"``, ``"kv"`` (all-gather-KV over the whole cp group) or ``"hybrid"``."""
        return kind_of(self.cp, self.cp_kv).name

    @property
    def degrees(self) -> Layout:
        """The same degrees and cp kind with a replicated working copy (the compute path's groups)."""
        return Layout(dp=self.dp, tp=self.tp, cp=self.cp, pp=self.pp, cp_kv=self.cp_kv) if self.fsdp else self

    @property
    def fsdp_replicas(self) -> int:
        """Copies of each working-copy shard across the dp x cp ranks: 1 for plain ``:fsdp``, more
        for an HSDP one (``:fsdp<n>``), ``dp*cp`` for a replicated copy."""
        return self.dp * self.cp // self.fsdp_shard if self.fsdp else self.dp * self.cp

    @property
    def lockstep(self) -> bool:
        """True if a sharded copy's per-unit collectives span dp groups (its shard reaches beyond the
        cp group), so the dp groups run in lockstep rounds (idle rounds for the less busy); a shard
        inside the cp group does not: every rank of it computes the same micro-batches."""
        return self.fsdp and self.fsdp_shard > self.cp

    @property
    def name(self) -> str:
        """``"dp2xtp2"``, ``"tp2xcp4:kv"``, ``"cp8:kv2"``, ``"dp8xtp4:fsdp"``, ``"dp64:fsdp8"``,
        ``"dp2xtp2xpp2"``: the degrees above 1, then the all-gather-KV part of cp, then the sharded
        working copy and, when it is sharded over fewer than all dp x cp ranks, over how many."""
        parts = [f"{k}{v}" for k, v in (("dp", self.dp), ("tp", self.tp), ("cp", self.cp), ("pp", self.pp))
                 if v > 1]
        base = "x".join(parts) or "dp1"
        base += CP_KINDS[self.cp_kind].suffix_of(self.cp, self.cp_kv)
        if not self.fsdp:
            return base
        return base + (":fsdp" if self.fsdp_shard in (0, self.dp * self.cp) else f":fsdp{self.fsdp_shard}")

    def __str__(self) -> str:
        return self.name

    @classmethod
    def parse(cls, spec: Layout | str | Mapping[str, int]) -> Layout:
        """Reads a layout from user input.

        Args:
            spec: a Layout, a mapping ``{"dp": 2, "tp": 2}`` (``"pp"``, ``"cp_kv"``, ``"fsdp"`` and
                ``"fsdp_shard"`` too) or a name like ``"dp2xtp2"``, ``"tp2xcp4:kv"`` (all-gather-KV),
                ``"cp8:kv2"`` (hybrid: Ulysses over 4, all-gather-KV over 2), ``"dp8xtp4:fsdp"``
                (sharded working copy) or ``"dp64:fsdp8"`` (sharded over 8 ranks, replicated over
                the other 8 x).
        """
        if isinstance(spec, Layout):
            return spec
        if isinstance(spec, Mapping):
            unknown = set(spec) - {"dp", "tp", "cp", "pp", "cp_kv", "fsdp", "fsdp_shard"}
            if unknown:
                raise LayoutError(f"layout {dict(spec)!r} has unknown keys {sorted(unknown)}; use dp, tp, cp, "
                                  f"pp, cp_kv, fsdp, fsdp_shard")
            return cls(**{k: spec[k] for k in spec})
        if isinstance(spec, str):
            return _from_name(spec)
        raise LayoutError(f"cannot interpret {spec!r} (type {type(spec).__name__}) as a layout")

    def to_state(self) -> dict[str, int | bool]:
        """The layout as a record of its fields, for saved state (checkpointed planner coefficients);
        :meth:`from_state` reads it back without parsing a name."""
        return {"dp": self.dp, "tp": self.tp, "cp": self.cp, "pp": self.pp, "cp_kv": self.cp_kv,
                "fsdp": self.fsdp, "fsdp_shard": self.fsdp_shard}

    @classmethod
    def from_state(cls, record: Mapping[str, Any] | str) -> Layout:
        """Reads a layout that :meth:`to_state` saved.

        Args:
            record: a mapping with exactly the fields :meth:`to_state` writes, or a layout name (what
                planner states saved before the typed record).
        """
        if isinstance(record, str):
            return _from_name(record)
        if not isinstance(record, Mapping):
            raise LayoutError(f"a saved layout must be a mapping of its fields (Layout.to_state) or a name, got "
                              f"{record!r} ({type(record).__name__})")
        fields = {"dp", "tp", "cp", "pp", "cp_kv", "fsdp", "fsdp_shard"}
        if set(record) != fields:
            raise LayoutError(f"saved layout {dict(record)!r}: expected the fields {sorted(fields)}, missing "
                              f"{sorted(fields - set(record))}, unknown {sorted(set(record) - fields)}")
        return cls(**{k: record[k] for k in fields})


def _from_name(spec: str) -> Layout:
    """The layout a name such as ``"dp2xtp2"`` or ``"tp2xcp4:kv"`` denotes (:meth:`Layout.parse`).

    Args:
        spec: the name, as a user or an old saved state wrote it.
    """
    text = spec.strip().lower()
    if not _LAYOUT_RE.match(text):
        raise LayoutError(f"cannot parse layout {spec!r}; expected e.g. 'dp2xtp2', 'tp2xcp2', "
                          f"'tp2xcp4:kv', 'cp8:kv2', 'dp4:fsdp' or 'dp8:fsdp4'")
    fsdp_match = _FSDP_RE.search(text)
    fsdp, shard = fsdp_match is not None, 0
    if fsdp_match:
        shard = int(fsdp_match.group(1)) if fsdp_match.group(1) else 0
        if fsdp_match.group(1) and shard < 2:
            raise LayoutError(f"layout {spec!r}: ':fsdp{fsdp_match.group(1)}' must shard over 2 ranks or "
                              f"more (a working copy on 1 rank is a replicated one: drop ':fsdp')")
        text = text[:fsdp_match.start()]
    kv = _KV_RE.search(text)
    base = text[:kv.start()] if kv else text
    degrees: dict[str, int] = {}
    for role, value in _PART_RE.findall(base):
        if role in degrees:
            raise LayoutError(f"layout {spec!r} names {role} twice")
        degrees[role] = int(value)
    if kv:
        cp = degrees.get("cp", 1)
        if cp == 1:
            raise LayoutError(f"layout {spec!r}: ':kv' names a kind of context parallelism, but the "
                              f"layout has no cp > 1")
        degrees["cp_kv"] = parse_suffix(kv.group(0), cp)
    return Layout(**degrees, fsdp=fsdp, fsdp_shard=shard)


def require_member(layout: Any, layouts: Collection[Layout], among: str = "") -> Layout:
    """``layout`` if it is a :class:`Layout` in ``layouts``; else a :class:`LayoutError` naming it.

    Args:
        layout: what a caller passed (names are parsed at the edge, never here).
        layouts: the layouts it must be one of.
        among: how the message names ``layouts`` (e.g. "this mesh's layouts ").
    """
    if not isinstance(layout, Layout):
        raise LayoutError(f"expected a Layout, got {layout!r} ({type(layout).__name__}); parse names at the "
                          f"edge with Layout.parse")
    if layout not in layouts:
        raise LayoutError(f"layout {layout} is not among {among}{[str(x) for x in layouts]}")
    return layout


def parse_layouts(specs: Iterable[Layout | str | Mapping[str, int]], world_size: int) -> tuple[Layout, ...]:
    """Parses and validates a candidate layout set the runtime can run on ``world_size`` ranks.

    Args:
        specs: layouts or their user-facing forms (:meth:`Layout.parse`); no duplicates, no ``pp > 1``
            with ``:fsdp``.
        world_size: the ranks every layout must cover.
    """
    if isinstance(specs, (str, Mapping, Layout)):
        raise LayoutError(f"expected a list of layouts, got a single {specs!r}")
    layouts = tuple(Layout.parse(s).check_runnable() for s in specs)
    if not layouts:
        raise LayoutError("the layout list is empty; give at least one layout")
    check_int(world_size, "world size", error=LayoutError)
    for layout in layouts:
        if layout.world_size != world_size:
            raise LayoutError(
                f"layout {layout} covers {layout.world_size} ranks (dp*tp*cp*pp = "
                f"{layout.dp}*{layout.tp}*{layout.cp}*{layout.pp}), but the world size is {world_size}"
            )
    seen: set[Layout] = set()
    for layout in layouts:
        if layout in seen:
            raise LayoutError(f"layout {layout} is listed twice")
        seen.add(layout)
    return layouts


def _shard_index(coords: Sequence[int], sizes: Sequence[int], dims: Sequence[int]) -> int:
    """Mixed-radix index over ``dims``, first dim most significant: DTensor's nested chunk order."""
    index = 0
    for d in dims:
        index = index * sizes[d] + coords[d]
    return index


@dataclass(frozen=True)
class MeshShape:
    """The factorization of the world into mesh dims (dim 0 most local) and each layout's dims.

    Pure arithmetic: no process groups. ``tp_dims(layout)`` is a prefix range, ``cp_dims`` follows
    it, then ``dp_dims``; ``pp_dims`` are the outermost (the rest).
    """

    sizes: tuple[int, ...]
    layouts: tuple[Layout, ...]

    @classmethod
    def for_layouts(cls, layouts: Iterable[Layout | str | Mapping[str, int]], world_size: int) -> MeshShape:
        layouts = parse_layouts(layouts, world_size)
        def sizes_of(lay: Layout) -> set[int]:  # group sizes that must be mesh-dim boundaries
            shard = {lay.tp * lay.fsdp_shard} if lay.fsdp else set()
            pipe = {lay.tp * lay.cp * lay.dp} if lay.pp > 1 else set()
            return {lay.tp, lay.tp * lay.cp_ulysses, lay.tp * lay.cp} | shard | pipe

        boundaries = sorted(set().union(*(sizes_of(lay) for lay in layouts)) | {world_size})
        boundaries = [b for b in boundaries if b > 1]
        for small, large in zip(boundaries, boundaries[1:]):
            if large % small:
                culprits = [str(lay) for lay in layouts if small in sizes_of(lay) or large in sizes_of(lay)]
                raise LayoutError(
                    f"layouts {sorted(set(culprits))} cannot share one world mesh: their tp / tp*cp "
                    f"(or tp*Ulysses part of cp, tp*fsdp shard, or tp*cp*dp under pp) group sizes {small} and "
                    f"{large} do not nest "
                    f"(one must divide the other)"
                )
        sizes, previous = [], 1
        for b in boundaries:
            sizes.append(b // previous)
            previous = b
        return cls(tuple(sizes) or (1,), layouts)

    @property
    def world_size(self) -> int:
        return math.prod(self.sizes)

    @property
    def ndim(self) -> int:
        return len(self.sizes)

    def prefix_length(self, product: int) -> int:
        """Number of leading mesh dims whose sizes multiply to ``product``."""
        if product == 1:
            return 0
        acc = 1
        for i, size in enumerate(self.sizes):
            acc *= size
            if acc == product:
                return i + 1
        raise LayoutError(f"{product} is not a product of leading mesh dims {self.sizes}")

    def tp_dims(self, layout: Layout) -> range:
        return range(0, self.prefix_length(layout.tp))

    def cp_dims(self, layout: Layout) -> range:
        return range(self.prefix_length(layout.tp), self.prefix_length(layout.tp * layout.cp))

    def cp_ulysses_dims(self, layout: Layout) -> range:
        """The Ulysses part of cp: its most local dims (inside a node when they fit)."""
        return range(self.prefix_length(layout.tp), self.prefix_length(layout.tp * layout.cp_ulysses))

    def cp_kv_dims(self, layout: Layout) -> range:
        """The all-gather-KV part of cp: the cp dims after the Ulysses part."""
        return range(self.prefix_length(layout.tp * layout.cp_ulysses), self.prefix_length(layout.tp * layout.cp))

    def dp_dims(self, layout: Layout) -> range:
        return range(self.prefix_length(layout.tp * layout.cp), self.prefix_length(layout.tp * layout.cp * layout.dp)
                     if layout.pp > 1 else self.ndim)

    def pp_dims(self, layout: Layout) -> range:
        """The pipeline dims: the outermost ones, after dp (empty for ``pp == 1``)."""
        return range(self.dp_dims(layout).stop, self.ndim)

    def fsdp_dims(self, layout: Layout) -> range:
        """The dims a sharded working copy splits beyond tp: its ``fsdp_shard`` most local dp x cp
        ranks (empty for a replicated one)."""
        if not layout.fsdp:
            return range(0)
        return range(self.prefix_length(layout.tp), self.prefix_length(layout.tp * layout.fsdp_shard))

    def coords(self, rank: int) -> tuple[int, ...]:
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank {rank} is outside the world of {self.world_size} ranks")
        out, rest = [], rank
        for size in self.sizes:
            out.append(rest % size)
            rest //= size
        return tuple(out)

    def rank_of(self, coords: Sequence[int]) -> int:
        rank, stride = 0, 1
        for c, size in zip(coords, self.sizes):
            rank += c * stride
            stride *= size
        return rank

    def shard_index(self, rank: int, dims: Iterable[int]) -> int:
        return _shard_index(self.coords(rank), self.sizes, list(dims))

    def group_ranks(self, rank: int, dims: Iterable[int]) -> tuple[int, ...]:
        """Ranks that differ from ``rank`` only on ``dims``, in shard-index order."""
        dims = list(dims)
        base = list(self.coords(rank))
        count = math.prod(self.sizes[d] for d in dims)
        ranks = []
        for index in range(count):
            coords, rest = list(base), index
            for d in reversed(dims):
                coords[d] = rest % self.sizes[d]
                rest //= self.sizes[d]
            ranks.append(self.rank_of(coords))
        return tuple(ranks)

    def rank_coords(self, layout: Layout, rank: int) -> tuple[int, int, int]:
        """(dp_rank, tp_rank, cp_rank) of ``rank`` in ``layout``."""
        return (
            self.shard_index(rank, self.dp_dims(layout)),
            self.shard_index(rank, self.tp_dims(layout)),
            self.shard_index(rank, self.cp_dims(layout)),
        )

    def mesh_tensor(self) -> torch.Tensor:
        """Rank tensor for ``DeviceMesh``: element [c0, c1, ...] is the rank with those coords."""
        ranks = torch.arange(self.world_size).reshape(tuple(reversed(self.sizes)))
        return ranks.permute(*reversed(range(self.ndim))).contiguous()

    @property
    def dim_names(self) -> tuple[str, ...]:
        return tuple(f"m{i}" for i in range(self.ndim))
