"""The simple assignment rule: each length band runs in the most data-parallel layout that holds it.

This is the baseline planner (and, with ``fixed_layout``, every static baseline): no cost model,
only memory. A layout's micro-batch capacity is ``tokens_per_rank * tp * cp`` because activations
shard over tp (sequence-parallel regions) and cp (the sequence itself); dp does not help one document.

Choices, and why:

* **Most data-parallel first** (smallest ``tp*cp``): a document that fits on fewer ranks wastes
  nothing on tp/cp communication and splits no kernels.
* **Ties between equal ``tp*cp`` prefer cp** (``prefer="cp"``, configurable): both give the same
  capacity, but a cp layout keeps whole weights (so from a pure-dp layout it switches for free) and
  its Ulysses all-to-alls move ~``1/cp`` of the activations a tp layer's all-reduces move. The price
  is memory: cp replicates working parameters that tp would shard, which ``tokens_per_rank`` does
  not model; choose ``prefer="tp"`` when parameters dominate memory.
* **Bands** (buckets) default to one per used layout: ``(previous bound, longest document the
  layout holds]``. They can be set by hand as upper bounds, optionally with a layout each (like the
  HotSPa artifact's "<=4K: dp8; <=16K: dp2 x tp2 x cp2"); bands above the last hand-set one fall
  back to the defaults so every document some layout can hold is planned.
* **Backfill** (on by default): the micro-batches of a longer band usually have room left (a 10K
  document in a 16K micro-batch); the longest documents of shorter bands fill it, first-fit, before
  those bands are packed. Those micro-batches run anyway, so this only removes micro-batches from
  the more data-parallel stages, and when a short band fits entirely, a whole stage and its switch.
  ``backfill=False`` gives the pure rule.
* **Stage order: tp descending, then cp descending.** Working parameters depend only on tp (they
  are replicated over dp and cp), and tp degrees nest on the world mesh: going to a smaller tp is
  an all-gather of exactly the missing shards, going to a larger one a free local slice. Starting
  from the world-sharded home state with the largest tp makes the first materialization the
  smallest, and every later switch gathers only what is new, so each byte moves once and each
  gather can overlap the previous stage; stages with equal tp switch for free.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from ..activation_checkpointing import Checkpointing, parse_checkpointing_spec
from ..checks import check_int
from ..layout import Layout, LayoutError, MeshShape, parse_layouts
from ..plan import PlanError, Stage, StepPlan
from .base import PlannerBase
from .solve.packing import (
    DocCost,
    DocumentTooLongError,
    QuadraticCost,
    cp_padded_lengths,
    first_fit_decreasing,
    max_doc_length,
    pack_layout,
)

__all__ = ["Bucket", "ThresholdPlanner"]

LayoutSpec = Layout | str | Mapping[str, int]
BucketSpec = int | tuple[int, LayoutSpec]


@dataclass(frozen=True)
class Bucket:
    """Documents with ``low < length <= high`` run in ``layout``."""

    low: int
    high: int
    layout: Layout

    @property
    def label(self) -> str:
        return f"({self.low},{self.high}]"


def _positive_int(owner: str, name: str, value: Any) -> int:
    return check_int(value, f"{owner}: {name}", error=PlanError)


class ThresholdPlanner(PlannerBase):
    """Length bands -> layouts by memory alone; packing and dp balancing by :mod:`.solve.packing`.

    Implements the :class:`~lightning_hotspa.planner.base.Planner` protocol. Stateless: plans
    depend only on the constructor arguments and the document lengths.
    """

    def __init__(
        self,
        layouts: Iterable[LayoutSpec],
        tokens_per_rank: int,
        *,
        buckets: Sequence[BucketSpec] | None = None,
        fixed_layout: LayoutSpec | None = None,
        prefer: Literal["cp", "tp"] = "cp",
        cost_fn: DocCost | None = None,
        activation_checkpointing: Collection[LayoutSpec] | bool | str = (),
        backfill: bool = True,
    ) -> None:
        name = type(self).__name__
        specs = list(layouts) if not isinstance(layouts, (str, Mapping, Layout)) else layouts
        first = Layout.parse(specs[0]) if isinstance(specs, list) and specs else None
        self.layouts: tuple[Layout, ...] = parse_layouts(specs, first.world_size if first else 1)
        MeshShape.for_layouts(self.layouts, self.layouts[0].world_size)  # they must share one mesh
        self.tokens_per_rank = _positive_int(name, "tokens_per_rank", tokens_per_rank)
        if prefer not in ("cp", "tp"):
            raise PlanError(f"{name}: prefer must be 'cp' or 'tp', got {prefer!r}")
        self.prefer = prefer
        self.cost_fn: DocCost = cost_fn if cost_fn is not None else QuadraticCost()
        self.activation_checkpointing = self._full_checkpointing(activation_checkpointing)
        self.fixed_layout = None if fixed_layout is None else self._member(fixed_layout, "fixed_layout")
        if self.fixed_layout is not None and buckets is not None:
            raise PlanError(f"{name}: give either fixed_layout or buckets, not both")
        if self.fixed_layout is not None:
            lay = self.fixed_layout
            self.buckets = (Bucket(0, max_doc_length(self.capacity(lay), lay.cp), lay),)
        else:
            self.buckets = self._custom_buckets(buckets) if buckets is not None else self._default_buckets()
        # the bounds the user set by hand (the defaults after them follow the layouts' capacities)
        self.hand_set_bounds: tuple[int, ...] = tuple(b.high for b in self.buckets[:len(buckets or ())])
        used = {b.layout for b in self.buckets}
        self.stage_order: tuple[Layout, ...] = tuple(sorted(used, key=lambda x: (-x.tp, -x.cp)))
        self.backfill = bool(backfill)
        self._uppers = np.array([b.high for b in self.buckets], dtype=np.int64)
        # used layouts from the one holding the longest documents down (the backfill order)
        top = {lay: max(b.high for b in self.buckets if b.layout == lay) for lay in used}
        self._used: tuple[Layout, ...] = tuple(sorted(used, key=lambda x: (-top[x], -x.tp, -x.cp)))
        self._layout_index = np.array([self._used.index(b.layout) for b in self.buckets], dtype=np.int64)
        self._labels = {
            lay: "+".join(b.label for b in self.buckets if b.layout == lay) for lay in used
        }

    # -- configuration ---------------------------------------------------------------------
    def _full_checkpointing(self, spec: Any) -> frozenset[Layout]:
        """The layouts that checkpoint fully under ``activation_checkpointing=spec`` (the one grammar,
        :func:`~lightning_hotspa.activation_checkpointing.parse_checkpointing_spec`; this planner has no
        selective stages and does not decide: 'full' / True is every layout, 'none' / False none)."""
        try:
            parsed = parse_checkpointing_spec(spec)
        except ValueError as exc:
            raise PlanError(f"{type(self).__name__}: {exc}") from None
        if isinstance(parsed, tuple):
            return frozenset(self._member(x, "activation_checkpointing") for x in parsed)
        if parsed in (Checkpointing.FULL, Checkpointing.NONE):
            return frozenset(self.layouts) if parsed else frozenset()
        raise PlanError(f"{type(self).__name__}: activation_checkpointing={spec!r} is not built here (it "
                        f"checkpoints whole layouts: 'full', 'none' or a list of layouts); the "
                        f"CostModelPlanner decides 'auto' and prices 'selective'")

    def _member(self, spec: LayoutSpec, what: str) -> Layout:
        lay = Layout.parse(spec)
        if lay not in self.layouts:
            raise LayoutError(f"{type(self).__name__}: {what} layout {lay} is not among the "
                              f"candidate layouts {[str(x) for x in self.layouts]}")
        return lay

    def capacity(self, layout: Layout) -> int:
        """``tokens_per_rank * tp * cp``: activations shard over tp and cp, not over dp, nor over pp (1F1B's
        first stage holds ``pp`` micro-batches of its ``1 / pp`` of the layers: one micro-batch's worth)."""
        return self.tokens_per_rank * layout.tp * layout.cp

    def longest_fit(self, layout: Layout) -> int:
        """Longest document one micro-batch of ``layout`` holds (cp padding included)."""
        return max_doc_length(self.capacity(layout), layout.cp)

    def _ranked(self) -> list[Layout]:
        """Layouts from most to least data parallel; equal ``tp*cp`` ordered by ``prefer``."""
        def key(lay: Layout) -> tuple[int, int]:
            return (lay.tp * lay.cp, -lay.cp if self.prefer == "cp" else -lay.tp)
        return sorted(self.layouts, key=key)

    def _default_for(self, length: int) -> Layout | None:
        return next((lay for lay in self._ranked() if self.longest_fit(lay) >= length), None)

    def _default_buckets(self, above: int = 0) -> tuple[Bucket, ...]:
        out: list[Bucket] = []
        low = above
        for lay in self._ranked():
            high = self.longest_fit(lay)
            if high > low:
                out.append(Bucket(low, high, lay))
                low = high
        return tuple(out)

    def _custom_buckets(self, specs: Sequence[BucketSpec]) -> tuple[Bucket, ...]:
        name = type(self).__name__
        if isinstance(specs, (str, bytes)) or not specs:
            raise PlanError(f"{name}: buckets must be a non-empty list of upper bounds, got {specs!r}")
        out: list[Bucket] = []
        low = 0
        for spec in specs:
            bound, lay_spec = (spec, None) if not isinstance(spec, (tuple, list)) else tuple(spec)
            high = _positive_int(name, f"bucket bound in {spec!r}", bound)
            if high <= low:
                raise PlanError(f"{name}: bucket bounds must increase strictly; {high} follows {low}")
            if lay_spec is None:
                lay = self._default_for(high)
                if lay is None:
                    raise PlanError(f"{name}: bucket (.., {high}] is longer than every layout holds "
                                    f"(largest: {self._largest()})")
            else:
                lay = self._member(lay_spec, f"bucket (.., {high}]")
                if self.longest_fit(lay) < high:
                    raise PlanError(f"{name}: bucket ({low},{high}] cannot run in {lay}: its micro-batch "
                                    f"holds documents of at most {self.longest_fit(lay)} tokens")
            out.append(Bucket(low, high, lay))
            low = high
        return tuple(out) + self._default_buckets(above=low)

    def _largest(self) -> str:
        lay = max(self.layouts, key=lambda x: (self.longest_fit(x), x.cp))
        return f"{self.longest_fit(lay)} tokens in {lay}"

    # -- planning --------------------------------------------------------------------------
    def assign(self, doc_lengths: Sequence[int] | np.ndarray) -> np.ndarray:
        """Bucket index of every document; a document no bucket holds is an error naming it."""
        lengths = np.asarray(doc_lengths, dtype=np.int64)
        if lengths.ndim != 1:
            raise PlanError(f"doc_lengths must be 1-D, got shape {lengths.shape}")
        if lengths.size and int(lengths.min()) < 1:
            i = int(lengths.argmin())
            raise PlanError(f"document {i} has length {int(lengths[i])}; documents must be non-empty")
        band = np.searchsorted(self._uppers, lengths, side="left")
        if lengths.size and int(band.max()) >= len(self.buckets):
            i = int(np.argmax(band >= len(self.buckets)))
            raise DocumentTooLongError(
                f"document {i} has {int(lengths[i])} tokens, longer than any micro-batch of this "
                f"planner holds (largest capacity: {self.buckets[-1].high} tokens in {self.buckets[-1].layout})"
            )
        return band

    def layout_of(self, doc_lengths: Sequence[int] | np.ndarray) -> list[Layout]:
        """The layout every document runs in (after backfilling, if enabled)."""
        lengths = np.asarray(doc_lengths, dtype=np.int64)
        owner = self._layout_index[self.assign(lengths)]
        if self.backfill:
            self._backfill(lengths, owner)
        return [self._used[i] for i in owner.tolist()]

    def _backfill(self, lengths: np.ndarray, owner: np.ndarray) -> None:
        """Move shorter bands' documents into the room of longer bands' micro-batches (in place).

        Longest layout first: its documents are packed first-fit decreasing, then the longest
        documents of all shorter layouts take the free room first-fit. The micro-batches are there
        anyway, so this only removes micro-batches (and sometimes a whole stage and its switch).
        """
        for i, lay in enumerate(self._used):
            members = np.flatnonzero(owner == i)
            later = np.flatnonzero(owner > i)
            if members.size == 0 or later.size == 0:
                continue
            cap = self.capacity(lay)
            sizes = cp_padded_lengths(lengths[members], lay.cp)
            room = np.array([cap - int(sizes[b].sum()) for b in first_fit_decreasing(sizes, cap)])
            later = later[np.argsort(-lengths[later], kind="stable")]
            for doc, size in zip(later.tolist(), cp_padded_lengths(lengths[later], lay.cp).tolist(),
                                 strict=True):
                if size > room.max():
                    continue
                room[int(np.argmax(room >= size))] -= size
                owner[doc] = i

    def longest_document(self) -> int:
        return int(self.buckets[-1].high)

    def plan(self, step: int, doc_lengths: Sequence[int], *, latest: bool = False) -> StepPlan:
        lengths = np.asarray(doc_lengths, dtype=np.int64)
        owner = self._layout_index[self.assign(lengths)]
        if self.backfill:
            self._backfill(lengths, owner)
        stages = {}
        for i, lay in enumerate(self._used):
            ids = np.flatnonzero(owner == i)
            if ids.size:
                packed = pack_layout(ids, lengths[ids], lay, self.capacity(lay), self.cost_fn,
                                     self._labels[lay])
                stages[lay] = Stage(lay, packed.micro_batches, lay in self.activation_checkpointing,
                                    self._labels[lay])
        ordered = tuple(stages[lay] for lay in self.stage_order if lay in stages)
        return StepPlan(int(step), tuple(int(n) for n in lengths.tolist()), ordered)

    def state_dict(self) -> dict[str, Any]:
        """Nothing changes over time; the configuration is returned for logs only."""
        return {
            "kind": "threshold",
            "tokens_per_rank": self.tokens_per_rank,
            "buckets": [(b.high, b.layout.name) for b in self.buckets],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Stateless: accepted and ignored, so a run can resume with other layouts or world size."""

    def __repr__(self) -> str:
        bands = ", ".join(f"{b.label}: {b.layout}" for b in self.buckets)
        return f"{type(self).__name__}(tokens_per_rank={self.tokens_per_rank}, {bands})"
