"""What every planner offers, and what some planners add: the interfaces the DataModule, the
strategy and the monitor use.

A planner turns the document lengths of one global mini-batch into a :class:`StepPlan`. It must be
deterministic: every rank (and every loader worker) calls it with the same inputs and must get the
same plan, with no communication. Anything that changes its decisions over time (profiled cost
coefficients) changes only at deterministic step boundaries (``refit`` after a training step, or
``load_state_dict``), must make the plan of a step independent of when and in which process it is
built (:mod:`.profiled.schedule`), and is saved with checkpoints.

:class:`Planner` is the small core every planner writes: ``layouts``, ``capacity``,
``longest_document`` and ``plan``. What only some planners do is an optional protocol, checked with
``isinstance`` where it is used: :class:`PricedPlanner` (prices its plans and decides checkpointing
per stage), :class:`StatefulPlanner` (saved with checkpoints), :class:`ProfiledPlanner` (measured
timings feed back into its plans) and :class:`BalancedPlanner` (its packing balanced a per-document
cost). :class:`PlannerBase` gives the core a default ``longest_document``; :func:`check_planner` is
the one "is this a planner" test, used by the strategy and the DataModule alike.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from ..layout import Layout
from ..plan import StepPlan

if TYPE_CHECKING:
    from .cost.predict import StepPrediction
    from .profiled.calibration import Observation
    from .solve.packing import DocCost

__all__ = ["BalancedPlanner", "Planner", "PlannerBase", "PricedPlanner", "ProfiledPlanner", "StatefulPlanner",
           "balance_cost", "check_planner", "is_profiled"]


@runtime_checkable
class Planner(Protocol):
    """The core every planner offers: its candidate layouts, their micro-batch capacity, the
    longest document it can place, and the plan of one step."""

    layouts: tuple[Layout, ...]

    def capacity(self, layout: Layout) -> int:
        """Most tokens one micro-batch may hold in ``layout`` (a tp x cp group's activation budget)."""
        ...

    def longest_document(self) -> int:
        """The longest document any layout's micro-batch holds."""
        ...

    def plan(self, step: int, doc_lengths: Sequence[int], *, latest: bool = False) -> StepPlan:
        """The plan of one optimizer step; every document index appears exactly once. ``latest``:
        plan with the newest coefficients instead of those decided for ``step`` (evaluation)."""
        ...


@runtime_checkable
class PricedPlanner(Planner, Protocol):
    """A planner that prices its plans (the monitor's predicted seconds) and decides each stage's
    activation checkpointing as part of the price."""

    #: True if each stage's ``activation_checkpointing`` flag is this planner's decision, which the
    #: strategy's ``activation_checkpointing="auto"`` then follows (False: the strategy's rule adds to it)
    decides_checkpointing: bool

    def predict(self, plan: StepPlan) -> StepPrediction:
        """Predicted seconds of ``plan`` per stage."""
        ...


@runtime_checkable
class StatefulPlanner(Planner, Protocol):
    """A planner saved with checkpoints (``hotspa.planner`` in the checkpoint)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@runtime_checkable
class ProfiledPlanner(StatefulPlanner, Protocol):
    """A planner whose measured stage timings may feed back into its plans (``observe`` /
    ``refit``), at deterministic steps; ``profiled`` says whether they do in this run."""

    #: True if timings feed back into the plans (``observe`` / ``refit`` change them)
    profiled: bool
    #: the coefficient version the last ``plan`` call used
    last_version: int

    def ensure_plan_lag(self, lag: int) -> None:
        """Plans may be built ``lag`` steps ahead (loader workers): keep refits that far ahead."""
        ...

    def observe(self, observations: Iterable[Observation]) -> None:
        """Measured stage timings of a step (the same on every rank)."""
        ...

    def refit(self, step: int) -> bool:
        """Called after every training step; True if the coefficients changed."""
        ...


@runtime_checkable
class BalancedPlanner(Planner, Protocol):
    """A planner whose packing balanced a per-document cost over dp groups (plan statistics use it)."""

    cost_fn: DocCost


def is_profiled(planner: Planner) -> bool:
    """True if ``planner`` is a :class:`ProfiledPlanner` whose timings feed back in this run."""
    return isinstance(planner, ProfiledPlanner) and planner.profiled


def balance_cost(planner: Planner) -> DocCost | None:
    """The per-document cost ``planner``'s packing balanced (None: token counts)."""
    return planner.cost_fn if isinstance(planner, BalancedPlanner) else None


class PlannerBase:
    """A default ``longest_document`` (the longest any layout's capacity holds) for a core planner;
    subclasses write ``layouts``, ``capacity`` and ``plan``."""

    layouts: tuple[Layout, ...] = ()

    def capacity(self, layout: Layout) -> int:
        raise NotImplementedError

    def longest_document(self) -> int:
        from .solve.packing import max_doc_length

        return max(max_doc_length(self.capacity(x), x.cp) for x in self.layouts)


_MEMBERS = ("layouts", "capacity", "longest_document", "plan")


def check_planner(obj: Any, owner: str, error: type[Exception] = TypeError) -> Planner:
    """``obj`` if it is a :class:`Planner`, else ``error`` naming what it lacks."""
    if isinstance(obj, Planner):
        return obj
    missing = [m for m in _MEMBERS if not hasattr(obj, m)]
    raise error(f"{owner}: {type(obj).__name__} is not a Planner: it lacks {', '.join(missing)} "
                    f"(subclass lightning_hotspa.planner.PlannerBase for a default longest_document)")
