"""Progress of a long command on stderr (tqdm), so stdout keeps only the command's own output and
its JSON line last.

A bar shows only where stderr is a terminal, or where ``HOTSPA_PROGRESS=1`` (``true``, ``yes``,
``on``) asks for it (a log); ``HOTSPA_PROGRESS=0`` (``false``, ``no``, ``off``) turns it off; other
values are refused. Each bar gives the item count, rate and time left.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Iterator
from typing import TypeVar

__all__ = ["progress", "progress_enabled"]

T = TypeVar("T")


_ON, _OFF = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def progress_enabled() -> bool:
    """``HOTSPA_PROGRESS`` when set (``1`` / ``true`` / ``yes`` / ``on`` or ``0`` / ``false`` / ``no`` /
    ``off``, any case), else whether stderr is a terminal; any other value is a ValueError naming it."""
    setting = os.environ.get("HOTSPA_PROGRESS", "").strip()
    if setting.lower() in _ON + _OFF:
        return setting.lower() in _ON
    if setting:
        raise ValueError(f"HOTSPA_PROGRESS={setting!r}: use one of {', '.join(_ON)} (a bar) or {', '.join(_OFF)} "
                         f"(none), or unset it (a bar where stderr is a terminal)")
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
