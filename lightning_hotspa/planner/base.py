"""What every planner offers: the one interface the DataModule, the strategy and the monitor use.

A planner turns the document lengths of one global mini-batch into a :class:`StepPlan`. It must be
deterministic: every rank (and every loader worker) calls it with the same inputs and must get the
same plan, with no communication. Anything that changes its decisions over time (profiled cost
coefficients) changes only at deterministic step boundaries (``refit`` after a training step, or
``load_state_dict``), must make the plan of a step independent of when and in which process it is
built (:mod:`.schedule`), and is saved with checkpoints.

:class:`Planner` lists every member its users call; nothing else is looked up on a planner.
:class:`PlannerBase` gives the optional parts their "does nothing" defaults, so a new planner
writes only ``layouts``, ``capacity`` and ``plan``. :func:`check_planner` is the one "is this a
planner" test, used by the strategy and the DataModule alike.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from ..layout import Layout
from ..plan import StepPlan

if TYPE_CHECKING:
    from .calibration import Observation
    from .packing import DocCost
    from .predict import StepPrediction

__all__ = ["Planner", "PlannerBase", "check_planner"]


@runtime_checkable
class Planner(Protocol):
    layouts: tuple[Layout, ...]
    #: True if timings feed back into the plans (``observe`` / ``refit`` change them)
    profiled: bool
    #: the coefficient version the last ``plan`` call used (-1: the planner has no versions)
    last_version: int
    #: the per-document cost the packing balanced (None: token counts); plan statistics use it
    cost_fn: DocCost | None
    #: bucket upper bounds the user set by hand (a document must be able to reach each)
    hand_set_bounds: tuple[int, ...]
    #: True if each stage's ``activation_checkpointing`` flag is this planner's decision, which the
    #: strategy's ``activation_checkpointing="auto"`` then follows (False: the strategy's rule adds to it)
    decides_checkpointing: bool

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

    def predict(self, plan: StepPlan) -> StepPrediction | None:
        """Predicted seconds of ``plan`` per stage, or None if this planner cannot price plans."""
        ...

    def ensure_plan_lag(self, lag: int) -> None:
        """Plans may be built ``lag`` steps ahead (loader workers): keep refits that far ahead."""
        ...

    def observe(self, observations: Iterable[Observation]) -> None:
        """Measured stage timings of a step (the same on every rank)."""
        ...

    def refit(self, step: int) -> bool:
        """Called after every training step; True if the coefficients changed."""
        ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class PlannerBase:
    """Defaults for a planner that is not profiled, has no versions and cannot price plans."""

    layouts: tuple[Layout, ...] = ()
    profiled: bool = False
    last_version: int = -1
    cost_fn: DocCost | None = None
    hand_set_bounds: tuple[int, ...] = ()
    decides_checkpointing: bool = False

    def capacity(self, layout: Layout) -> int:
        raise NotImplementedError

    def longest_document(self) -> int:
        from .packing import max_doc_length

        return max(max_doc_length(self.capacity(x), x.cp) for x in self.layouts)

    def predict(self, plan: StepPlan) -> StepPrediction | None:
        return None

    def ensure_plan_lag(self, lag: int) -> None:
        pass

    def observe(self, observations: Iterable[Observation]) -> None:
        pass

    def refit(self, step: int) -> bool:
        return False

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


_MEMBERS = ("layouts", "profiled", "last_version", "cost_fn", "hand_set_bounds", "decides_checkpointing", "capacity",
            "longest_document",
            "plan", "predict", "ensure_plan_lag", "observe", "refit", "state_dict", "load_state_dict")


def check_planner(obj: Any, owner: str, error: type[Exception] = TypeError) -> Planner:
    """``obj`` if it is a :class:`Planner`, else ``error`` naming what it lacks."""
    if isinstance(obj, Planner):
        return obj
    missing = [m for m in _MEMBERS if not hasattr(obj, m)]
    raise error(f"{owner}: {type(obj).__name__} is not a Planner: it lacks {', '.join(missing)} "
                    f"(subclass lightning_hotspa.planner.PlannerBase for the optional ones)")
