"""Registering the strategy name "hotspa" with Lightning, in one place, without importing Lightning.

Two facts pull against each other. Lightning snapshots ``StrategyRegistry`` when a ``Trainer`` is
built and discovers no strategies by entry point, so ``Trainer(strategy="hotspa")`` works only if
our name is registered by then: ``import lightning_hotspa`` must see to it. But Lightning takes
seconds to import, and the planner, the layouts and the data side must not pay for it.

So :func:`install` (called by the package ``__init__``) registers at once if Lightning is already
imported, and otherwise puts a finder on ``sys.meta_path`` that wraps the loader of the top-level
``lightning`` package: right after that package has run (every ``lightning.*`` import runs it
first, and it imports the trainer and the strategies), the name is registered and the finder
removes itself. Either import order works, and registering twice is harmless (a name that is
there is skipped).
"""

from __future__ import annotations

import importlib.abc
import sys
from types import ModuleType
from typing import Any

__all__ = ["install", "register_strategy"]

_TOP = "lightning"


NAME = "hotspa"
DESCRIPTION = "HotSPa: hot-switch parallel layouts per length bucket"


def hotspa_strategy(**kwargs: Any) -> Any:
    """What the registry builds for ``strategy="hotspa"``: a :class:`HotSPaStrategy`.

    A function, not the class, so that registering imports nothing of ours: the hook runs while some
    other module is being imported (often ``adapter/lightning/strategy.py`` itself, whose first Lightning import
    triggers it), and importing the strategy from there would meet it half-initialized. Lightning's
    registry only ever calls the entry (``StrategyRegistry.get``), when a Trainer is built."""
    from .strategy import HotSPaStrategy

    return HotSPaStrategy(**kwargs)


def register_strategy() -> None:
    """Register "hotspa" with Lightning's ``StrategyRegistry`` (imports Lightning; idempotent)."""
    from lightning.pytorch.strategies import StrategyRegistry

    if NAME not in StrategyRegistry:  # Lightning raises on re-registering a name
        StrategyRegistry.register(NAME, hotspa_strategy, description=DESCRIPTION)


class _RegisterAfterExec(importlib.abc.Loader):
    """The real loader of ``lightning``, plus the registration once the package has run."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: Any) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        module.__loader__ = self._loader  # introspection (resources, source) sees the real loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        _uninstall()
        register_strategy()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


class _LightningImportHook(importlib.abc.MetaPathFinder):
    """Finds nothing itself: asks the other finders for ``lightning`` and wraps the loader."""

    hotspa_registration_hook = True  # recognised across reloads of this module

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != _TOP:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or getattr(finder, "hotspa_registration_hook", False) or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _RegisterAfterExec(spec.loader)
                return spec
        return None


def _uninstall() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "hotspa_registration_hook", False)]


def _lightning_is_loaded() -> bool:
    module = sys.modules.get(_TOP)
    spec = getattr(module, "__spec__", None)
    return module is not None and not getattr(spec, "_initializing", False)


def install() -> None:
    """Make sure "hotspa" is registered by the time Lightning can build a Trainer (idempotent)."""
    if _lightning_is_loaded():
        register_strategy()
    elif not any(getattr(f, "hotspa_registration_hook", False) for f in sys.meta_path):
        sys.meta_path.insert(0, _LightningImportHook())
