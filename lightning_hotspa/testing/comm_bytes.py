"""Counts the bytes each rank receives, by wrapping the collective calls themselves.

Independent of any engine's own accounting, so tests and benchmarks can check that accounting.
Two entry points are wrapped: the ``torch.distributed`` functions (our explicit collectives) and the
functional collectives DTensor issues (seen as ``_c10d_functional`` ops under a dispatch mode; on CPU
CommDebugMode would count those calls but not their bytes).

Received bytes per call (ring algorithms, which is what the volumes mean on real networks):
all-gather ``(g-1) * input``; reduce-scatter ``(g-1)/g * input``; all-reduce ``2 (g-1)/g * input``;
all-to-all ``(g-1)/g * input``; broadcast ``input`` on non-source ranks; a ``batch_isend_irecv`` its
receives. Calls whose volume is not modelled here (barriers, object collectives, reduce / gather /
scatter, single point-to-point calls) are logged with 0 bytes: they still count, and their ranks say
whom they wait for.

Each call also logs the global ranks it synchronises (:attr:`CollectiveLog.ranks`): its process
group's members (the default group: the whole world), for point-to-point calls this rank and its
peer. Tests use them to check which collectives cross which rank groups.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["CollectiveLog", "count_collective_bytes", "group_ranks"]


@dataclass
class CollectiveLog:
    calls: list[tuple[str, int]] = field(default_factory=list)  # (name, bytes received)
    ranks: list[tuple[int, ...]] = field(default_factory=list)  # per call: the global ranks it joins

    def add(self, name: str, nbytes: int, ranks: tuple[int, ...]) -> None:
        self.calls.append((name, nbytes))
        self.ranks.append(ranks)

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
    if name == "batch_isend_irecv":
        return sum(_nbytes(op.tensor) for op in args[0] if op.op is dist.distributed_c10d.irecv)
    return 0


_WRAPPED = ("all_gather_into_tensor", "all_gather", "reduce_scatter_tensor", "all_reduce",
            "all_to_all_single", "broadcast", "batch_isend_irecv",
            # counted with 0 bytes: their ranks are what matters (nothing else synchronises silently)
            "barrier", "monitored_barrier", "all_to_all", "reduce_scatter", "reduce", "gather", "scatter",
            "all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list")
_POINT_TO_POINT = {"send": "dst", "isend": "dst", "recv": "src", "irecv": "src"}


def group_ranks(group) -> tuple[int, ...]:
    """The global ranks of a process group (None: the default group, the whole world)."""
    if group is None:
        return tuple(range(dist.get_world_size()))
    return tuple(dist.get_process_group_ranks(group))


def _call_ranks(name: str, signature: inspect.Signature, args: tuple, kwargs: dict) -> tuple[int, ...]:
    bound = signature.bind_partial(*args, **kwargs).arguments
    if name == "batch_isend_irecv":  # this rank and its peers
        return tuple(sorted({dist.get_rank(), *(int(op.peer) for op in bound["p2p_op_list"])}))
    members = group_ranks(bound.get("group"))
    peer_arg = _POINT_TO_POINT.get(name)
    if peer_arg is None:
        return members
    peer = bound.get(peer_arg)
    if peer is None and bound.get(f"group_{peer_arg}") is not None:
        peer = members[bound[f"group_{peer_arg}"]]
    if peer is None:  # recv from any source
        return members
    return tuple(sorted({dist.get_rank(), int(peer)}))


class _FunctionalCollectiveMode(TorchDispatchMode):
    """Sees DTensor's functional collectives (``torch.ops._c10d_functional.*``)."""

    def __init__(self, log: CollectiveLog) -> None:
        super().__init__()
        self.log = log

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._overloadpacket.__name__
        if func.namespace == "_c10d_functional" and name in _FUNCTIONAL_COLLECTIVES:
            self._log(name, args, kwargs)
        return func(*args, **kwargs)

    def _log(self, name: str, args: tuple, kwargs: dict) -> None:
        """Logs one functional collective; every one names its group last (as ``group_name``)."""
        from torch.distributed.distributed_c10d import _resolve_process_group

        group = _resolve_process_group(kwargs.get("group_name", args[-1]))
        ranks = group_ranks(group)
        g = len(ranks)
        inputs = args[0] if name.endswith("_coalesced") else [args[0]]
        size = sum(_nbytes(t) for t in inputs)
        base = name.removesuffix("_coalesced")
        if base == "all_gather_into_tensor":
            self.log.add(name, (g - 1) * size, ranks)
        elif base in ("reduce_scatter_tensor", "all_to_all_single"):
            self.log.add(name, (g - 1) * size // g, ranks)
        elif base == "all_reduce":
            self.log.add(name, 2 * (g - 1) * size // g, ranks)
        else:  # broadcast, point-to-point: not modelled, still logged
            self.log.add(name, 0, ranks)


# the ops of ``torch.ops._c10d_functional`` that communicate; the rest (``wait_tensor``,
# ``_wrap_tensor_autograd`` on torch 2.13, ...) are bookkeeping and take no group
_FUNCTIONAL_COLLECTIVES = frozenset({
    "all_gather_into_tensor", "all_gather_into_tensor_coalesced", "reduce_scatter_tensor",
    "reduce_scatter_tensor_coalesced", "all_reduce", "all_reduce_coalesced", "all_to_all_single",
    "broadcast"})


@contextlib.contextmanager
def count_collective_bytes() -> Iterator[CollectiveLog]:
    """Within the block, every collective this rank issues is logged with the bytes it receives
    and the ranks it joins."""
    log = CollectiveLog()
    originals = {name: getattr(dist, name) for name in (*_WRAPPED, *_POINT_TO_POINT) if hasattr(dist, name)}

    def wrap(name, fn):
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def counted(*args, **kwargs):
            log.add(name, _received(name, args, kwargs), _call_ranks(name, signature, args, kwargs))
            return fn(*args, **kwargs)

        return counted

    wrapped = {name: wrap(name, fn) for name, fn in originals.items()}
    for name, fn in wrapped.items():
        setattr(dist, name, fn)
    p2p_op = dist.P2POp
    dist.P2POp = _p2p_op_class(p2p_op, {id(wrapped[n]): originals[n] for n in ("isend", "irecv")})
    try:
        with _FunctionalCollectiveMode(log):
            yield log
    finally:
        dist.P2POp = p2p_op
        for name, fn in originals.items():
            setattr(dist, name, fn)


def _p2p_op_class(base: type, unwrap: dict[int, object]) -> type:
    """``P2POp`` that accepts the counted ``dist.isend`` / ``dist.irecv`` (torch's pipelining builds
    ``dist.P2POp(dist.isend, ...)``; ``P2POp`` accepts only the original functions) and holds the
    original: the ``batch_isend_irecv`` that runs it is counted once, with its receives' bytes."""

    class CountedP2POp(base):
        def __new__(cls, op, *args, **kwargs):
            return super().__new__(cls, unwrap.get(id(op), op), *args, **kwargs)

        def __init__(self, op, *args, **kwargs) -> None:
            super().__init__(unwrap.get(id(op), op), *args, **kwargs)

    return CountedP2POp
