"""What every planner offers: the one interface the DataModule and the strategy rely on.

A planner turns the document lengths of one global mini-batch into a :class:`StepPlan`. It must be
deterministic: every rank (and every loader worker) calls it with the same inputs and must get the
same plan, with no communication. Anything that changes its decisions over time (profiled cost
coefficients) changes only at deterministic step boundaries (``refit`` after a training step, or
``load_state_dict``), must make the plan of a step independent of when and in which process it is
built (:mod:`.schedule`), and is saved with checkpoints.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from ..layout import Layout
from ..plan import StepPlan

__all__ = ["Planner"]


@runtime_checkable
class Planner(Protocol):
    layouts: tuple[Layout, ...]

    def capacity(self, layout: Layout) -> int:
        """Most tokens one micro-batch may hold in ``layout`` (a tp x cp group's activation budget)."""
        ...

    def plan(self, step: int, doc_lengths: Sequence[int]) -> StepPlan:
        """The plan of one optimizer step; every document index appears exactly once."""
        ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...
