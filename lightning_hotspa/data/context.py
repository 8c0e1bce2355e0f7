"""What the DataModule needs from the strategy to plan steps, as one typed value.

The strategy (``HotSPaStrategy.planning_context()``) hands the DataModule the planner, the world
mesh's shape and this rank; outside a Trainer the DataModule's own ``planner=`` / ``mesh_shape=`` /
``rank=`` arguments make the same value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from ..layout import MeshShape
from ..planner.base import Planner

__all__ = ["PlanningContext", "PlanningProvider"]


@dataclass(frozen=True)
class PlanningContext:
    planner: Planner
    mesh_shape: MeshShape
    rank: int
    world_size: int  # ranks of the Trainer that runs the plans


@runtime_checkable
class PlanningProvider(Protocol):
    """A strategy that plans steps (``HotSPaStrategy``)."""

    def planning_context(self) -> PlanningContext | None:
        """None until its processes are set up (the planner needs the layouts)."""
        ...
