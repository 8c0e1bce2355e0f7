"""Activation checkpointing of one stage: none, selective or full (docs/DESIGN.md §11).

One typed value travels from the planner through the plan, the runtime and the records, as a
``Layout`` does; names (``"dp8+sac"``) are produced only where metrics and tables are written.

- ``NONE``: every block keeps what its backward needs.
- ``SELECTIVE``: each block's attention core (the q / k / v projections, rotary and the attention
  kernel, with its cp exchange) is recomputed in backward from the attention norm's output; every
  GEMM input is kept, and the MLP keeps its w1 / w3 outputs (its gate is recomputed as always).
- ``FULL``: each block keeps only its input and recomputes its whole forward in backward.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from enum import Enum
from typing import Any

from .layout import Layout

__all__ = ["CHECKPOINTING_SPEC_HELP", "Checkpointing", "parse_checkpointing_spec"]

#: what an ``activation_checkpointing`` argument may be (every error message says it the same way)
CHECKPOINTING_SPEC_HELP = "'none', 'selective', 'full', 'auto', a bool or a list of layouts"


class Checkpointing(str, Enum):
    """How much of each block a stage recomputes in backward: ``none`` / ``selective`` / ``full``."""

    NONE = "none"
    SELECTIVE = "selective"
    FULL = "full"

    @classmethod
    def parse(cls, value: Any) -> Checkpointing:
        """``value`` as a mode: a mode, its name (``"none"``, ``"selective"``, ``"full"``), or a bool
        (True: full, False: none, as before the selective mode existed); anything else raises.

        Args:
            value: what a user, a config or a saved state gave.
        """
        if isinstance(value, cls):
            return value
        if isinstance(value, bool):
            return cls.FULL if value else cls.NONE
        if isinstance(value, str):
            for mode in cls:
                if value == mode.value:
                    return mode
        raise ValueError(f"activation checkpointing must be one of 'none', 'selective', 'full' "
                         f"(or a bool: True = 'full'), got {value!r}")

    @property
    def suffix(self) -> str:
        """What a stage or option name appends: ``""``, ``"+sac"``, ``"+ac"``."""
        return _SUFFIX[self]

    @classmethod
    def from_suffix(cls, name: str) -> tuple[str, Checkpointing]:
        """(layout name, mode) of a stage name such as ``"dp8+sac"`` (the inverse of :attr:`suffix`).

        Args:
            name: a stage or option name.
        """
        for mode in (cls.SELECTIVE, cls.FULL):
            if name.endswith(mode.suffix):
                return name[: -len(mode.suffix)], mode
        return name, cls.NONE

    def stronger(self, other: Any) -> Checkpointing:
        """The mode that recomputes more of ``self`` and ``other`` (none < selective < full).

        Args:
            other: a mode (or what :meth:`parse` reads).
        """
        other = Checkpointing.parse(other)
        return self if _ORDER.index(self) >= _ORDER.index(other) else other

    def __bool__(self) -> bool:
        """True if the stage recomputes anything (selective or full)."""
        return self is not Checkpointing.NONE

    def __str__(self) -> str:
        return self.value


_ORDER = (Checkpointing.NONE, Checkpointing.SELECTIVE, Checkpointing.FULL)
_SUFFIX = {Checkpointing.NONE: "", Checkpointing.SELECTIVE: "+sac", Checkpointing.FULL: "+ac"}


def parse_checkpointing_spec(spec: Any) -> str | Checkpointing | tuple[Layout, ...]:
    """An ``activation_checkpointing`` argument (the strategy's, the planners'), parsed: the ONE grammar.

    Args:
        spec: ``"auto"`` (comes back as is); a mode for every layout (``"none"``, ``"selective"``,
            ``"full"``, a :class:`Checkpointing`, or True / False: full / none; comes back as a
            :class:`Checkpointing`); or a list of layouts (names, mappings or Layouts) that
            checkpoint fully (comes back as a tuple of :class:`Layout`). Anything else raises a
            ValueError naming the value.
    """
    if isinstance(spec, str) and spec == "auto":
        return spec
    if isinstance(spec, (bool, str, Checkpointing)):
        try:
            return Checkpointing.parse(spec)
        except ValueError:
            raise ValueError(f"activation_checkpointing must be {CHECKPOINTING_SPEC_HELP}, got {spec!r}") from None
    if isinstance(spec, Mapping) or not isinstance(spec, Iterable):
        raise ValueError(f"activation_checkpointing must be {CHECKPOINTING_SPEC_HELP}, got {spec!r}")
    return tuple(Layout.parse(x) for x in spec)
