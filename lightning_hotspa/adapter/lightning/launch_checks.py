"""Checks that need the arguments of ``fit`` but must run before any process starts.

Lightning hands ``ckpt_path`` to the strategy only after the process group and the model exist
(``restore_checkpoint_after_setup``); the launcher sees it first, in the process that spawns the
others. A ``ckpt_path`` that names nothing fails there, once, instead of on every rank later.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..checkpoints.nodes import LATEST_OR_SCRATCH_PREFIX, LATEST_PREFIX, expand_node
from ..checkpoints.trust import CheckpointError
from .lightning_compat import SubprocessScriptLauncher

__all__ = ["CheckingLauncher", "precheck_ckpt_path"]

_LIGHTNING_NAMES = ("last", "best", "hpc")  # resolved by Lightning itself


def precheck_ckpt_path(spec: Any, node: int) -> None:
    """Raises :class:`CheckpointError` when ``ckpt_path`` names a folder that is not there.

    Args:
        spec: ``ckpt_path`` as given to ``fit`` (None, a path, ``latest:<dir>``, ``latest_or_scratch:<dir>``).
        node: the node rank (``{node}`` in the path).
    """
    if spec is None or str(spec) in _LIGHTNING_NAMES or str(spec).startswith(LATEST_OR_SCRATCH_PREFIX) \
            or "://" in str(spec):
        return
    spec = str(spec)
    if spec.startswith(LATEST_PREFIX):
        directory = spec[len(LATEST_PREFIX):]
        folder = Path(expand_node(directory, node))
        if directory and not folder.is_dir():
            raise CheckpointError(f"ckpt_path={spec!r}: no complete checkpoint in {directory!r} (no such folder; "
                                  f"checked before starting the processes). To start from scratch when there is "
                                  f"none, ask for it: {LATEST_OR_SCRATCH_PREFIX}{directory}")
        return
    path = Path(expand_node(spec, node))
    if not path.exists() and not path.with_name(path.name + ".old").exists():
        raise CheckpointError(f"checkpoint {spec!r} does not exist (checked before starting the processes)")


def _ckpt_arg(function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The ``ckpt_path`` argument of the trainer function being launched, if it has one."""
    try:
        return inspect.signature(function).bind_partial(*args, **kwargs).arguments.get("ckpt_path")
    except (TypeError, ValueError):
        return None


class CheckingLauncher(SubprocessScriptLauncher):
    """Lightning's subprocess-script launcher, checking ``ckpt_path`` before it starts any process."""

    def launch(self, function: Callable[..., Any], *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        """Checks ``ckpt_path``, then launches as Lightning does.

        Args:
            function: the trainer function (``_fit_impl`` and the like).
            args: its positional arguments.
            trainer: the Trainer.
            kwargs: its keyword arguments.
        """
        precheck_ckpt_path(_ckpt_arg(function, args, kwargs), self.cluster_environment.node_rank())
        return super().launch(function, *args, trainer=trainer, **kwargs)
