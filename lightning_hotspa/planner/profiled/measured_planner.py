"""The measured cost planner: the cost planner whose guard trusts measured stage seconds (issue 53).

:class:`MeasuredCostPlanner` is a profiled :class:`~..solve.solver.CostModelPlanner`, so the
strategy's :class:`~lightning_hotspa.adapter.lightning.profiling.ProfilingFeedback` already feeds it
every step's gathered stage table (every rank's compute seconds per stage, bit-identical on every
rank) and calls :meth:`refit` after each step. Per step it:

* **plans** candidates of the batch: one static plan per layout (its checkpointing options only; a
  layout that cannot hold a document does not fit and is never run, exploration included) and the
  solver's cheapest multi-layout plan; each priced per option key (``"<layout>/<checkpointing>"``:
  each stage's seconds with its gradient reduction and the switch into it, the free-run overlap
  shared out pro rata), each never-run layout with a probe (:func:`probe_documents` under it, the rest
  under the reference static), then a :class:`~.measured_guard.MeasuredGuard` picks the one that runs;
* **observes** (:meth:`refit`): per option, the predicted compute seconds (the analytic
  coefficients, :func:`~.calibration.predict`) and the measured seconds, each at the slowest rank,
  into the guard's :class:`~.measured.MeasuredCorrection`; the guard's state is then PUBLISHED for
  the plans of steps ``>= step + plan_lag``, exactly as the coefficient schedule publishes refits:
  the plan of step ``s`` uses the newest guard state whose effective step is ``<= s`` (a pure
  function of ``s``, the same on every rank). A plan requested before the state it needs is
  decided is an error naming the steps.

Decisions are remembered by step in the process that planned them (the main process; with loader
workers the planning process is the worker, so the main process only updates the correction and
skips the drift and budget accounting of those steps: documented limitation). The guard's state
(corrections, uncertainties, exploration spent, drift state, reference static) and the published
states go into :meth:`state_dict`, keyed by layout names and independent of the world size: a
resumed run replays the decisions it had published (keys of layouts it no longer has stay unused).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from ...activation_checkpointing import Checkpointing
from ...layout import Layout
from ...plan import PlanError, StepPlan
from ..cost.predict import predict_stages
from ..solve.plan_stages import remap_plain
from ..solve.solver import CostModelPlanner
from .calibration import Observation, predict
from .measured_guard import Candidate, Decision, MeasuredGuard, slice_noise

__all__ = ["MeasuredCostPlanner", "option_key", "option_seconds", "probe_documents"]

_NEVER = -(2**62)


def option_key(layout: Layout | str, activation_checkpointing: Any) -> str:
    """The correction's key of an option: ``"<layout name>/<checkpointing>"``."""
    name = layout.name if isinstance(layout, Layout) else str(layout)
    return f"{name}/{Checkpointing.parse(activation_checkpointing).name.lower()}"


def probe_documents(lengths: np.ndarray, share: float) -> np.ndarray:
    """The documents a probe runs under the probed layout: in length order, the middle one of every
    ``round(1 / share)`` (the slice keeps the batch's mix of lengths), at least one, never all."""
    if not 0 < share < 1:
        raise ValueError(f"probe_documents: share must be in (0, 1), got {share!r}")
    order = np.lexsort((np.arange(lengths.size), lengths))
    stride = max(2, round(1.0 / share))
    picked = order[stride // 2::stride] if lengths.size > stride // 2 else order[:1]
    return np.sort(picked[: max(1, lengths.size - 1)])


def option_seconds(prediction: Any) -> dict[str, float]:
    """A :class:`~..cost.predict.StepPrediction`'s seconds per option key (stage + switch into it;
    the free-run overlap shared out in proportion), summing to its ``seconds``."""
    raw: dict[str, float] = {}
    for s in prediction.stages:
        k = option_key(s.layout, s.activation_checkpointing)
        raw[k] = raw.get(k, 0.0) + s.seconds + s.switch_seconds
    total = sum(raw.values())
    scale = prediction.seconds / total if total > 0 else 1.0
    return {k: v * scale for k, v in sorted(raw.items())}


class MeasuredCostPlanner(CostModelPlanner):
    """The cost planner with the guard by measurement (see the module docstring).

    ``explore_budget``: exploration's share of the run's measured seconds (0: off; default 3 %);
    ``drift_steps`` / ``cooldown``: a multi plan measuring slower than the reference static this many
    steps in a row is dropped for ``cooldown`` steps (logged); ``horizon``: the run's steps when
    known; ``noise_sd``: one step's log noise of a measured stage (0.02 on a GPU, ~0.1 on a shared
    CPU box); ``probe_share``: the share of a batch's documents a probe runs under a never-run layout
    (0: no probes). Other arguments: :class:`~..solve.solver.CostModelPlanner`'s (``profiled`` is forced).
    """

    def __init__(self, *args: Any, explore_budget: float = 0.03, drift_steps: int = 3, cooldown: int = 50,
                 horizon: int | None = None, noise_sd: float = 0.02, probe_share: float = 0.125,
                 **kwargs: Any) -> None:
        kwargs["profiled"] = True
        super().__init__(*args, **kwargs)
        if not (isinstance(probe_share, (int, float)) and 0 <= probe_share < 1):
            raise ValueError(f"MeasuredCostPlanner: probe_share must be in [0, 1) (0: no probes), got {probe_share!r}")
        self.probe_share = float(probe_share)
        from .measured import MeasuredCorrection

        self.guard = MeasuredGuard(MeasuredCorrection(noise_sd=noise_sd), budget=explore_budget,
                                   drift_steps=drift_steps, cooldown=cooldown, horizon=horizon)
        self._published: list[tuple[int, dict[str, Any]]] = [(_NEVER, self.guard.state_dict())]
        self._decided_through = -1
        self._decisions: dict[int, tuple[Decision, dict[str, float]]] = {}
        self.last_measured: Decision | None = None
        self.log: list[str] = []

    # ------------------------------------------------------------------ candidates
    #: within one :meth:`candidates` call, reuse its solves and predictions (the static guard of
    #: ``CostModelPlanner.solve`` re-solves a layout the candidates solved; each candidate's stage
    #: breakdown re-predicts the stages its solve already predicted). Pure memoization of the same
    #: calls on the same inputs: the plans and decisions are the same either way (test_measured_planner)
    reuse_solves: bool = True
    _memo: dict | None = None

    def _solve_over(self, lengths: np.ndarray, option_list: list) -> tuple[float, list]:
        memo = self._memo
        if memo is None:
            return super()._solve_over(lengths, option_list)
        key = ("solve", lengths.tobytes(), tuple(map(id, option_list)))  # the options live through the call
        if key not in memo:
            memo[key] = super()._solve_over(lengths, option_list)
        return memo[key]

    def _seconds(self, lengths: np.ndarray, stages: Sequence[tuple[Any, tuple]]) -> float:
        return self._predict(lengths, stages).seconds

    def _predict(self, lengths: np.ndarray, stages: Sequence[tuple[Any, tuple]]) -> Any:
        """``predict_stages`` of solver stages (memoized within a :meth:`candidates` call)."""
        memo = self._memo
        if memo is None:
            return predict_stages(stages, lengths, self.cost_model, self.blocks, in_order=False)
        key = ("predict", lengths.tobytes(), tuple((id(o), g) for o, g in stages))
        try:
            hash(key)
        except TypeError:  # a stage whose groups are not plain tuples: not memoized
            return predict_stages(stages, lengths, self.cost_model, self.blocks, in_order=False)
        if key not in memo:
            memo[key] = predict_stages(stages, lengths, self.cost_model, self.blocks, in_order=False)
        return memo[key]

    def candidates(self, lengths: np.ndarray, options: Sequence[Any] | None = None, reference: str | None = None,
                   measured: Mapping[str, int] | None = None) -> list[tuple[Candidate, list, list | None]]:
        """(candidate, solver stages, probe stages or None) per static layout and the cheapest
        multi-layout plan. ``reference``: the reference static's name (probes run the rest of the
        batch under it; None: no probes); ``measured``: runs per option key (a layout whose options
        all ran gets no probe)."""
        self._memo = {} if self.reuse_solves else None
        try:
            return self._candidates(lengths, options, reference, measured or {})
        finally:
            self._memo = None

    def _candidates(self, lengths: np.ndarray, options: Sequence[Any] | None, reference: str | None,
                    measured: Mapping[str, int]) -> list[tuple[Candidate, list, list | None]]:
        option_list = list(self._option_list if options is None else options)
        longest = int(lengths.max())
        statics: list[tuple[Layout, list, list]] = []  # (layout, its options, its stages) of those that fit
        out: list[tuple[Candidate, list, list | None]] = []
        for lay in self.layouts:
            own = [o for o in option_list if o.layout == lay]
            if not own:
                continue
            if max(o.max_doc_length for o in own) < longest:
                out.append((Candidate(lay.name, {option_key(lay, own[0].activation_checkpointing): 0.0}, True,
                                      fits=False), [], None))
                continue
            _, stages = self._solve_over(lengths, own)
            statics.append((lay, own, stages))
        probes = self._probes(lengths, statics, reference, measured) if self.probe_share > 0 and reference else {}
        for lay, _, stages in statics:
            probe = probes.get(lay.name)
            out.append((Candidate(lay.name, option_seconds(self._predict(lengths, stages)), True,
                                  probe=None if probe is None else option_seconds(self._predict(lengths, probe))),
                        stages, probe))
        super().solve(lengths, option_list)  # sets last_multi (the unguarded cheapest plan)
        multi = self.last_multi_layout
        if multi is not None:
            out.append((Candidate("multi", option_seconds(self._predict(lengths, multi[1])), False), multi[1], None))
        return out

    def _probes(self, lengths: np.ndarray, statics: list[tuple[Layout, list, list]], reference: str | None,
                measured: Mapping[str, int]) -> dict[str, list]:
        """Per static layout not yet measured, its probe's solver stages: :func:`probe_documents` under
        the layout, the rest of the batch under the reference static (none without a reference that fits)."""
        ref = next((x for x in statics if x[0].name == reference), None)
        if ref is None or lengths.size < 2:
            return {}
        todo = [(lay, own) for lay, own, _ in statics if lay is not ref[0]
                and not all(measured.get(option_key(lay, o.activation_checkpointing), 0) for o in own)]
        if not todo:
            return {}
        part = probe_documents(lengths, self.probe_share)
        rest = np.setdiff1d(np.arange(lengths.size), part)
        _, ref_stages = self._solve_plain(lengths[rest], ref[1])
        head = remap_plain(ref_stages, rest)
        out = {}
        for lay, own in todo:
            _, own_stages = self._solve_plain(lengths[part], own)
            out[lay.name] = head + remap_plain(own_stages, part)
        return out

    def _guard_for(self, step: int | None) -> MeasuredGuard:
        """The published guard state that plans ``step`` (None: the newest)."""
        if step is not None:
            need = step - self.plan_lag
            if need >= 0 and self._decided_through < need:
                raise PlanError(f"the measured plan of step {step} needs the guard state decided at step {need}, "
                                f"but only steps <= {self._decided_through} are decided: raise plan_lag")
            state = [s for eff, s in self._published if eff <= step][-1]
        else:
            state = self._published[-1][1]
        guard = MeasuredGuard()
        guard.load_state_dict(copy.deepcopy(state))
        return guard

    def solve(self, doc_lengths: Sequence[int], options: Sequence[Any] | None = None,
              ) -> tuple[float, list[tuple[Any, tuple]]]:
        """The measured guard's choice among :meth:`candidates` (step: the one :meth:`plan` is on)."""
        lengths = self._check_lengths(doc_lengths)
        step = getattr(self, "_planning_step", None)
        guard = self._guard_for(step)
        reference = guard.reference if guard.budget > 0 else None  # no exploration: no probe to price
        cands = self.candidates(lengths, options, reference, guard.correction.runs)
        decision = guard.decide(-1 if step is None else step, [c for c, _, _ in cands])
        self.last_measured = decision
        cand, stages, probe = next(x for x in cands if x[0].name == decision.run)
        seconds = dict(cand.probe if decision.probe else cand.seconds)
        if step is not None:
            self._candidate_s = {c.name: dict(c.seconds) for c, _, _ in cands}
            scale = slice_noise(cand.seconds, seconds) if decision.probe else {}  # a slice measures less precisely
            self._decisions[step] = (decision, seconds, scale)
        return sum(seconds.values()), (probe if decision.probe else stages)

    def plan(self, step: int, doc_lengths: Sequence[int], *, latest: bool = False) -> StepPlan:
        self._planning_step = None if latest else int(step)
        try:
            out = super().plan(step, doc_lengths, latest=latest)
        finally:
            self._planning_step = None
        return StepPlan(out.step, out.doc_lengths, out.stages, notes=(*out.notes, *self.notes()))

    def notes(self) -> tuple[tuple[str, float], ...]:
        """W&B values of the last measured decision (``hotspa/planner/measured/...``, stable keys):
        per option its correction factor and sd; the gain of the best multi plan over the reference
        static and the threshold (margin) it had to exceed; whether the step explores; the share of
        measured seconds spent exploring; whether a multi plan won."""
        d = self.last_measured
        if d is None:
            return ()
        guard = self._guard_for(None if d.step < 0 else d.step)
        out: list[tuple[str, float]] = []
        for key in sorted(set(guard.correction.mean) | {k for s in getattr(self, "_candidate_s", {}).values()
                                                         for k in s}):
            mean, sd = guard.correction.belief(key)
            out += [(f"measured/{key}/correction", math.exp(mean)), (f"measured/{key}/uncertainty", sd)]
        gain = d.gain if math.isfinite(d.gain) else 0.0
        thr = d.threshold if math.isfinite(d.threshold) else 0.0
        out += [("measured/gain_over_static", math.expm1(gain)), ("measured/margin", math.expm1(thr)),
                ("measured/exploring", float(d.exploring)), ("measured/exploration_share", guard.exploration_share),
                ("measured/multi_won", float(d.exploit != d.reference and d.exploit == "multi"))]
        return tuple(out)

    # ------------------------------------------------------------------ feedback
    def measured_rows(self, observations: Iterable[Observation]) -> list[tuple[str, float, float]]:
        """(option key, predicted, measured seconds), each the slowest rank's sum over its stages of
        that option (observations are rank-major; ranks are told apart by repeating keys)."""
        per_rank: list[dict[str, list[float]]] = [{}]
        last_key = None
        for o in observations:
            key = (o.layout, o.activation_checkpointing)
            if key not in self._analytic:
                continue
            k = option_key(*key)
            if k in per_rank[-1] and k != last_key:
                per_rank.append({})
            acc = per_rank[-1].setdefault(k, [0.0, 0.0])
            acc[0] += predict(self._analytic[key], o)
            acc[1] += float(o.seconds)
            last_key = k
        keys = sorted({k for r in per_rank for k in r})
        return [(k, max(r[k][0] for r in per_rank if k in r), max(r[k][1] for r in per_rank if k in r)) for k in keys]

    def observe(self, observations: Iterable[Observation]) -> None:
        observations = list(observations)
        super().observe(observations)
        self._pending_rows = self.measured_rows(observations)

    def refit(self, step: int) -> bool:
        """After training step ``step``: its measured rows (from :meth:`observe`, none when it was not
        observed) update the guard; the new state plans steps ``>= step + plan_lag``."""
        rows = getattr(self, "_pending_rows", [])
        self._pending_rows = []
        decision, planned, scale = self._decisions.pop(int(step), (None, {}, {}))
        for old in [s for s in self._decisions if s < step]:
            self._decisions.pop(old)
        if rows:
            if decision is not None:
                self.guard.reference = decision.reference  # the reference static it re-chose carries on
                # in the plan's predicted seconds (stage, reduction, switch) at this step's measured
                # ratio of each option: the guard compares ratios, not raw compute seconds
                rows = [(k, planned.get(k, p), planned.get(k, p) * m / p, scale.get(k, 1.0)) for k, p, m in rows
                        if p > 0]
                static_run = decision.run != "multi" and not decision.probe
                self.log += self.guard.observe(decision, rows, static_run=static_run)
            else:  # planned in another process: the correction only
                self.guard.correction.observe(rows)
                self.guard.elapsed += sum(m for _, _, m in rows)
            for line in self.log[-3:]:
                if line.startswith(f"step {step}:"):
                    import logging
                    logging.getLogger(__name__).warning("hotspa measured planner: %s", line)
        self._published.append((int(step) + self.plan_lag, self.guard.state_dict()))
        first_pending = int(step) + 1
        self._published = [e for i, e in enumerate(self._published)
                           if i + 1 == len(self._published) or self._published[i + 1][0] > first_pending]
        self._decided_through = max(self._decided_through, int(step))
        super().refit(step)
        return bool(rows)

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        out = super().state_dict()
        out["measured"] = {"guard": self.guard.state_dict(), "decided_through": self._decided_through,
                           "published": [[eff, copy.deepcopy(s)] for eff, s in self._published]}
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        m = state.get("measured")
        if m is None:
            return
        self.guard.load_state_dict(m["guard"])
        self._decided_through = int(m["decided_through"])
        self._published = [(int(eff), dict(s)) for eff, s in m["published"]]
        self._decisions.clear()

    def save_corrections(self) -> dict[str, Any]:
        """The corrections alone (``hotspa plan --calibration``)."""
        return {"kind": "measured_corrections", "guard": self.guard.state_dict()}

    def load_corrections(self, state: Mapping[str, Any]) -> None:
        """Plans every step with saved corrections (a :meth:`save_corrections` or checkpoint state)."""
        guard_state = state["guard"] if "guard" in state else state["measured"]["guard"]
        self.guard.load_state_dict(guard_state)
        self._published = [(_NEVER, self.guard.state_dict())]
