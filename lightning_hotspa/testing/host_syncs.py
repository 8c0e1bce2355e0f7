"""Counts the operations that would make a CUDA stream wait for the host (or the host for it).

On CPU nothing actually syncs, so the counter names the ops that would on a GPU: reads of a tensor's
value on the host (``aten._local_scalar_dense``: ``.item()``, ``int(t)``, ``bool(t)``), ops whose
output size depends on values (``nonzero``, ``masked_select``, ``unique``, ``repeat_interleave``
without ``output_size``), host data turned into a tensor (``aten.lift_fresh``: ``torch.tensor(list)``
and indexing with a Python list, a host-to-device copy when the tensor lives on a GPU), copies
between devices (``_to_copy`` / ``copy_`` with different devices), and the Python-level host reads
that never reach the dispatcher on CPU (``Tensor.tolist``, ``Tensor.cpu``, ``Tensor.numpy``).
:func:`count_host_syncs` logs each with its op name.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["HostSyncLog", "count_host_syncs"]

_SYNCING_OPS = frozenset({"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique", "_unique2",
                          "unique_consecutive", "unique_dim", "lift_fresh", "lift_fresh_copy"})
_PYTHON_READS = ("tolist", "cpu", "numpy")


class HostSyncLog:
    """The counted ops by name; ``count`` is their total."""

    def __init__(self) -> None:
        self.ops: Counter[str] = Counter()
        self.enabled = True

    @property
    def count(self) -> int:
        return sum(self.ops.values())

    def add(self, name: str) -> None:
        """Counts one op while enabled."""
        if self.enabled:
            self.ops[name] += 1


def _devices(args: tuple, kwargs: dict) -> set[str]:
    out = set()
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            out.add(str(a.device))
    if kwargs.get("device") is not None:
        out.add(str(torch.device(kwargs["device"])))
    return out


class _SyncMode(TorchDispatchMode):
    """Logs the dispatcher-level syncing ops (see the module docstring)."""

    def __init__(self, log: HostSyncLog) -> None:
        super().__init__()
        self.log = log

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._overloadpacket.__name__
        if name in _SYNCING_OPS:
            self.log.add(f"aten.{name}")
        elif name == "repeat_interleave" and kwargs.get("output_size") is None and len(args) < 4:
            self.log.add("aten.repeat_interleave (no output_size)")
        elif name in ("_to_copy", "copy_") and len(_devices(args, kwargs)) > 1:
            self.log.add(f"aten.{name} (across devices)")
        return func(*args, **kwargs)


@contextlib.contextmanager
def count_host_syncs() -> Iterator[HostSyncLog]:
    """Within the block, every would-be host sync of this process is logged by op name; set
    ``log.enabled = False`` to pause counting."""
    log = HostSyncLog()
    originals = {name: getattr(torch.Tensor, name) for name in _PYTHON_READS}

    def wrap(name, fn):
        def counted(self, *args, **kwargs):
            log.add(f"Tensor.{name}")
            return fn(self, *args, **kwargs)
        return counted

    for name, fn in originals.items():
        setattr(torch.Tensor, name, wrap(name, fn))
    try:
        with _SyncMode(log):
            yield log
    finally:
        for name, fn in originals.items():
            setattr(torch.Tensor, name, fn)
