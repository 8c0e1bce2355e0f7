"""The one mutable object the installed TP / CP hooks read: which layout is active, for which batch.

Hooks are installed once per model; a layout switch only updates this state (and the parameters),
so switching re-wraps nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..mesh import LayoutGroups
from ..plan import MicroBatch

__all__ = ["ParallelState"]


@dataclass
class ParallelState:
    groups: LayoutGroups | None = None  # the active layout's tp / cp / dp groups on this rank
    micro_batch: MicroBatch | None = None  # the micro-batch being computed (cp needs its row layout)

    @property
    def tp_size(self) -> int:
        return self.groups.tp.size if self.groups is not None else 1

    @property
    def cp_size(self) -> int:
        return self.groups.cp.size if self.groups is not None else 1
