"""The cost-model planner's profiled mode: coefficient versions, the steps each plans, and their state.

:class:`ProfiledPlanning` is the half of :class:`~.solver.CostModelPlanner` (which inherits it) that
measured timings feed: :meth:`~ProfiledPlanning.observe` buffers them, :meth:`~ProfiledPlanning.refit`
fits at deterministic steps and publishes a version that plans steps ``>= refit step + plan_lag``
(:mod:`..profiled.schedule`), and ``state_dict`` / ``load_state_dict`` save and restore the versions.
It reads the planner's ``coefficients``, ``profiled``, ``layouts``, ``_analytic`` (the analytic options),
``_schedule``, ``_plan_lag``, ``_entry_options``, ``_sorted_keys`` and ``_refresh``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ...plan import PlanError
from ..cost.cost_model import OptionCost
from ..profiled.calibration import Observation, apply_coefficients
from ..profiled.schedule import CoefficientSchedule, ScheduleEntry

__all__ = ["ProfiledPlanning", "in_loader_worker"]


class ProfiledPlanning:
    """Profiled mode of the cost-model planner (a mixin of :class:`~.solver.CostModelPlanner`)."""

    def _scheduled_options(self, step: int, latest: bool) -> list[OptionCost] | None:
        """The option list of the version that plans ``step`` (``latest``: the newest decided one;
        in a DataLoader worker: after waiting for it to be decided); None: not profiled (the
        planner's own options). Sets ``last_version``."""
        if self._schedule is None:
            return None
        entry = self._schedule.entry_for(None if latest else int(step), wait=in_loader_worker())
        self.last_version = entry.version
        return self._options_of(entry)

    def _options_of(self, entry: ScheduleEntry) -> list[OptionCost]:
        """The option list of one scheduled version (cached: versions change rarely)."""
        if self._entry_options is None or self._entry_options[0] != entry:
            self._entry_options = (entry, [apply_coefficients(self._analytic[k], entry.scale, entry.fitted)
                                                   for k in self._sorted_keys(self._analytic)])
        return self._entry_options[1]

    @property
    def version(self) -> int:
        """The newest coefficient version (bumps whenever a refit changes them; saved in checkpoints).
        Plans use it from step ``refit step + plan_lag`` on: :meth:`version_at`."""
        return self.coefficients.version

    @property
    def plan_lag(self) -> int:
        """Steps between a refit and the first plan it changes."""
        return self._schedule.lag if self._schedule is not None else self._plan_lag

    def ensure_plan_lag(self, lag: int) -> None:
        """Plans may be built up to ``lag - 2`` steps ahead of Lightning's own prefetch (a loader's
        workers): raise ``plan_lag`` to ``lag`` so that no worker waits for a refit. The same call
        on every rank; versions already decided keep the steps they plan."""
        if self._schedule is not None:
            self._schedule.ensure_lag(int(lag))
        self._plan_lag = max(self._plan_lag, int(lag))

    def version_at(self, step: int) -> int:
        """The coefficient version that plans ``step`` (raises if that is not decided yet)."""
        if self._schedule is None:
            return self.version
        return self._schedule.entry_for(step, wait=False).version

    def observe(self, observations: Iterable[Observation]) -> None:
        """Buffers timings (the same all-gathered rows on every rank); plans change only at refit."""
        self.coefficients.observe(o for o in observations if (o.layout, o.activation_checkpointing) in self._analytic)

    def refit(self, step: int) -> bool:
        """Called after training step ``step`` (every step, in order, on every rank with the same
        observations). At multiples of ``refit_every`` refits the coefficients; a new version plans
        steps ``>= step + plan_lag``. True if the coefficients changed."""
        if not self.profiled or self._schedule is None:
            return False
        changed = self.coefficients.refit(step, self._analytic)
        if changed:
            self._refresh()
            c = self.coefficients
            self._schedule.publish(step, c.version, c.scale, c.fitted)
        self._schedule.mark_decided(step)
        return changed

    def state_dict(self) -> dict[str, Any]:
        out = {"kind": "cost_model", "version": self.version, "layouts": [x.name for x in self.layouts],
               "profiled": self.profiled, "coefficients": self.coefficients.state_dict()}
        if self._schedule is not None:
            out["schedule"] = self._schedule.state()
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores the fitted coefficients, their version and which steps each version plans;
        other settings stay as constructed. Loader workers see it through the shared schedule."""
        if state.get("kind") not in (None, "cost_model"):
            raise PlanError(f"{type(self).__name__} cannot load a {state.get('kind')!r} planner state")
        if "coefficients" in state:
            self.coefficients.load_state_dict(state["coefficients"])
            self._refresh()
            if self._schedule is not None:
                if "schedule" in state:
                    entries, decided, lag = CoefficientSchedule.entries_from_state(state["schedule"])
                else:  # a state without a schedule: its coefficients plan every step
                    c = self.coefficients
                    entries, decided, lag = [ScheduleEntry(-(2**62), c.version, c.scale, dict(c.fitted))], \
                        c.last_refit_step, None
                self._schedule.load(entries, decided, lag)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_entry_options"] = None  # rebuilt on first use (keeps worker pickles small)
        return state



def in_loader_worker() -> bool:
    """Whether this process is a DataLoader worker (a plan there waits for its version to be decided)."""
    from torch.utils.data import get_worker_info

    return get_worker_info() is not None
