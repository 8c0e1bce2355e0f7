"""The step-plan vocabulary that data, planner, strategy and callbacks share (docs/DESIGN.md §4).

Two levels:

* :class:`StepPlan` / :class:`Stage` — the GLOBAL plan of one optimizer step, pure integers
  (document indices), computed identically on every rank with no communication.
* :class:`RankPlan` / :class:`RankStage` / :class:`MicroBatch` — one rank's slice of it, with
  tensors, produced by :func:`slice_plan`. This is what one Lightning batch carries.

The micro-batch itself and its cp slicing live in :mod:`.micro_batch` (re-exported here).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from .checkpointing import Checkpointing
from .checks import is_int
from .layout import Layout, LayoutError, MeshShape
from .micro_batch import (
    IGNORE_INDEX,
    MicroBatch,
    PlanError,
    idle_micro_batch,
    moved,
    pack_micro_batch,
)

__all__ = [
    "IGNORE_INDEX",
    "PlanError",
    "MicroBatch",
    "Block",
    "Stage",
    "StepPlan",
    "RankStage",
    "RankPlan",
    "pack_micro_batch",
    "idle_micro_batch",
    "slice_plan",
    "check_block_capacity",
    "single_stage_plan",
]


@dataclass(frozen=True)
class Block:
    """Some dp groups of one compute layout inside a mixed stage (docs/DESIGN.md §4, mixed-cp rounds).

    Args:
        layout: the block's compute layout (its tp x cp groups), one of the mesh's fsdp layouts with
            the stage's working copy.
        dp_groups: which of ``layout``'s dp groups the block covers (their ranks are the block's).
        micro_batches: ``micro_batches[i]`` lists dp group ``dp_groups[i]``'s micro-batches, each a
            tuple of document indices.
    """

    layout: Layout
    dp_groups: tuple[int, ...]
    micro_batches: tuple[tuple[tuple[int, ...], ...], ...]

    def __post_init__(self) -> None:
        if not isinstance(self.layout, Layout):
            raise PlanError(f"Block.layout must be a Layout, got {self.layout!r}")
        groups = self.dp_groups
        if not groups or len(set(groups)) != len(groups) or any(
                not is_int(g) or not 0 <= g < self.layout.dp for g in groups):
            raise PlanError(f"block in layout {self.layout} has dp_groups {groups!r}; they must be distinct "
                            f"ints in [0, {self.layout.dp}), at least one")
        if len(self.micro_batches) != len(groups):
            raise PlanError(f"block in layout {self.layout} lists {len(self.micro_batches)} dp groups of "
                            f"micro-batches for its {len(groups)} dp_groups {groups}")
        if any(not mb for group in self.micro_batches for mb in group):
            raise PlanError(f"block in layout {self.layout} has an empty micro-batch")


@dataclass(frozen=True)
class Stage:
    """All micro-batches of one layout in one step: ``micro_batches[dp_rank]`` lists that dp group's
    micro-batches, each a tuple of document indices into the step's document list.

    A MIXED stage (``blocks`` given, ``micro_batches`` empty) computes in each block's layout on
    that block's ranks (:func:`slice_plan` checks that the blocks tile the world). With a sharded
    ``layout`` (``:fsdp`` or HSDP) every block computes on that one working copy and all dp groups
    run lockstep rounds (mixed cp). With a replicated ``layout`` (mixed tp) each block holds its
    own replicated working copy in its own layout (any tp x cp), runs its micro-batches on its own,
    and the stage ends with one joint gradient reduction; ``layout`` then only names the stage.
    """

    layout: Layout
    micro_batches: tuple[tuple[tuple[int, ...], ...], ...]
    #: what the stage recomputes (a bool or a name is read as :meth:`Checkpointing.parse` does)
    activation_checkpointing: Checkpointing = Checkpointing.NONE
    label: str = ""  # bucket / length band, for metrics
    blocks: tuple[Block, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "activation_checkpointing", Checkpointing.parse(self.activation_checkpointing))
        if not isinstance(self.layout, Layout):
            raise PlanError(f"Stage.layout must be a Layout, got {self.layout!r}")
        if self.blocks:
            self._check_blocks()
        elif len(self.micro_batches) != self.layout.dp:
            raise PlanError(f"stage in layout {self.layout} has {len(self.micro_batches)} dp groups of "
                            f"micro-batches; the layout has dp={self.layout.dp}")
        for group in self.micro_batches:
            for mb in group:
                if not mb:
                    raise PlanError(f"stage in layout {self.layout} has an empty micro-batch")

    def _check_blocks(self) -> None:
        """A mixed stage: a sharded working copy, and blocks that compute on that same copy."""
        lay = self.layout
        if self.micro_batches:
            raise PlanError(f"mixed stage in layout {lay} has both blocks and micro_batches; give its "
                            f"micro-batches in its blocks only")
        for block in self.blocks:
            if not isinstance(block, Block):
                raise PlanError(f"mixed stage in layout {lay} has a block {block!r}, not a Block")
            b = block.layout
            if not lay.fsdp:  # mixed tp: each block its own replicated working copy
                if b.fsdp or b.world_size != lay.world_size:
                    raise PlanError(f"mixed stage in layout {lay} (replicated: each block holds its own working "
                                    f"copy) has a block in layout {b}: a block must be a replicated layout of "
                                    f"world {lay.world_size}")
                continue
            if not b.fsdp or b.tp != lay.tp or b.world_size != lay.world_size or \
                    b.tp * b.fsdp_shard != lay.tp * lay.fsdp_shard:
                raise PlanError(f"mixed stage in layout {lay} has a block in layout {b}: a block must shard the "
                                f"same working copy (fsdp, tp={lay.tp}, shard group of {lay.tp * lay.fsdp_shard} "
                                f"ranks, world {lay.world_size})")

    @property
    def groups(self) -> list[tuple[tuple[int, ...], ...]]:
        """Every dp group's micro-batches, blocks' included."""
        return list(self.micro_batches) + [g for b in self.blocks for g in b.micro_batches]

    @property
    def doc_ids(self) -> list[int]:
        return [d for group in self.groups for mb in group for d in mb]


@dataclass(frozen=True)
class StepPlan:
    """Everything one optimizer step does; every document is trained on exactly once."""

    step: int
    doc_lengths: tuple[int, ...]
    stages: tuple[Stage, ...]
    global_target_tokens: int = -1  # -1: derive as sum(length - 1) (plain next-token documents)
    # the planner's per-step figures (e.g. its predicted gain over static), logged as hotspa/planner/*
    notes: tuple[tuple[str, float], ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        if not self.stages:
            raise PlanError(f"step plan {self.step} has no stages")
        sizes = {s.layout.world_size for s in self.stages}
        if len(sizes) > 1:
            raise PlanError(f"step plan {self.step} mixes world sizes {sorted(sizes)}")
        if any(n < 1 for n in self.doc_lengths):
            raise PlanError(f"step plan {self.step} has a document of length < 1: {min(self.doc_lengths)}")
        seen = [0] * len(self.doc_lengths)
        for stage in self.stages:
            for d in stage.doc_ids:
                if not 0 <= d < len(seen):
                    raise PlanError(f"step plan {self.step} names document {d}, but it has {len(seen)}")
                seen[d] += 1
        missing = [i for i, c in enumerate(seen) if c == 0]
        twice = [i for i, c in enumerate(seen) if c > 1]
        if missing or twice:
            raise PlanError(f"step plan {self.step}: every document must be planned exactly once; "
                            f"missing {missing[:10]}, repeated {twice[:10]}")
        if self.global_target_tokens == -1:
            object.__setattr__(self, "global_target_tokens", sum(n - 1 for n in self.doc_lengths))
        if self.global_target_tokens < 0:
            raise PlanError(f"global_target_tokens must be >= 0, got {self.global_target_tokens}")

    @property
    def layouts(self) -> tuple[Layout, ...]:
        return tuple(s.layout for s in self.stages)

    @property
    def num_tokens(self) -> int:
        return sum(self.doc_lengths)


@dataclass(frozen=True)
class RankStage:
    """One rank's micro-batches of a stage. ``rounds``: forward/backward rounds this rank runs, at
    least its micro-batches; in a lockstep layout (``Layout.lockstep``: a sharded copy whose shard
    spans dp groups) every dp group runs as many as the busiest one (the per-unit gathers span dp
    groups), the extra ones on :func:`idle_micro_batch`."""

    layout: Layout
    micro_batches: tuple[MicroBatch, ...]
    activation_checkpointing: Checkpointing = Checkpointing.NONE
    label: str = ""
    rounds: int = 0
    block: Layout | None = None  # a mixed stage: this rank's block's compute layout
    #: a mixed-tp stage: every rank's working (= compute) layout, ``peers[r]`` for rank r; empty otherwise
    peers: tuple[Layout, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "activation_checkpointing", Checkpointing.parse(self.activation_checkpointing))

    @property
    def num_rounds(self) -> int:
        return max(self.rounds, len(self.micro_batches))

    @property
    def compute_layout(self) -> Layout:
        """The layout whose tp / cp groups compute: the block's in a mixed stage, else ``layout``
        (which always names the working copy)."""
        return self.block if self.block is not None else self.layout

    def map_tensors(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> RankStage:
        mbs = tuple(m.map_tensors(fn) for m in self.micro_batches)
        return RankStage(self.layout, mbs, self.activation_checkpointing, self.label, self.rounds, self.block,
                         self.peers)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> RankStage:
        return self.map_tensors(lambda t: moved(t, device, non_blocking))

    def pin_memory(self) -> RankStage:
        return self.map_tensors(torch.Tensor.pin_memory)


@dataclass(frozen=True)
class RankPlan:
    """One rank's slice of a step plan: what one Lightning batch carries."""

    step: int
    stages: tuple[RankStage, ...]
    global_target_tokens: int
    extras: dict = field(default_factory=dict, compare=False)  # e.g. data-side bookkeeping

    def map_tensors(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> RankPlan:
        """A copy with ``fn`` applied to every tensor of every micro-batch."""
        return RankPlan(self.step, tuple(s.map_tensors(fn) for s in self.stages), self.global_target_tokens,
                        self.extras)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> RankPlan:
        """Lightning moves any object with ``.to`` to the device."""
        return self.map_tensors(lambda t: moved(t, device, non_blocking))

    def pin_memory(self) -> RankPlan:
        """torch's DataLoader pin thread calls this on custom batch types."""
        return self.map_tensors(torch.Tensor.pin_memory)

    @property
    def micro_batches(self) -> list[MicroBatch]:
        return [m for s in self.stages for m in s.micro_batches]


def check_block_capacity(plan: StepPlan, capacity: Callable[[Layout], int]) -> None:
    """Refuses a mixed stage whose block runs a micro-batch its own layout cannot hold.

    Memory is planned per block: a tp1 block holds the whole working copy, tp times a tp block's,
    so it fits fewer tokens. Every rank checks every block alike (no rank starts a stage another
    refuses).

    Args:
        plan: the step plan.
        capacity: tokens one micro-batch may hold in a layout (the planner's ``capacity``),
            cp padding included.
    """
    for k, stage in enumerate(plan.stages):
        for b, block in enumerate(stage.blocks):
            cap, cp = capacity(block.layout), block.layout.cp
            for group, mbs in zip(block.dp_groups, block.micro_batches):
                for mb in mbs:
                    lengths = [plan.doc_lengths[d] for d in mb]
                    tokens = sum(-(-n // (2 * cp)) * 2 * cp if cp > 1 else n for n in lengths)
                    if tokens > cap:
                        raise PlanError(f"step plan {plan.step}, stage {k} ({stage.layout}): block {b} in layout "
                                        f"{block.layout}, dp group {group}, runs a micro-batch of documents "
                                        f"{list(mb)} ({tokens} tokens with cp padding), more than {block.layout}'s "
                                        f"capacity of {cap}")


def slice_plan(plan: StepPlan, docs: Sequence[torch.Tensor], mesh: MeshShape, rank: int,
               capacity: Callable[[Layout], int] | None = None) -> RankPlan:
    """This rank's slice: its dp group's micro-batches in every stage, cp-sliced by its cp rank.
    ``capacity`` (tokens per micro-batch of a layout): check every mixed stage's blocks against
    their own layouts first (:func:`check_block_capacity`)."""
    if len(docs) != len(plan.doc_lengths):
        raise PlanError(f"step plan {plan.step} has {len(plan.doc_lengths)} documents, got {len(docs)} token arrays")
    if capacity is not None:
        check_block_capacity(plan, capacity)
    stages = []
    for stage in plan.stages:
        if stage.layout not in mesh.layouts:
            raise LayoutError(f"step plan {plan.step} uses layout {stage.layout}, which is not among the "
                              f"mesh's layouts {[str(x) for x in mesh.layouts]}")
        compute, own, peers = stage.layout, None, ()
        if stage.blocks:
            compute, own, peers = _own_block(stage, mesh, rank, plan.step)
        else:
            own = stage.micro_batches[mesh.rank_coords(compute, rank)[0]]
        cp_rank = mesh.rank_coords(compute, rank)[2]
        mbs = tuple(pack_micro_batch([docs[i] for i in ids], compute.cp, cp_rank, ids, tp_size=compute.tp)
                    for ids in own)
        lockstep = stage.layout.lockstep or (bool(stage.blocks) and stage.layout.fsdp)
        rounds = max(len(g) for g in stage.groups) if lockstep else 0
        stages.append(RankStage(stage.layout, mbs, stage.activation_checkpointing, stage.label, rounds,
                                compute if stage.blocks else None, () if stage.layout.fsdp else peers))
    return RankPlan(plan.step, tuple(stages), plan.global_target_tokens)


def _own_block(stage: Stage, mesh: MeshShape, rank: int, step: int
               ) -> tuple[Layout, tuple[tuple[int, ...], ...], tuple[Layout, ...]]:
    """``rank``'s block layout and micro-batches in a mixed stage, and every rank's block layout,
    once the blocks are checked to tile the world (every rank in exactly one block: each rank
    checks the whole stage alike)."""
    owner: dict[int, int] = {}
    for k, block in enumerate(stage.blocks):
        if block.layout not in mesh.layouts:
            raise LayoutError(f"step plan {step}: a block of stage {stage.layout} uses layout {block.layout}, "
                              f"which is not among the mesh's layouts {[str(x) for x in mesh.layouts]}")
        for r in range(mesh.world_size):
            if mesh.rank_coords(block.layout, r)[0] in block.dp_groups:
                if r in owner:
                    raise PlanError(f"step plan {step}: rank {r} is in block {owner[r]} "
                                    f"({stage.blocks[owner[r]].layout}) and block {k} ({block.layout}) of mixed "
                                    f"stage {stage.layout}")
                owner[r] = k
    missing = [r for r in range(mesh.world_size) if r not in owner]
    if missing:
        raise PlanError(f"step plan {step}: ranks {missing} are in no block of mixed stage {stage.layout}")
    block = stage.blocks[owner[rank]]
    peers = tuple(stage.blocks[owner[r]].layout for r in range(mesh.world_size))
    return block.layout, block.micro_batches[block.dp_groups.index(mesh.rank_coords(block.layout, rank)[0])], peers


def single_stage_plan(step: int, doc_lengths: Sequence[int], layout: Layout) -> StepPlan:
    """A trivial plan: one stage, documents dealt round-robin to dp groups, one micro-batch each.

    Used for plain batches that are not step plans, and as a baseline in tests.
    """
    groups: list[list[int]] = [[] for _ in range(layout.dp)]
    for i in range(len(doc_lengths)):
        groups[i % layout.dp].append(i)
    mbs = tuple((tuple(g),) if g else () for g in groups)
    return StepPlan(step, tuple(doc_lengths), (Stage(layout, mbs),))
