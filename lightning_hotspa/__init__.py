"""lightning_hotspa: HotSPa-style parallelism hot switching for PyTorch Lightning on DTensor."""

from .layout import Layout, LayoutError, MeshShape, WorldMesh, parse_layouts

__all__ = ["Layout", "LayoutError", "MeshShape", "WorldMesh", "parse_layouts"]
__version__ = "0.1.0"

from lightning.pytorch.strategies import StrategyRegistry  # noqa: E402

from .adapter.strategy import HotSPaStrategy  # noqa: E402
from .data import HotSPaDataModule  # noqa: E402
from .plan import MicroBatch, RankPlan, StepPlan  # noqa: E402

if "hotspa" not in StrategyRegistry:  # idempotent: Lightning raises on re-registering a name
    StrategyRegistry.register("hotspa", HotSPaStrategy,
                              description="HotSPa: hot-switch parallel layouts per length bucket")

__all__ += ["HotSPaDataModule", "HotSPaStrategy", "MicroBatch", "RankPlan", "StepPlan"]
