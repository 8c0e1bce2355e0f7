"""lightning_hotspa: HotSPa-style parallelism hot switching for PyTorch Lightning on DTensor."""

from .layout import Layout, LayoutError, MeshShape, WorldMesh, parse_layouts

__all__ = ["Layout", "LayoutError", "MeshShape", "WorldMesh", "parse_layouts"]
__version__ = "0.1.0"
