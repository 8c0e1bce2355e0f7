"""Stage timings from the device's own clock, behind one small seam.

Why: on an accelerator, the host returns from a forward long before the device has run it, so a
host clock read around a stage measures launches, not work. :class:`CudaEventClock` records CUDA
events on the current stream and reads the seconds between them once, at the end of the step (one
synchronization per step, not one per stage). On CPU the work runs on the calling thread, so the
host clock (:class:`HostClock`, ``time.perf_counter``) is exact. MFU, the timeline, the monitor's
``predicted_over_measured`` and the profiled planner all read these seconds (``StageStats``).

A rank's CPU seconds (``time.process_time``, all its threads) are kept beside them: on a box where
ranks time-share cores they are what the stage would take on a core of its own (the CLI's
``check-calibration --clock cpu`` reads them).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch

from ..torch_compat import cuda_events_time

__all__ = ["Clock", "CudaEventClock", "HostClock", "clock_for", "cpu_seconds"]

#: this process' CPU seconds (all threads): the second clock a stage record carries
cpu_seconds: Callable[[], float] = time.process_time


@runtime_checkable
class Clock(Protocol):
    """Marks points of one step; the seconds between two marks are read after the step's work."""

    def mark(self) -> Any:
        """A point in time on the clock's timeline (cheap; never waits for the device)."""
        ...

    def seconds(self, start: Any, end: Any) -> float:
        """Seconds from ``start`` to ``end``; may wait for the device to reach ``end``."""
        ...


class HostClock:
    """``time.perf_counter``: exact where the work runs on the calling thread (CPU)."""

    def mark(self) -> float:
        return time.perf_counter()

    def seconds(self, start: float, end: float) -> float:
        return end - start


class CudaEventClock:
    """CUDA events on the current stream of ``device``: the device's time between two marks."""

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.device = torch.device(device) if device is not None else torch.device("cuda")

    def mark(self) -> Any:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def seconds(self, start: Any, end: Any) -> float:
        end.synchronize()
        return start.elapsed_time(end) / 1e3  # elapsed_time is in milliseconds


def clock_for(device: torch.device | str) -> Clock:
    """The device's own clock: CUDA events on a CUDA device, the host clock elsewhere (CPU, and
    devices whose events torch does not time)."""
    device = torch.device(device)
    return CudaEventClock(device) if cuda_events_time(device) else HostClock()
