"""What the strategy's checkpoint hooks add to Lightning's: the planner's state and the layouts.

The distributed save and load themselves are :mod:`.checkpoint` (DCP folders, committed only
when complete). A checkpoint also records the layouts and world size it was written with, so a
resume on another number of ranks says what changed; a stateful planner (profiled coefficients)
is saved and restored with it.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_info

from ..layout import Layout
from ..planner.base import Planner
from .checkpoint import load_distributed_checkpoint, resolve_checkpoint, save_distributed_checkpoint
from .reliability import StepTracker

__all__ = ["StrategyCheckpoints", "load_with_planner", "remove_checkpoint_path", "save_with_planner"]


def save_with_planner(checkpoint: dict[str, Any], path: str, *, planner: Planner, layouts: Sequence[Layout],
                      world_size: int, tracker: StepTracker, is_rank_zero: bool, barrier: Callable[..., Any],
                      broadcast: Callable[..., Any]) -> None:
    checkpoint.setdefault("hotspa", {})["planner"] = planner.state_dict()
    checkpoint["hotspa"]["layouts"] = [x.name for x in layouts]
    checkpoint["hotspa"]["world_size"] = world_size
    tracker.between_steps(f"checkpoint save to {path}", checkpoint.get("global_step", -1))
    with tracker.guard("a checkpoint save"):
        save_distributed_checkpoint(checkpoint, path, is_rank_zero=is_rank_zero, barrier=barrier,
                                    broadcast=broadcast)


def load_with_planner(checkpoint_path: str, module: Any, optimizers: Sequence[Any], *, planner: Planner,
                      layouts: Sequence[Layout], world_size: int) -> dict[str, Any]:
    path = str(resolve_checkpoint(checkpoint_path))
    checkpoint = load_distributed_checkpoint(path, module, optimizers)
    saved = checkpoint.get("hotspa", {})
    rank_zero_info(f"hotspa: resuming from {path} (epoch {checkpoint.get('epoch')}, global step "
                   f"{checkpoint.get('global_step')}; saved by {saved.get('world_size', '?')} ranks with layouts "
                   f"{saved.get('layouts', '?')}, now {world_size} ranks with {[x.name for x in layouts]})")
    if saved.get("planner"):
        planner.load_state_dict(saved["planner"])
    return checkpoint


def remove_checkpoint_path(filepath: Any) -> None:
    path = Path(filepath)
    shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)


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
                          world_size=s.world_size, tracker=s.tracker, is_rank_zero=s.global_rank == 0,
                          barrier=s.barrier, broadcast=s.broadcast)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        s: Any = self
        return load_with_planner(s.broadcast(str(checkpoint_path)), s.lightning_module, s.optimizers,
                                 planner=s.planner, layouts=s.layouts, world_size=s.world_size)

    def remove_checkpoint(self, filepath: Any) -> None:
        if self.global_rank == 0:  # type: ignore[attr-defined]
            remove_checkpoint_path(filepath)
