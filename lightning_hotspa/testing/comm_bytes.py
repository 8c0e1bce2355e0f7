"""Counts the bytes each rank receives, by wrapping the collective calls themselves.

Independent of any engine's own accounting, so tests and benchmarks can check that accounting.
Two entry points are wrapped: the ``torch.distributed`` functions (our explicit collectives) and the
functional collectives DTensor issues (seen as ``_c10d_functional`` ops under a dispatch mode; on CPU
CommDebugMode would count those calls but not their bytes).

Received bytes per call (ring algorithms, which is what the volumes mean on real networks):
all-gather ``(g-1) * input``; reduce-scatter ``(g-1)/g * input``; all-reduce ``2 (g-1)/g * input``;
all-to-all ``(g-1)/g * input``; broadcast ``input`` on non-source ranks.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["CollectiveLog", "count_collective_bytes"]


@dataclass
class CollectiveLog:
    calls: list[tuple[str, int]] = field(default_factory=list)  # (name, bytes received)

    @property
    def bytes_received(self) -> int:
        return sum(b for _, b in self.calls)

    @property
    def count(self) -> int:
        return len(self.calls)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _group_size(group) -> int:
    return dist.get_world_size(group)


def _received(name: str, args: tuple, kwargs: dict) -> int:
    group = kwargs.get("group")
    if name == "all_gather_into_tensor":
        out, inp = args[0], args[1]
        return _nbytes(out) - _nbytes(inp)
    if name == "all_gather":
        return (len(args[0]) - 1) * _nbytes(args[1])
    if name == "reduce_scatter_tensor":
        out, inp = args[0], args[1]
        return _nbytes(inp) - _nbytes(out)
    if name == "all_reduce":
        g = _group_size(group if group is not None else (args[2] if len(args) > 2 else None))
        return 2 * (g - 1) * _nbytes(args[0]) // g
    if name == "all_to_all_single":
        g = _group_size(group if group is not None else (args[4] if len(args) > 4 else None))
        return (g - 1) * _nbytes(args[1]) // g
    if name == "broadcast":
        src = kwargs.get("src", args[1] if len(args) > 1 else 0)
        return 0 if dist.get_rank() == src else _nbytes(args[0])
    return 0


_WRAPPED = ("all_gather_into_tensor", "all_gather", "reduce_scatter_tensor", "all_reduce",
            "all_to_all_single", "broadcast")


class _FunctionalCollectiveMode(TorchDispatchMode):
    """Sees DTensor's functional collectives (``torch.ops._c10d_functional.*``)."""

    def __init__(self, log: CollectiveLog) -> None:
        super().__init__()
        self.log = log

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._overloadpacket.__name__
        if func.namespace == "_c10d_functional":
            inp = args[0]
            if name == "all_gather_into_tensor":
                self.log.calls.append((name, (args[1] - 1) * _nbytes(inp)))
            elif name == "reduce_scatter_tensor":
                g = args[2]
                self.log.calls.append((name, (g - 1) * _nbytes(inp) // g))
            elif name in ("all_reduce", "all_to_all_single"):
                # the group size is not an argument of these ops; resolve it from the group name
                from torch.distributed.distributed_c10d import _resolve_process_group

                g = _resolve_process_group(args[-1]).size()
                factor = 2 if name == "all_reduce" else 1
                self.log.calls.append((name, factor * (g - 1) * _nbytes(inp) // g))
        return func(*args, **kwargs)


@contextlib.contextmanager
def count_collective_bytes() -> Iterator[CollectiveLog]:
    """Within the block, every collective this rank issues is logged with the bytes it receives."""
    log = CollectiveLog()
    originals = {name: getattr(dist, name) for name in _WRAPPED}

    def wrap(name, fn):
        @functools.wraps(fn)
        def counted(*args, **kwargs):
            log.calls.append((name, _received(name, args, kwargs)))
            return fn(*args, **kwargs)

        return counted

    for name, fn in originals.items():
        setattr(dist, name, wrap(name, fn))
    try:
        with _FunctionalCollectiveMode(log):
            yield log
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
