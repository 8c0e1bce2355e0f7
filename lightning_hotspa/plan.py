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

from .activation_checkpointing import Checkpointing
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
    "block_dp_groups",
    "block_ranks",
    "single_stage_plan",
]


@dataclass(frozen=True)
class Block:
    """Some ranks of a block stage that run on their own (docs/DESIGN.md §4, "Blocks").

    A BLOCK STAGE (``Stage.blocks`` given) is a tuple of blocks that tile the world. Each block is an
    aligned sub-mesh: its ranks are ``dp_groups`` of ``layout``, and together they are one contiguous
    rank range ``[j * n, (j + 1) * n)`` with ``n`` dividing the world (only the outer dp dims are
    split; :func:`block_ranks` computes and checks it). Every collective of a block stays inside it
    until the stage's ONE joint gradient reduction of every block into the fp32 home shards (exact
    token weighting: each micro-batch's loss is scaled by its tokens over the step's).

    Args:
        layout: a PLAIN layout (``fsdp`` False) of the whole world naming the block's compute groups:
            its tp degree, cp degree and cp kind (``:kv`` / ``:kv<n>``). (A ``:fsdp`` layout here is
            the legacy mixed-cp lockstep stage, whose ``Stage.layout`` is that sharded copy: below.)
        dp_groups: which of ``layout``'s dp groups the block covers (their ranks are the block's;
            dp order is not rank order on a multi-dim mesh).
        micro_batches: ``micro_batches[i]`` lists dp group ``dp_groups[i]``'s micro-batches, each a
            tuple of document indices; any count per group, none included.
        sharded: True: the block's working copy is sharded over the block's OWN ranks (FSDP / HSDP
            inside the block: its per-unit gathers and reduce-scatters stay inside it, its dp groups
            run lockstep rounds among themselves, no other block waits on it); its working layout
            (:attr:`working_layout`) is ``layout`` with ``:fsdp<dp groups x cp>`` and must be among
            the mesh's layouts (so the mesh has the block's boundary and its groups exist from
            set-up). False: a replicated working copy of ``layout``'s tp degree (mixed tp / free runs).
        activation_checkpointing: what the block recomputes (a mode, bool or name, read as
            :meth:`Checkpointing.parse` does); None: the stage's mode.
    """

    layout: Layout
    dp_groups: tuple[int, ...]
    micro_batches: tuple[tuple[tuple[int, ...], ...], ...]
    sharded: bool = False
    activation_checkpointing: Checkpointing | None = None

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
        if not isinstance(self.sharded, bool):
            raise PlanError(f"Block.sharded must be True or False, got {self.sharded!r}")
        if self.sharded:
            if self.layout.fsdp:
                raise PlanError(f"a sharded block names its plain compute layout, got {self.layout}: "
                                f"sharded=True already shards the working copy over the block's ranks")
            if len(groups) * self.layout.cp < 2:
                raise PlanError(f"block in layout {self.layout} on dp groups {groups} is sharded, but it has "
                                f"one dp group and no cp: a copy sharded over its tp ranks only is a "
                                f"replicated one (sharded=False)")
        if self.activation_checkpointing is not None:
            object.__setattr__(self, "activation_checkpointing",
                               Checkpointing.parse(self.activation_checkpointing))
            if self.layout.fsdp:
                raise PlanError(f"block in layout {self.layout} of a mixed-cp lockstep stage sets "
                                f"activation_checkpointing: those blocks follow the stage's mode")

    @property
    def legacy(self) -> bool:
        """True for a block of a mixed-cp lockstep stage (its layout shards the stage's copy)."""
        return self.layout.fsdp

    @property
    def size(self) -> int:
        """The block's ranks: ``len(dp_groups) * tp * cp``."""
        return len(self.dp_groups) * self.layout.tp * self.layout.cp

    @property
    def working_layout(self) -> Layout:
        """The layout of the block's working copy: ``layout`` itself when replicated, else
        ``layout`` sharded over the block's dp x cp ranks (``:fsdp<n>``; plain ``:fsdp`` when the
        block is the whole world)."""
        lay = self.layout
        if not self.sharded:
            return lay
        shard = len(self.dp_groups) * lay.cp
        return Layout(dp=lay.dp, tp=lay.tp, cp=lay.cp, cp_kv=lay.cp_kv, fsdp=True,
                      fsdp_shard=0 if shard == lay.dp * lay.cp else shard)

    def checkpointing(self, stage: Checkpointing) -> Checkpointing:
        """The block's recomputation mode: its own, else the stage's ``stage``."""
        return stage if self.activation_checkpointing is None else self.activation_checkpointing


@dataclass(frozen=True)
class Stage:
    """All micro-batches of one layout in one step: ``micro_batches[dp_rank]`` lists that dp group's
    micro-batches, each a tuple of document indices into the step's document list.

    A BLOCK STAGE (``blocks`` given, ``micro_batches`` empty) runs each :class:`Block` on its own
    ranks in its own layout, each with its own working copy (sharded over its ranks or replicated),
    its own micro-batch stream and checkpointing mode, and ends with one joint gradient reduction
    of every block (:func:`slice_plan` checks that the blocks tile the world in aligned sub-meshes).
    ``layout`` then only names the stage (records, metrics; any of the mesh's layouts).

    Legacy mixed-cp lockstep stage: ``layout`` sharded (``:fsdp`` / HSDP) and every block's layout
    sharding that same copy: all dp groups run lockstep rounds on the one working copy.
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
        """A block stage: blocks of plain layouts of the stage's world, or the legacy mixed-cp stage
        (a sharded copy, and blocks that compute on that same copy)."""
        lay = self.layout
        if self.micro_batches:
            raise PlanError(f"block stage {lay} has both blocks and micro_batches; give its "
                            f"micro-batches in its blocks only")
        for block in self.blocks:
            if not isinstance(block, Block):
                raise PlanError(f"block stage {lay} has a block {block!r}, not a Block")
        legacy = [b.legacy for b in self.blocks]
        if not any(legacy):  # blocks of their own
            for block in self.blocks:
                if block.layout.world_size != lay.world_size:
                    raise PlanError(f"block stage {lay} (world {lay.world_size}) has a block in layout "
                                    f"{block.layout} of world {block.layout.world_size}")
                if block.sharded and block.checkpointing(self.activation_checkpointing) is Checkpointing.SELECTIVE:
                    raise PlanError(f"block stage {lay}: the sharded block in layout {block.layout} would run "
                                    f"selective checkpointing, which is not built for sharded copies; give the "
                                    f"block 'full' or 'none'")
            return
        if not all(legacy) or not lay.fsdp:
            raise PlanError(f"block stage {lay} mixes blocks of sharded layouts "
                            f"{[str(b.layout) for b in self.blocks if b.legacy]} (a mixed-cp lockstep stage: "
                            f"Stage.layout sharded and every block sharding that copy) with others; give "
                            f"blocks plain layouts and sharded=True instead")
        for block in self.blocks:
            b = block.layout
            if b.tp != lay.tp or b.world_size != lay.world_size or b.tp * b.fsdp_shard != lay.tp * lay.fsdp_shard:
                raise PlanError(f"mixed stage in layout {lay} has a block in layout {b}: a block must shard the "
                                f"same working copy (fsdp, tp={lay.tp}, shard group of {lay.tp * lay.fsdp_shard} "
                                f"ranks, world {lay.world_size})")

    @property
    def lockstep_blocks(self) -> bool:
        """True for a legacy mixed-cp lockstep stage (blocks computing on the stage's sharded copy)."""
        return bool(self.blocks) and self.blocks[0].legacy

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
    groups), the extra ones on :func:`idle_micro_batch`; in a sharded block, the busiest of the
    block's own dp groups."""

    layout: Layout
    micro_batches: tuple[MicroBatch, ...]
    activation_checkpointing: Checkpointing = Checkpointing.NONE
    label: str = ""
    rounds: int = 0
    block: Layout | None = None  # a block stage: this rank's block's compute (sharded: working) layout
    #: a block stage (not legacy mixed-cp): every rank's working layout, ``peers[r]`` for rank r (a
    #: sharded block's ``:fsdp<n>`` layout, a replicated block's own); empty otherwise
    peers: tuple[Layout, ...] = ()
    #: a block stage: which block this rank is in, for errors and records ("2/3 (dp4, sharded, ranks 2-3)")
    block_note: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "activation_checkpointing", Checkpointing.parse(self.activation_checkpointing))

    @property
    def num_rounds(self) -> int:
        return max(self.rounds, len(self.micro_batches))

    @property
    def working_layouts(self) -> tuple[Layout, ...]:
        """Every rank's working layout (``peers``), or ``(layout,)``: the same copy on every rank."""
        return self.peers or (self.layout,)

    def working_layout(self, rank: int) -> Layout:
        """``rank``'s working layout: its block's in a block stage, else ``layout``."""
        return self.peers[rank] if self.peers else self.layout

    @property
    def compute_layout(self) -> Layout:
        """The layout whose tp / cp groups compute: the block's in a block stage (a sharded block's
        ``:fsdp<n>`` working layout, the same tp / cp groups as its plain layout), else ``layout``."""
        return self.block if self.block is not None else self.layout

    def map_tensors(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> RankStage:
        mbs = tuple(m.map_tensors(fn) for m in self.micro_batches)
        return RankStage(self.layout, mbs, self.activation_checkpointing, self.label, self.rounds, self.block,
                         self.peers, self.block_note)

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
            cap, cp = capacity(block.working_layout), block.layout.cp
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
        if not stage.blocks:
            own = stage.micro_batches[mesh.rank_coords(stage.layout, rank)[0]]
            rounds = max(len(g) for g in stage.groups) if stage.layout.lockstep else 0
            stages.append(RankStage(stage.layout, _packed(own, docs, stage.layout, mesh, rank),
                                    stage.activation_checkpointing, stage.label, rounds))
            continue
        block, own, peers = _own_block(stage, mesh, rank, plan.step)
        compute = block.layout
        if stage.lockstep_blocks:  # legacy mixed-cp: every dp group of the stage in lockstep
            stages.append(RankStage(stage.layout, _packed(own, docs, compute, mesh, rank),
                                    stage.activation_checkpointing, stage.label,
                                    max(len(g) for g in stage.groups), compute))
            continue
        ranks = block_ranks(block, mesh)
        note = f"{stage.blocks.index(block) + 1}/{len(stage.blocks)} ({compute}, " \
               f"{'sharded' if block.sharded else 'replicated'}, ranks {ranks[0]}-{ranks[-1]})"
        rounds = max(len(g) for g in block.micro_batches) if block.working_layout.lockstep else 0
        stages.append(RankStage(stage.layout, _packed(own, docs, compute, mesh, rank),
                                block.checkpointing(stage.activation_checkpointing), stage.label, rounds,
                                block.working_layout, peers, note))
    return RankPlan(plan.step, tuple(stages), plan.global_target_tokens)


def _packed(own: Sequence[tuple[int, ...]], docs: Sequence[torch.Tensor], compute: Layout, mesh: MeshShape,
            rank: int) -> tuple[MicroBatch, ...]:
    """``rank``'s micro-batches ``own`` packed and cp-sliced for its compute layout."""
    cp_rank = mesh.rank_coords(compute, rank)[2]
    return tuple(pack_micro_batch([docs[i] for i in ids], compute.cp, cp_rank, ids, tp_size=compute.tp)
                 for ids in own)


def block_dp_groups(layout: Layout, mesh: MeshShape, ranks: Sequence[int]) -> tuple[int, ...]:
    """The dp groups of ``layout`` that hold ``ranks`` (sorted): what a :class:`Block` on those
    ranks names (dp order is not rank order on a multi-dim mesh).

    Args:
        layout: the block's plain compute layout, one of the mesh's.
        mesh: the world mesh's shape.
        ranks: the block's ranks, e.g. ``range(4, 8)``.
    """
    return tuple(sorted({mesh.rank_coords(layout, r)[0] for r in ranks}))


def block_ranks(block: Block, mesh: MeshShape) -> tuple[int, ...]:
    """The ranks of ``block`` (ascending); a :class:`PlanError` unless they form an aligned sub-mesh:
    one contiguous range ``[j * n, (j + 1) * n)`` with ``n`` dividing the world (outer dp dims split).
    A legacy mixed-cp block (sharded layout) is not checked for alignment.

    Args:
        block: the block.
        mesh: the world mesh's shape (``block.layout`` among its layouts).
    """
    ranks = tuple(r for r in range(mesh.world_size) if mesh.rank_coords(block.layout, r)[0] in block.dp_groups)
    n = len(ranks)
    if not block.legacy and (mesh.world_size % n or ranks[0] % n or ranks != tuple(range(ranks[0], ranks[0] + n))):
        raise PlanError(f"block in layout {block.layout} on dp groups {block.dp_groups} holds ranks {list(ranks)}, "
                        f"not an aligned sub-mesh of the {mesh.world_size}-rank world (a contiguous range of n "
                        f"ranks starting at a multiple of n, n dividing the world)")
    return ranks


def _own_block(stage: Stage, mesh: MeshShape, rank: int, step: int
               ) -> tuple[Block, tuple[tuple[int, ...], ...], tuple[Layout, ...]]:
    """``rank``'s block and micro-batches in a block stage, and every rank's working layout, once
    the blocks are checked to tile the world (every rank in exactly one block: each rank checks the
    whole stage alike)."""
    owner: dict[int, int] = {}
    for k, block in enumerate(stage.blocks):
        for lay in {block.layout, block.working_layout}:
            if lay not in mesh.layouts:
                raise LayoutError(f"step plan {step}: block {k} of stage {stage.layout} uses layout {lay}, "
                                  f"which is not among the mesh's layouts {[str(x) for x in mesh.layouts]}")
        for r in block_ranks(block, mesh):
            if r in owner:
                raise PlanError(f"step plan {step}: rank {r} is in block {owner[r]} "
                                f"({stage.blocks[owner[r]].layout}) and block {k} ({block.layout}) of block "
                                f"stage {stage.layout}")
            owner[r] = k
    missing = [r for r in range(mesh.world_size) if r not in owner]
    if missing:
        raise PlanError(f"step plan {step}: ranks {missing} are in no block of block stage {stage.layout}")
    block = stage.blocks[owner[rank]]
    peers = tuple(stage.blocks[owner[r]].working_layout for r in range(mesh.world_size))
    own = block.micro_batches[block.dp_groups.index(mesh.rank_coords(block.layout, rank)[0])]
    return block, own, peers


def single_stage_plan(step: int, doc_lengths: Sequence[int], layout: Layout) -> StepPlan:
    """A trivial plan: one stage, documents dealt round-robin to dp groups, one micro-batch each.

    Used for plain batches that are not step plans, and as a baseline in tests.
    """
    groups: list[list[int]] = [[] for _ in range(layout.dp)]
    for i in range(len(doc_lengths)):
        groups[i % layout.dp].append(i)
    mbs = tuple((tuple(g),) if g else () for g in groups)
    return StepPlan(step, tuple(doc_lengths), (Stage(layout, mbs),))
