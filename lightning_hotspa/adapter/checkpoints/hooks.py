"""What the strategy's checkpoint hooks add to Lightning's: the planner's state and the layouts.

The distributed save and load themselves are :mod:`.checkpoint` (DCP folders, committed only
when complete) and :mod:`.nodes` (shared or node-local folders, the newest step every
rank has). A checkpoint also records the layouts and world size it was written with, so a
resume on another number of ranks says what changed; a stateful planner (profiled coefficients)
is saved and restored with it. The step tracker (``adapter/lightning/reliability.StepTracker``) is
passed in and read as a :class:`Breadcrumbs` (checkpoints/ sits below the Lightning seam).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

from lightning.pytorch.utilities.rank_zero import rank_zero_info

from ...layout import Layout
from ...planner.base import Planner, StatefulPlanner
from .dcp_state import all_gather_objects, load_distributed_checkpoint
from .nodes import CheckpointPlacement, no_checkpoint

__all__ = ["Breadcrumbs", "StrategyCheckpoints", "load_with_planner", "save_with_planner"]


class Breadcrumbs(Protocol):
    """What a checkpoint save or load tells the rank's step tracker (``StepTracker`` is one)."""

    def between_steps(self, phase: str, global_step: int) -> None:
        """Notes work outside a step's stages (``phase`` names it)."""

    def guard(self, operation: str | None = None) -> AbstractContextManager[None]:
        """A context that re-raises a failed collective inside it as one naming where this rank was."""


def save_with_planner(checkpoint: dict[str, Any], path: str, *, planner: Planner, layouts: Sequence[Layout],
                      world_size: int, tracker: Breadcrumbs, placement: CheckpointPlacement) -> None:
    state = planner.state_dict() if isinstance(planner, StatefulPlanner) else {}
    checkpoint.setdefault("hotspa", {})["planner"] = state
    checkpoint["hotspa"]["layouts"] = [x.name for x in layouts]
    checkpoint["hotspa"]["world_size"] = world_size
    tracker.between_steps(f"checkpoint save to {path}", checkpoint.get("global_step", -1))
    with tracker.guard("a checkpoint save"):
        placement.save(checkpoint, path, [x.name for x in layouts])


def load_with_planner(checkpoint_path: str, module: Any, optimizers: Sequence[Any], *, planner: Planner,
                      layouts: Sequence[Layout], world_size: int, tracker: Breadcrumbs,
                      placement: CheckpointPlacement) -> dict[str, Any]:
    with tracker.guard("finding the checkpoint to resume from"):
        found = placement.resolve(checkpoint_path, [x.name for x in layouts])
    if found is None:  # latest_or_scratch:<dir> with no step every rank has: start from scratch
        return no_checkpoint()
    path = str(found)
    with tracker.guard("loading the checkpoint"):
        checkpoint = load_distributed_checkpoint(path, module, optimizers, share=placement.verify_share(found),
                                                 gather=all_gather_objects)
    saved = checkpoint.get("hotspa", {})
    rank_zero_info(f"hotspa: resuming from {path} (epoch {checkpoint.get('epoch')}, global step "
                   f"{checkpoint.get('global_step')}; saved by {saved.get('world_size', '?')} ranks with layouts "
                   f"{saved.get('layouts', '?')}, now {world_size} ranks with {[x.name for x in layouts]})")
    if saved.get("planner") and isinstance(planner, StatefulPlanner):
        planner.load_state_dict(saved["planner"])
    return checkpoint


class StrategyCheckpoints:
    """The strategy's checkpoint hooks (a mixin of :class:`~.strategy.HotSPaStrategy`): DCP folders
    of the home state, resharded into this run's layouts on load, with the planner's state."""

    def lightning_module_state_dict(self) -> dict[str, Any]:
        return self.lightning_module.state_dict()  # type: ignore[attr-defined]

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        pass  # loaded in load_checkpoint, where DCP reshards into this run's layouts

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(self.lightning_module,  # type: ignore[attr-defined]
                                        getattr(optimizer, "_optimizer", optimizer))

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        pass  # loaded in load_checkpoint

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        s: Any = self
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint does not take storage_options")
        save_with_planner(checkpoint, s.broadcast(str(filepath)), planner=s.planner, layouts=s.layouts,
                          world_size=s.world_size, tracker=s.tracker, placement=s.checkpoints)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        s: Any = self
        return load_with_planner(str(checkpoint_path), s.lightning_module, s.optimizers, planner=s.planner,
                                 layouts=s.layouts, world_size=s.world_size, tracker=s.tracker,
                                 placement=s.checkpoints)

    def remove_checkpoint(self, filepath: Any) -> None:
        self.checkpoints.remove(filepath)  # type: ignore[attr-defined]
