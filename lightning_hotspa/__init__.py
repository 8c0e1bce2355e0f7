"""lightning_hotspa: HotSPa-style parallelism hot switching for PyTorch Lightning on DTensor.

The plain-value names (layouts, step plans) load at once; the Lightning-facing ones
(``HotSPaStrategy``, ``HotSPaDataModule``) on first access, so that importing the planner, the
layouts or the data side never imports Lightning. The strategy name "hotspa" is registered with
Lightning as soon as Lightning is (or gets) imported: see :mod:`lightning_hotspa.adapter.lightning.registration`.
"""

from typing import Any

from .adapter.lightning import registration as _registration
from .layout import Layout, LayoutError, MeshShape, parse_layouts
from .mesh import WorldMesh
from .plan import MicroBatch, RankPlan, StepPlan

__version__ = "0.1.0"

#: name -> module that defines it, imported on first access (they import Lightning)
_LAZY = {"HotSPaStrategy": ".adapter.lightning.strategy", "HotSPaDataModule": ".data.datamodule",
         "grad_norm": ".adapter.lightning.grad_norms",
         "RuntimeOptions": ".adapter.lightning.strategy_options",
         "ReliabilityOptions": ".adapter.lightning.strategy_options"}

__all__ = ["HotSPaDataModule", "HotSPaStrategy", "Layout", "LayoutError", "MeshShape", "MicroBatch",
           "RankPlan", "ReliabilityOptions", "RuntimeOptions", "StepPlan", "WorldMesh", "grad_norm", "parse_layouts"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


_registration.install()
