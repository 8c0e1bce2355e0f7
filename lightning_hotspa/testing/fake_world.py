"""Any world size in one process, with no memory behind the tensors: torch's fake process group
(``FakeStore``, backend ``"fake"``: collectives are no-ops) plus ``FakeTensorMode``, and torch's
``MemTracker`` to account the bytes each rank would hold, by category.

The ONE module of the package that imports torch's private testing / tools APIs (they move between
releases; checked on torch 2.11-2.13). torchtitan's memory estimator works the same way.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

__all__ = ["CATEGORIES", "FakeWorld", "fake_mode", "host_reads_real", "is_fake", "MemoryTracker",
           "static_pipeline_votes"]

#: categories reported, in order (MemTracker's reference types folded into the issue's five)
CATEGORIES = ("params", "grads", "optimizer", "activations", "temporaries")


class FakeWorld:
    """Context: a fake process group of ``world_size`` ranks in which this process is ``rank``."""

    def __init__(self, world_size: int, rank: int = 0) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"fake world needs 0 <= rank < world_size, got rank {rank} of {world_size}")
        self.world_size, self.rank = world_size, rank

    def __enter__(self) -> FakeWorld:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        if dist.is_initialized():
            raise RuntimeError("a process group is already initialized; the fake world needs its own")
        dist.init_process_group("fake", store=FakeStore(), rank=self.rank, world_size=self.world_size)
        return self

    def __exit__(self, *exc: object) -> None:
        dist.destroy_process_group()


def fake_mode():
    """A ``FakeTensorMode`` that accepts real inputs (plan metadata is built outside it)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


def is_fake(t: torch.Tensor) -> bool:
    """Whether ``t`` is a ``FakeTensor`` (shapes only, no bytes behind it)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


@contextlib.contextmanager
def host_reads_real() -> Iterator[None]:
    """For :func:`lightning_hotspa.host.set_host_reads`: host reads of metadata run outside the fake
    mode (on the real tensors the estimator built)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        yield


@contextlib.contextmanager
def static_pipeline_votes() -> Iterator[None]:
    """torch's pipeline schedules (2.13) start with a vote over the pp ranks, point-to-point, on whether
    every stage declared its shapes (STATIC) or some must infer them (DYNAMIC). The fake group moves
    no bytes, so a rank reads its zero-initialized receive buffer (DYNAMIC: it then waits for metadata
    no peer sends), and under ``FakeTensorMode`` the vote's ``.item()`` has no value at all. Within
    the block each rank takes its OWN stages' votes (every stage of this package declares its shapes;
    one that does not raises). Torch releases without the vote are left alone."""
    from torch.distributed.pipelining import schedules

    base = schedules._PipelineSchedule
    original = base.__dict__.get("_warmup_p2p")
    if original is None:
        yield
        return
    from torch.distributed.pipelining._utils import InferenceMode

    def local_vote(self, stages, has_backward, p2p_done):
        for stage in stages:
            if InferenceMode.needs_dynamic(stage._user_meta, has_backward):
                raise RuntimeError(f"pipeline stage {stage.stage_index} declares no static shapes: the fake "
                                   f"world cannot run torch's shape inference (it moves no bytes)")
            stage._inference_mode = InferenceMode.STATIC

    base._warmup_p2p = local_vote
    try:
        yield
    finally:
        base._warmup_p2p = original


def _is_meta(device: object) -> bool:
    return getattr(device, "type", device) == "meta"


class MemoryTracker:
    """``MemTracker`` with the engine's own buffers labelled (:meth:`label`), peak bytes by category."""

    def __init__(self) -> None:
        from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

        self.tracker = MemTracker()
        self.tracker._update_peak_stats = self._update_peak  # per-op: the global peak only (module-wise
        # snapshots cost O(modules) deep copies per op: minutes for a 70B model, and are not reported)
        original = self.tracker._track_module_params_and_buffers

        def track_params(module: torch.nn.Module, install_grad_hooks: bool = True) -> tuple[int, int]:
            # an fsdp unit's gathered weights are autograd outputs, not leaves: no grad hooks on them
            leaves = all(p.grad_fn is None for p in module.parameters())
            return original(module, install_grad_hooks=install_grad_hooks and leaves)

        self.tracker._track_module_params_and_buffers = track_params
        pre_forward = self.tracker._pre_fw_hook

        def pre_forward_again(module: torch.nn.Module, inputs: object) -> None:
            # torch's tracker refuses a top-level module's second forward; a pipeline stage runs one per
            # micro-batch: that module's per-module stats (never reported) start over, the totals go on
            try:
                pre_forward(module, inputs)
            except NotImplementedError:
                self.tracker.memory_tracking.pop(module, None)
                pre_forward(module, inputs)

        self.tracker._pre_fw_hook = pre_forward_again  # bound at __enter__, as torch's own
        self._types = {"params": _MemRefType.PARAM, "grads": _MemRefType.GRAD, "optimizer": _MemRefType.OPT,
                       "activations": _MemRefType.ACT, "temporaries": _MemRefType.TEMP}
        self._fold = {_MemRefType.PARAM: "params", _MemRefType.BUFFER: "params", _MemRefType.GRAD: "grads",
                      _MemRefType.OPT: "optimizer", _MemRefType.ACT: "activations",
                      _MemRefType.TEMP: "temporaries", _MemRefType.OTH: "temporaries"}

    def _update_peak(self, peak_state: object) -> None:
        t = self.tracker
        for dev, snap in t._curr_mem_snap.items():
            if _is_meta(dev):
                continue
            if t._peak_mem.get(dev, 0) < snap["Total"]:
                t._peak_mem[dev] = snap["Total"]
                t._peak_mem_snap[dev] = dict(snap)

    def __enter__(self) -> MemoryTracker:
        self.tracker.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.tracker.__exit__(*exc)

    def label(self, category: str, tensor: torch.Tensor) -> None:
        """Files ``tensor``'s storage under ``category`` (one of :data:`CATEGORIES`)."""
        if isinstance(tensor, torch.distributed.tensor.DTensor):
            tensor = tensor.to_local()
        self.tracker._update_and_maybe_create_winfos(tensor, self._types[category])

    def track(self, *objects: object) -> None:
        self.tracker.track_external(*objects)

    def _folded(self, kind: str) -> dict[str, int]:
        out = dict.fromkeys(CATEGORIES, 0)
        for dev, snap in self.tracker.get_tracker_snapshot(kind).items():
            if _is_meta(dev):  # shape-only stand-ins (an fsdp unit's weights outside its forward)
                continue
            for key, nbytes in snap.items():
                if key in self._fold:
                    out[self._fold[key]] += int(nbytes)
        return out

    def current(self) -> dict[str, int]:
        return self._folded("current")

    def peak(self) -> dict[str, int]:
        """Bytes by category at the moment of the peak total (one device: the fake CPU)."""
        return self._folded("peak")

    def reset_peak(self) -> None:
        """Starts a new peak window from the current bytes (e.g. to measure one phase alone)."""
        t = self.tracker
        t._peak_mem_snap = t.get_tracker_snapshot("current")
        t._peak_mem = {dev: snap.get("Total", 0) for dev, snap in t._peak_mem_snap.items()}
