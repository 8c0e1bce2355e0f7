"""Progress of a long command on stderr (tqdm), so stdout keeps only the command's own output and
its JSON line last.

A bar shows only where stderr is a terminal, or where ``HOTSPA_PROGRESS=1`` asks for it (a log);
``HOTSPA_PROGRESS=0`` turns it off. Each bar gives the item count, rate and time left.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Iterator
from typing import TypeVar

__all__ = ["progress", "progress_enabled"]

T = TypeVar("T")


def progress_enabled() -> bool:
    """``HOTSPA_PROGRESS`` when set (``1`` / ``0``), else whether stderr is a terminal."""
    setting = os.environ.get("HOTSPA_PROGRESS", "").strip()
    if setting in ("0", "1"):
        return setting == "1"
    return bool(getattr(sys.stderr, "isatty", lambda: False)())


def progress(items: Iterable[T], desc: str, total: int | None = None, unit: str = "cell") -> Iterator[T]:
    """``items``, with a bar on stderr while they are consumed (see :func:`progress_enabled`).

    Args:
        items: what the command works through.
        desc: the bar's label, e.g. ``"simulate --grid long"``.
        total: how many items (default ``len(items)`` where it has one).
        unit: what one item is called on the bar.
    """
    if not progress_enabled():
        yield from items
        return
    from tqdm import tqdm

    if total is None and hasattr(items, "__len__"):
        total = len(items)  # type: ignore[arg-type]
    with tqdm(items, desc=desc, total=total, unit=unit, file=sys.stderr, dynamic_ncols=True) as bar:
        yield from bar
