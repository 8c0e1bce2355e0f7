"""``CostModelPlanner``: every document to the layout (and checkpointing) that minimizes the step.

Implements the :class:`~lightning_hotspa.planner.base.Planner` protocol. For one global batch it
chooses which layouts run, which documents each runs, whether each layout checkpoints activations,
how each layout's documents are packed into micro-batches and spread over its dp groups, and the stage
order, minimizing the predicted step time ``sum over stages (slowest dp group) + one gradient
reduction per run of same-tp stages + switches`` of the cost model (:mod:`..cost.cost_model`, optionally
calibrated by timings: :mod:`..profiled.calibration`), where the stages of one replicated tp degree count as
one free run whose dp groups fill each other's idle time (:mod:`..cost.timeline`).

Up to ``exact_max_docs`` documents the plan is exact (:mod:`.exact`); beyond, the heuristic of
:mod:`.assign` screens every layout combination with a relaxed stage time and packs the best few.
Plans are a pure function of (document lengths, layouts, cost coefficients): no randomness, no hash
order, so every rank and loader worker computes the same plan; coefficients change only through
:meth:`refit` at deterministic steps (or :meth:`load_state_dict`).

How to use it::

    # dry run / simulation: analytic coefficients of a hardware profile
    planner = auto_planner(8, 32768, model="llama7b", hardware="H100")  # candidates.auto_layouts
    plan = planner.plan(step, doc_lengths)       # a StepPlan: stages, micro-batches per dp group
    planner.predict(plan).seconds                # what the cost model expects it to take

    # training: the strategy builds it (planner="cost", or "cost-profiled" to fit timings), or pass one
    Trainer(strategy=HotSPaStrategy(layouts, planner=CostModelPlanner(layouts, model=config,
            hardware="cpu-gloo", tokens_per_rank=4096, profiled=True, refit_every=10)))

Profiled mode, what the strategy does on every rank after each training step (the rows ride the
step's one all-gather, so every rank feeds the same observations in the same order)::

    planner.observe(gathered_observations(...))  # every rank's measured stage seconds + features
    planner.refit(plan.step)                     # fits only at multiples of refit_every

A version decided at step ``r`` plans steps ``>= r + plan_lag`` (:mod:`..profiled.schedule`: plans are built
ahead, also in loader workers, which read the versions from shared memory);
:meth:`version_at` tells which version planned a step. ``state_dict`` holds the versions, the
pending observations and the schedule, and the strategy saves it in every checkpoint.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any, Literal

import numpy as np

from ...activation_checkpointing import Checkpointing, parse_checkpointing_spec
from ...checks import check_int
from ...layout import Layout, LayoutError, MeshShape, parse_layouts
from ...model_shape import ModelShape
from ...plan import PlanError, StepPlan
from ..base import PlannerBase
from ..cost.cost_model import AnalyticCostModel, OptionCost
from ..cost.hardware import HardwareProfile
from ..cost.predict import StepPrediction, predict_stages
from ..cost.runtime_profile import RuntimeProfile
from ..cost.timeline import GroupBlocks
from ..profiled.calibration import ProfiledCoefficients
from ..profiled.schedule import CoefficientSchedule, ScheduleEntry
from .assign import pack_in_order, solve_heuristic
from .exact import solve_exact
from .ladder import LadderPlanner
from .ladder_blocks import LadderGroups, remap
from .mixed_rounds import MixedBlock, MixedGroups, MixedRounds
from .packing import DocumentTooLongError, pack_layout
from .plan_stages import ladder_groups, ladder_stage, mixed_stage, plain_stage, remap_plain
from .profiled_mode import ProfiledPlanning
from .static_guard import DEFAULT_STATIC_MARGIN, GuardDecision, check_margin, guard, used_layouts

__all__ = ["CostModelPlanner"]

# Re-pack a stage with pack_layout's finer balancing only when LPT left it this far off balance
# (max group / mean - 1) and it has at most this many documents (pack_layout costs ~10 ms at 500).
_POLISH_IMBALANCE = 0.002
_POLISH_MAX_DOCS = 256
#: checkpointing options in the order they are listed (plain first)
_MODES = (Checkpointing.NONE, Checkpointing.SELECTIVE, Checkpointing.FULL)

LayoutSpec = Layout | str | Mapping[str, int]
CheckpointingSpec = Checkpointing | bool | str | Collection[LayoutSpec]


class CostModelPlanner(ProfiledPlanning, PlannerBase):
    """Cost-model planner over candidate ``layouts`` (all of one world size, sharing one mesh).

    Args:
        layouts: candidate layouts (for a chosen set: :func:`~lightning_hotspa.planner.candidates.auto_planner`,
            which scores candidate sets with this solver, so the choice lives above it).
        model: what the analytic model prices: a :class:`~lightning_hotspa.model_shape.ModelShape`, a preset name, a
            ``LlamaConfig`` or a Hugging Face config (:func:`~lightning_hotspa.model_shape.describe_model`).
        hardware: a profile name (``A100-80G``, ``A800-80G``, ``H100``, ``H200``, ``cpu-gloo``) or
            :class:`HardwareProfile`.
        tokens_per_rank: if given, a layout's capacity is ``tokens_per_rank * tp * cp`` (the
            strategy's setting), times the model's activation ratio with checkpointing; otherwise
            capacities come from the memory model.
        activation_checkpointing: ``"auto"`` (decide per layout and step among none, selective and
            full; sharded ``:fsdp`` layouts among none and full), ``"none"`` / ``"selective"`` /
            ``"full"`` for every layout (True / False: full / none), or the layouts that always
            checkpoint fully (the others never do).
        profiled: fit coefficients to observed timings (``observe`` / ``refit``).
        refit_every: refit at steps that are multiples of this.
        plan_lag: a refit at step ``r`` changes the plans of steps ``>= r + plan_lag`` (>= 2 when
            Lightning's loop prefetches one batch; more if a main-process loader plans further ahead).
        exact_max_docs: exact dynamic programming up to this many documents.
        static_margin: run a multi-layout plan only if the best single-layout plan of the same
            documents is predicted slower by more than this fraction (:mod:`.static_guard`; default
            the profiled cost model's measured held-out error); 0 trusts every predicted gain.
        split_checkpointing: with ``activation_checkpointing="auto"``, a layout may run two
            stages, one checkpointed (the documents only it holds) and one not (the runtime's
            checkpointing is per stage; same working copy, one gradient reduction); False: one
            stage per layout.
        mixed_rounds: a sharded working copy's stage may compute in two of its candidate layouts
            on different dp blocks at once (:mod:`.mixed_rounds`) where that prices lower; False:
            every stage computes in one layout.
        ladder: also consider one block stage of blocks side by side (:mod:`.ladder`), whose
            compute and working layouts are among ``layouts`` (True: what a real run's mesh has);
            ``"auto"``: blocks of every cp degree (powers of two up to the candidates' widest) of
            the candidates' tp degrees and cp kinds, working copies derived (simulation and dry
            runs: the mesh must then be declared with them); False: none.
        runtime: the runtime description the cost model prices (``planner/cost/runtime_profile.py``):
            ours, ``"hotspa"``, unless simulating another system's static layout (the long grid's
            competent user priced on the peer's runtime), or ours with ``tp_regather=False`` when the
            strategy keeps the gathered region inputs.
    """

    def __init__(
        self,
        layouts: Iterable[LayoutSpec] | Literal["auto"],
        *,
        model: ModelShape | str | Any,
        hardware: HardwareProfile | str = "cpu-gloo",
        world_size: int | None = None,
        tokens_per_rank: int | None = None,
        activation_checkpointing: CheckpointingSpec = "auto",
        profiled: bool = False,
        refit_every: int = 10,
        plan_lag: int = 2,
        exact_max_docs: int = 10,
        static_margin: float = DEFAULT_STATIC_MARGIN,
        split_checkpointing: bool = True,
        mixed_rounds: bool = True,
        ladder: bool | Literal["auto"] = True,
        runtime: RuntimeProfile | str = "hotspa",
    ) -> None:
        self.decides_checkpointing = True  # each stage's flag is the plan's choice (priced so)
        name = type(self).__name__
        self.static_margin = check_margin(static_margin, name)
        self.last_decision: GuardDecision | None = None  # the guard's view of the last solve
        self.last_multi: tuple[float, list] | None = None
        #: the cheapest multi-layout solution the last solve priced (None: none), whichever ran
        self.last_multi_layout: tuple[float, list] | None = None
        if isinstance(layouts, str) and layouts == "auto":
            raise PlanError(f"{name}(layouts='auto'): choose the candidates with "
                            f"planner.candidates.auto_planner(world_size, context, model=..., hardware=...)")
        specs = list(layouts)  # type: ignore[arg-type]
        if not specs:
            raise LayoutError(f"{name}: the layout list is empty")
        world = Layout.parse(specs[0]).world_size if world_size is None else world_size
        self.layouts: tuple[Layout, ...] = parse_layouts(specs, world)
        MeshShape.for_layouts(self.layouts, world)
        self.blocks = GroupBlocks(self.layouts, world)  # which dp groups free runs pack around
        self.cost_model = AnalyticCostModel(model, hardware, world, runtime=runtime)
        if tokens_per_rank is not None:
            tokens_per_rank = check_int(tokens_per_rank, f"{name}: tokens_per_rank", error=PlanError)
        self.tokens_per_rank = tokens_per_rank
        self.exact_max_docs = int(exact_max_docs)
        self.split_checkpointing = bool(split_checkpointing)
        self.profiled = bool(profiled)
        self._plan_lag = check_int(plan_lag, f"{name}: plan_lag", minimum=0, error=PlanError)
        self.coefficients = ProfiledCoefficients(refit_every=refit_every)
        self._ac_spec = activation_checkpointing
        self._ac_modes = {lay: self._ac_mode(lay, activation_checkpointing) for lay in self.layouts}
        self._analytic: dict[tuple[Layout, Checkpointing], OptionCost] = {}
        for lay in self.layouts:
            self.cost_model.check(lay)
            for ac in self._ac_modes[lay]:
                opt = self.cost_model.option(lay, ac, self._capacity_override(lay, ac))
                if opt.capacity >= 2 * lay.cp:
                    self._analytic[(lay, ac)] = opt
            if not any(k[0] == lay for k in self._analytic):
                raise PlanError(f"{name}: layout {lay} cannot hold any tokens: the model's weights and "
                                f"optimizer state alone exceed the memory of a {self.cost_model.hardware.name}")
        self.mixed_rounds = MixedRounds(list(self._analytic.values()), self.blocks.shape) if mixed_rounds \
            else MixedRounds((), None)  # which options a sharded stage may mix (mixed_rounds.py)
        self.ladder = self._ladder_planner(ladder)
        self._orders: dict[frozenset[Layout], tuple[float, tuple[Layout, ...]]] = {}
        self._schedule = CoefficientSchedule(self._sorted_keys(self._analytic), refit_every, plan_lag) \
            if self.profiled else None
        self._entry_options: tuple[ScheduleEntry, list[OptionCost]] | None = None
        self.last_version = 0  # the version the last plan() used (per process)
        self._refresh()

    # ------------------------------------------------------------------ configuration
    def _ac_mode(self, lay: Layout, spec: CheckpointingSpec) -> tuple[Checkpointing, ...]:
        """The checkpointing options ``lay`` is priced with under ``spec``."""
        try:
            parsed = parse_checkpointing_spec(spec)
        except ValueError as exc:
            raise PlanError(str(exc)) from None
        if not isinstance(parsed, (Checkpointing, tuple)):  # "auto"
            return _MODES[::2] if lay.fsdp else _MODES  # selective is not built for sharded copies
        if isinstance(parsed, Checkpointing):
            mode = parsed
            if mode is Checkpointing.SELECTIVE and lay.fsdp:
                raise PlanError(f"activation_checkpointing='selective' is not built for the sharded layout {lay}; "
                                f"use 'auto' (none or full there), 'full' or 'none'")
            return (mode,)
        return (Checkpointing.FULL if lay in parsed else Checkpointing.NONE,)

    def _ladder_planner(self, spec: bool | str) -> LadderPlanner | None:
        """The ladder's block options (None: off): from the candidates, or derived (``"auto"``)."""
        if spec is False:
            return None
        if spec not in (True, "auto"):
            raise PlanError(f"{type(self).__name__}: ladder must be True, False or 'auto', got {spec!r}")
        world = self.cost_model.world_size
        plain = sorted({lay.degrees for lay in self.layouts if lay.pp == 1}, key=lambda x: (x.tp, x.cp, x.cp_kv))
        modes = {lay: self._ac_mode(lay, self._ac_spec) for lay in plain}
        if spec == "auto":
            computes = set(plain)
            for base in plain:
                cp = 1
                while base.tp * cp <= world and world % (base.tp * cp) == 0 and cp <= base.cp:
                    for kv in sorted({1, cp, min(cp, base.cp_kv)}):
                        if cp % kv == 0:
                            try:
                                lay = Layout(dp=world // (base.tp * cp), tp=base.tp, cp=cp, cp_kv=kv)
                                self.cost_model.check(lay)
                                computes.add(lay)
                            except (LayoutError, ValueError):
                                pass
                    cp *= 2
            computes_list = sorted(computes, key=lambda x: (x.tp, x.cp, x.cp_kv))
            modes = {lay: self._ac_mode(lay, self._ac_spec) for lay in computes_list}
            return LadderPlanner(self.cost_model, computes_list, None, modes, self._capacity_override) or None
        computes_list = [lay for lay in plain if lay in self.layouts]
        return LadderPlanner(self.cost_model, computes_list, set(self.layouts), modes,
                             self._capacity_override) or None

    def _capacity_override(self, lay: Layout, ac: Checkpointing) -> int | None:
        if self.tokens_per_rank is None:
            return None
        base = self.tokens_per_rank * lay.tp * lay.cp
        if not ac:
            return base
        cm = self.cost_model
        return int(base * cm.activation_bytes_per_token(Checkpointing.NONE) / cm.activation_bytes_per_token(ac))

    def _sorted_keys(self, keys: Iterable[tuple[Layout, Checkpointing]]) -> list[tuple[Layout, Checkpointing]]:
        return sorted(keys, key=lambda k: (self.layouts.index(k[0]), _MODES.index(k[1])))

    def _refresh(self) -> None:
        """Options with the newest coefficients (analytic, or fitted in profiled mode)."""
        self.options: dict[tuple[Layout, Checkpointing], OptionCost] = {
            k: (self.coefficients.apply(o) if self.profiled else o) for k, o in self._analytic.items()
        }
        self._option_list = [self.options[k] for k in self._sorted_keys(self.options)]

    def capacity(self, layout: Layout) -> int:
        """Largest micro-batch of ``layout`` over its allowed checkpointing choices."""
        caps = [o.capacity for k, o in self.options.items() if k[0] == layout]
        if not caps and self.ladder is not None:  # a block's working layout
            caps = [o.capacity for k, o in self.ladder.options.items() if k[0] == layout]
        if not caps:
            raise LayoutError(f"layout {layout} is not among the candidates {[str(x) for x in self.layouts]}")
        return max(caps)

    def option(self, layout: Layout, activation_checkpointing: Checkpointing | bool | str) -> OptionCost:
        """The priced option of ``layout`` with ``activation_checkpointing`` (a mode, a bool or its name)."""
        return self.options[(layout, Checkpointing.parse(activation_checkpointing))]

    def longest_document(self) -> int:
        return max(o.max_doc_length for o in self.options.values())

    def stage_order(self, used: Iterable[Layout]) -> tuple[float, tuple[Layout, ...]]:
        """(seconds, order) for a set of used layouts: the order minimizing its switches minus the
        gradient reductions that same-tp neighbours save (the solvers charge every stage its
        ``stage_fixed``, so this credit makes them pay once per run, as :mod:`..cost.predict` does); ties:
        tp descending then cp descending (each byte of weights moves at most once, same tp adjacent)."""
        key = frozenset(used)
        if key not in self._orders:
            best = None
            for perm in itertools.permutations(sorted(key, key=lambda x: (-x.tp, -x.cp, -x.dp))):
                seconds = (self.cost_model.switch_sequence_seconds(perm)
                           - self.cost_model.shared_reduction_seconds(perm))
                if best is None or seconds < best[0] - 1e-15:
                    best = (seconds, perm)
            assert best is not None
            self._orders[key] = best
        return self._orders[key]

    # ------------------------------------------------------------------ planning
    def _check_lengths(self, doc_lengths: Sequence[int]) -> np.ndarray:
        lengths = np.asarray(doc_lengths, dtype=np.int64)
        if lengths.ndim != 1 or lengths.size == 0:
            raise PlanError(f"doc_lengths must be a non-empty 1-D list of lengths, got shape {lengths.shape}")
        if int(lengths.min()) < 1:
            i = int(lengths.argmin())
            raise PlanError(f"document {i} has length {int(lengths[i])}; documents must be non-empty")
        longest = self.longest_document()
        if int(lengths.max()) > longest:
            i = int(lengths.argmax())
            where = max(self.options.values(), key=lambda o: o.max_doc_length)
            raise DocumentTooLongError(
                f"document {i} has {int(lengths[i])} tokens; no candidate layout can hold it (largest: "
                f"{longest} tokens in {where.label}); add a layout with more tp*cp or lower the context")
        return lengths

    def solve(self, doc_lengths: Sequence[int], options: Sequence[OptionCost] | None = None,
              ) -> tuple[float, list[tuple[OptionCost, tuple]]]:
        """(predicted seconds, [(option, groups of micro-batches)] in stage order); ``options``:
        default the newest coefficients."""
        lengths = self._check_lengths(doc_lengths)
        option_list = list(self._option_list if options is None else options)
        multi = self._solve_over(lengths, option_list)
        spread = multi if len(used_layouts(multi[1])) > 1 else None
        if self.ladder is not None:  # a block stage of blocks side by side, where it prices lower
            found = self._ladder_plan(lengths, option_list)
            if found is not None and (spread is None or found[0] < spread[0]):
                spread = found
            if found is not None and found[0] < multi[0] * (1 - 1e-9):
                multi = found
        self.last_multi_layout = spread
        self.last_multi = multi  # before the guard (the grid re-guards it at other margins)
        chosen, self.last_decision = guard(lengths, option_list, multi, self.static_margin, self._solve_over)
        return chosen

    def _ladder_plan(self, lengths: np.ndarray, option_list: list[OptionCost]) -> tuple[float, list] | None:
        """The cheapest plan of a ladder stage (:mod:`.ladder`), either over every document or after
        a head of ordinary stages (the plain solver's) for the longest documents: as many as
        :meth:`~.ladder.LadderPlanner.head_size` estimates best, and one round of the world's widest
        groups (:meth:`~.ladder.LadderPlanner.round_size`). (The heads of the documents that take
        over 3/4 or 1/2 of today's plan alone never gave the cheapest plan on the long grid's 120
        batches once these two were tried: benchmarks/2026-12-06-ladder-4.md.)"""
        assert self.ladder is not None
        order = np.lexsort((np.arange(lengths.size), -lengths))
        tables = self.ladder.tables(lengths)
        best = None
        heads = {0, self.ladder.head_size(lengths, tables=tables), self.ladder.round_size(lengths, tables)}
        for k in sorted(heads):
            if k >= lengths.size:
                continue
            rest = np.sort(order[k:])
            found = self.ladder.solve(lengths[rest])
            if found is None:
                continue
            stages: list = []
            if k:
                head = np.sort(order[:k])
                _, plain = self._solve_plain(lengths[head], option_list)
                stages = remap_plain(plain, head)
            stages.append((found[1].blocks[0].option, remap(found[1], rest)))
            secs = self._seconds(lengths, stages)
            if best is None or secs < best[0] - 1e-12:
                best = (secs, stages)
        return best

    def _solve_over(self, lengths: np.ndarray, option_list: list[OptionCost]) -> tuple[float, list]:
        total, stages = self._solve_plain(lengths, option_list)
        return self.mixed_rounds.improve(lengths, total, stages, option_list, lambda st: self._seconds(lengths, st))

    def _solve_plain(self, lengths: np.ndarray, option_list: list[OptionCost]) -> tuple[float, list]:
        """(seconds, stages) with every stage in one compute layout: exact or heuristic."""
        if lengths.size <= self.exact_max_docs:
            # the DP's stages are in step (each its slowest dp group); re-packed around each other
            # as free runs (:mod:`..cost.timeline`), whichever predicts faster
            sol = solve_exact(lengths, option_list, self.stage_order, self.split_checkpointing)
            first = {}  # a layout's checkpointed stage first, as the heuristic orders them (assign.stage_order)
            for k, (o, _) in enumerate(sol.stages):
                first.setdefault(o.layout, k)
            exact = sorted(sol.stages, key=lambda s: (first[s[0].layout], not s[0].activation_checkpointing))
            ids = [(o, np.asarray(sorted(d for grp in g for mb in grp for d in mb), dtype=np.int64)) for o, g in exact]
            repacked = pack_in_order(ids, lengths, self.blocks)[1]
            exact_s, repacked_s = self._seconds(lengths, exact), self._seconds(lengths, repacked)
            return (repacked_s, repacked) if repacked_s < exact_s else (exact_s, exact)
        stages = solve_heuristic(lengths, option_list, self.stage_order,
                                 split_checkpointing=self.split_checkpointing, blocks=self.blocks)[1]
        return self._polish(lengths, stages)

    def _seconds(self, lengths: np.ndarray, stages: Sequence[tuple[OptionCost, tuple]]) -> float:
        """The predicted step of solver stages (fsdp groups' micro-batches costliest first, as
        :meth:`plan` emits them): the objective every solve returns."""
        return predict_stages(stages, lengths, self.cost_model, self.blocks, in_order=False).seconds

    def _polish(self, lengths: np.ndarray, stages: list) -> tuple[float, list]:
        """Re-packs a stage with :func:`~.packing.pack_layout` (document moves and swaps between dp
        groups) when its groups are off balance by more than ``_POLISH_IMBALANCE`` and it is small
        enough (``_POLISH_MAX_DOCS``) to afford it; keeps whichever predicts the faster step (a
        later stage of a free run is off balance on purpose: it packs around the ones before)."""
        total = self._seconds(lengths, stages)
        out = list(stages)
        for k, (opt, groups) in enumerate(stages):
            ids = [d for g in groups for mb in g for d in mb]
            secs = opt.doc_seconds(opt.padded(lengths))
            loads = [opt.group_seconds(float(secs[[d for mb in g for d in mb]].sum()), len(g)) if g else 0.0
                     for g in groups]
            mean = sum(loads) / len(loads)
            if len(groups) > 1 and len(ids) <= _POLISH_MAX_DOCS and max(loads) > mean * (1 + _POLISH_IMBALANCE):
                packed = pack_layout(ids, lengths[ids], opt.layout, opt.capacity, opt.balance_cost)
                trial = [*out[:k], (opt, packed.micro_batches), *out[k + 1:]]
                seconds = self._seconds(lengths, trial)
                if seconds < total:
                    total, out = seconds, trial
        return total, out

    def plan(self, step: int, doc_lengths: Sequence[int], *, latest: bool = False) -> StepPlan:
        """The plan of training step ``step``, with the coefficient version :meth:`version_at` gives
        (in a DataLoader worker: after waiting for that version to be decided). ``latest``: the
        newest decided version instead (evaluation plans, built while training is paused)."""
        lengths = self._check_lengths(doc_lengths)
        _, stages = self.solve(lengths, self._scheduled_options(step, latest))
        out = []
        for opt, groups in stages:
            if isinstance(groups, MixedGroups):
                out.append(mixed_stage(opt, groups, lengths))
                continue
            if isinstance(groups, LadderGroups):
                out.append(ladder_stage(groups, lengths, self.ladder.mesh))
                continue
            out.append(plain_stage(opt, groups, lengths))
        notes = self.last_decision.notes() if self.last_decision is not None else ()
        return StepPlan(int(step), tuple(int(n) for n in lengths.tolist()), tuple(out), notes=notes)

    def plan_ladder(self, step: int, doc_lengths: Sequence[int]) -> StepPlan | None:
        """The ladder alone: one block stage over every document (:mod:`.ladder`), whatever today's
        plans price and unguarded (inspection, benchmarks and the block-plan correctness tests);
        None when ladders are off or none holds the documents."""
        lengths = self._check_lengths(doc_lengths)
        found = self.ladder.solve(lengths) if self.ladder is not None else None
        if found is None:
            return None
        return StepPlan(int(step), tuple(int(n) for n in lengths.tolist()),
                        (ladder_stage(found[1], lengths, self.block_mesh()),))

    def predict(self, plan: StepPlan) -> StepPrediction:
        """Predicted seconds of any plan over these layouts (another planner's too)."""
        def opt_of(lay: Layout, ac: bool) -> OptionCost:
            return self.options.get((lay, ac)) or self.cost_model.option(lay, ac, self._capacity_override(lay, ac))

        stages = []
        for s in plan.stages:
            ac = s.activation_checkpointing
            if s.blocks and not s.lockstep_blocks:
                stages.append(ladder_groups(s, opt_of, self.block_mesh(), self.cost_model))
                continue
            groups = MixedGroups(tuple(MixedBlock(opt_of(b.layout, ac), b.dp_groups, b.micro_batches)
                                       for b in s.blocks)) if s.blocks else s.micro_batches
            stages.append((opt_of(s.layout, ac), groups))
        return predict_stages(stages, plan.doc_lengths, self.cost_model, self.blocks)

    def block_mesh(self) -> MeshShape:
        """The mesh the plans' blocks are placed on: the candidates' (with the ladder's derived
        layouts in ``ladder="auto"``)."""
        mesh = self.ladder.mesh if self.ladder is not None and self.ladder.mesh is not None else self.blocks.shape
        if mesh is None:
            raise PlanError(f"{type(self).__name__}: the candidates {[x.name for x in self.layouts]} share no mesh")
        return mesh

    def __repr__(self) -> str:
        opts = ", ".join(f"{o.label}:{o.capacity}" for o in self._option_list)
        return f"{type(self).__name__}({self.cost_model.model.n_layers}L on {self.cost_model.hardware.name}; {opts})"


