"""What a rank does when something goes wrong inside a step: know where it is, say so, decide alike.

* :class:`StepTracker` keeps each rank's breadcrumb (step, stage, layout, micro-batch, phase). On
  gloo a failed or timed-out collective raises inside the step; :meth:`StepTracker.guard` re-raises
  it as a :class:`CollectiveError` naming the breadcrumb (the original stays as ``__cause__``). On
  NCCL the watchdog aborts the process instead, so no Python handler runs: the breadcrumb is
  written at every phase change to a small per-rank file (one ``pwrite`` of a fixed-width line) and
  to the debug log, and the NCCL flight recorder is switched on before the process group exists
  (:func:`enable_nccl_flight_recorder`).
* A non-finite loss is detected without a host sync per micro-batch: the step's loss total is
  gathered once per step anyway (``engine.records.gather_step``) and any NaN/Inf micro-batch loss
  makes it non-finite, so every rank reaches the same verdict from the same numbers. Only then are the
  per-micro-batch losses the tracker kept inspected, and the ranks exchange what they found so the
  report names every offending micro-batch. Policy ``"stop"`` (default) raises
  :class:`NonFiniteLossError`; ``"skip"`` drops the update and logs the plan that caused it.

``CollectiveError`` and ``is_collective_failure`` live on the ground floor (``collective_names``, which
the checkpoint code reads too) and are re-exported here.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ...collective_names import CollectiveError, failed_collective, is_collective_failure
from ...group_collectives import world_collectives

__all__ = ["NONFINITE_POLICIES", "CollectiveError", "as_timeout", "NonFiniteLossError", "StepTracker",
           "check_breadcrumb_dir", "check_nonfinite_policy", "enable_nccl_flight_recorder", "is_collective_failure",
           "subgroup_timeout"]

log = logging.getLogger(__name__)

NONFINITE_POLICIES = ("stop", "skip")
# entries kept by the NCCL flight recorder when the user did not choose (torch's own default is 0: off)
FLIGHT_RECORDER_ENTRIES = "2000"
_STAGE_PHASES = ("switch", "forward-backward", "reduce")  # phases inside one stage
_LINE = 400  # the breadcrumb file holds one line padded to this width, rewritten in place
#: the sub-groups' timeout on NCCL unless the user sets one: a step's collectives take seconds, and a
#: hung peer should be reported in minutes, not after torch's 30 (docs/gpu-runtime.md)
NCCL_SUBGROUP_TIMEOUT = timedelta(minutes=10)


class NonFiniteLossError(FloatingPointError):
    """A micro-batch loss was NaN or Inf under ``nonfinite="stop"``; raised on every rank before the update."""


def check_nonfinite_policy(value: Any) -> str:
    if not isinstance(value, str) or value not in NONFINITE_POLICIES:
        raise ValueError(f"nonfinite must be one of {NONFINITE_POLICIES}, got {value!r}")
    return value


def enable_nccl_flight_recorder(backend: str | None, environ: Any = None) -> bool:
    """Switch on the NCCL flight recorder (and its dump on timeout) unless the user set it; must run
    before the process group is created. Returns whether this call set it."""
    environ = os.environ if environ is None else environ
    if backend is None or "nccl" not in backend or "TORCH_NCCL_TRACE_BUFFER_SIZE" in environ:
        return False
    environ["TORCH_NCCL_TRACE_BUFFER_SIZE"] = FLIGHT_RECORDER_ENTRIES
    environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    return True


@dataclass
class _Loss:
    loss: torch.Tensor  # 0-d, detached, on the device: inspected only after a non-finite step
    stage: int
    layout: str
    label: str
    micro_batch: int
    doc_ids: tuple[int, ...]


def check_breadcrumb_dir(directory: str | os.PathLike | None) -> None:
    """A breadcrumb folder that is a file, or lies under one, is a ValueError naming it (not a bare
    FileExistsError at setup).

    Args:
        directory: ``breadcrumb_dir`` (or ``$HOTSPA_BREADCRUMB_DIR``); None: off.
    """
    if directory is None:
        return
    path = Path(directory).expanduser()
    blocker = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        where = "is a file" if blocker == path else f"lies under the file {str(blocker)!r}"
        raise ValueError(f"breadcrumb_dir {str(directory)!r} {where}: give a folder (each rank writes "
                         f"rank<N>.txt into it)")


class StepTracker:
    """One rank's breadcrumb and the step's micro-batch losses. Cheap to update: attribute writes,
    plus one ``pwrite`` per phase change when a breadcrumb file is on."""

    def __init__(self) -> None:
        self.rank = 0
        self.step: int | None = None
        self.batch_idx: int | None = None
        self.stage = -1
        self.num_stages = 0
        self.layout = "-"
        self.label = ""
        self.micro_batch = -1
        self.num_micro_batches = 0
        self.phase = "idle"
        self.losses: list[_Loss] = []
        self.path: Path | None = None
        self._fd: int | None = None

    # ------------------------------------------------------------------ breadcrumb
    def open_file(self, directory: str | os.PathLike, rank: int) -> Path:
        """Keep the breadcrumb in ``directory/rank<rank>.txt`` too (what survives an NCCL abort)."""
        self.close_file()
        check_breadcrumb_dir(directory)
        self.path = Path(directory) / f"rank{rank}.txt"
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"breadcrumb_dir {str(directory)!r} cannot be created: {type(exc).__name__}: "
                             f"{exc.strerror or exc}") from None
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._changed()
        return self.path

    def close_file(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def begin_step(self, step: int, batch_idx: int, num_stages: int) -> None:
        self.step, self.batch_idx, self.num_stages = step, batch_idx, num_stages
        self.stage, self.layout, self.label, self.micro_batch, self.num_micro_batches = -1, "-", "", -1, 0
        self.losses = []
        self.enter_phase("start")

    def enter_stage(self, stage: Any) -> None:
        """A new stage begins with the switch into its layout."""
        self.stage += 1
        block = getattr(stage, "block", None)  # a mixed stage: this rank computes in its block's layout
        note = getattr(stage, "block_note", "")  # a block stage: which block, its layout, copy and ranks
        self.layout = str(stage.layout) + (f", block {note or block}" if block is not None else "")
        self.label = getattr(stage, "label", "") or ""
        self.micro_batch, self.num_micro_batches = -1, len(stage.micro_batches)
        self.enter_phase("switch")

    def enter_micro_batch(self) -> None:
        self.micro_batch += 1
        self.enter_phase("forward-backward")

    def enter_phase(self, phase: str) -> None:
        self.phase = phase
        self._changed()

    def _changed(self) -> None:
        if self._fd is not None:
            line = self.describe().encode()[:_LINE - 1].ljust(_LINE - 1) + b"\n"
            os.pwrite(self._fd, line, 0)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("hotspa breadcrumb: %s", self.describe())

    def between_steps(self, phase: str, global_step: int) -> None:
        """Work outside a step's stages (a checkpoint save, evaluation)."""
        self.step, self.batch_idx, self.stage = global_step, None, -1
        self.enter_phase(phase)

    def describe(self) -> str:
        where = f"rank {self.rank}"
        if self.step is None:
            return f"{where}, before the first step, phase {self.phase}"
        where += f", global step {self.step}" + (f" (batch {self.batch_idx})" if self.batch_idx is not None else "")
        if self.stage >= 0 and self.phase in _STAGE_PHASES:
            bucket = f", bucket {self.label}" if self.label and self.label != self.layout else ""
            where += f", stage {self.stage + 1}/{self.num_stages} (layout {self.layout}{bucket})"
            if self.micro_batch >= 0 and self.phase == "forward-backward":
                where += f", micro-batch {self.micro_batch + 1}/{self.num_micro_batches}"
        return where + f", phase {self.phase}"

    @contextlib.contextmanager
    def guard(self, operation: str | None = None) -> Iterator[None]:
        """Re-raise a failed collective as a :class:`CollectiveError` that says where this rank was."""
        try:
            yield
        except BaseException as exc:  # noqa: BLE001 - re-raised, wrapped only if it is a collective failure
            if not is_collective_failure(exc):
                raise
            inner = exc
            failures = getattr(exc, "failures", None)  # DCP's CheckpointException: every rank's error
            if isinstance(failures, dict) and failures:
                inner = next(iter(failures.values()))[0]
            first = (str(inner).strip().splitlines() or [type(inner).__name__])[0]
            noted = failed_collective(exc)  # the runtime's note: which collective, on which group
            op = f" in {noted or operation}" if noted or operation else ""
            raise CollectiveError(
                f"a collective failed{op} at {self.describe()}: {type(inner).__name__}: {first[:500]} -- another rank "
                f"has probably died or hung (see its log); resume from the last complete checkpoint") from exc

    # ------------------------------------------------------------------ non-finite losses
    def record_loss(self, loss: torch.Tensor, micro_batch: Any) -> None:
        """Keep this micro-batch's loss (no host sync) for the report, should the step turn out non-finite."""
        self.losses.append(_Loss(loss.detach().reshape(()), self.stage, self.layout, self.label, self.micro_batch,
                                 tuple(getattr(micro_batch, "doc_ids", ()))))

    def nonfinite_report(self, plan: Any) -> str:
        """Every rank's non-finite micro-batches (a collective: call on every rank, after they all
        found the step's gathered loss non-finite) and the plan they came from."""
        bad = []
        if self.losses:
            finite = torch.isfinite(torch.stack([x.loss.float() for x in self.losses])).tolist()
            bad = [(self.rank, x.stage, x.layout, x.label, x.micro_batch, x.doc_ids, float(x.loss))
                   for x, ok in zip(self.losses, finite) if not ok]
        everyone = [bad]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            everyone = world_collectives().all_gather_object(bad)
        lines = []
        for rank, stage, layout, label, mb, docs, value in sorted(x for found in everyone for x in (found or [])):
            bucket = f" bucket {label}" if label and label != layout else ""
            docs_text = f", documents {list(docs)[:8]}" if docs else ""
            lines.append(f"rank {rank} stage {stage + 1} (layout {layout}{bucket}) micro-batch {mb + 1}: "
                         f"loss {value}{docs_text}")
        where = "; ".join(lines) or "no single micro-batch loss was non-finite (their weighted sum overflowed)"
        return f"non-finite loss at step {self.step} (batch {self.batch_idx}): {where}. Plan: {plan_summary(plan)}"


def plan_summary(plan: Any) -> str:
    """The stages of this rank's plan (layout, bucket, micro-batches, tokens) and the data position."""
    parts = []
    for i, stage in enumerate(getattr(plan, "stages", ())):
        tokens = sum(getattr(m, "num_tokens", 0) for m in stage.micro_batches)
        label = getattr(stage, "label", "")
        bucket = f" bucket {label}" if label and label != str(stage.layout) else ""
        parts.append(f"stage {i + 1} {stage.layout}{bucket}: {len(stage.micro_batches)} micro-batches, "
                     f"{tokens} tokens here")
    extras = getattr(plan, "extras", {}) or {}
    position = {k: extras[k] for k in ("epoch", "step", "stream_step") if k in extras}
    return "[" + "; ".join(parts) + "]" + (f" data position {position}" if position else "")


def subgroup_timeout(backend: str | None, timeout: timedelta, subgroup: Any = None) -> timedelta:
    """The timeout of the mesh's sub-groups (tp, cp, dp and the switch's ranges).

    Args:
        backend: the process-group backend (``"nccl"``, ``"gloo"``, ...).
        timeout: the default group's timeout (the strategy's ``timeout``).
        subgroup: the user's choice (a ``timedelta`` or seconds), or None: on NCCL
            :data:`NCCL_SUBGROUP_TIMEOUT` (no longer than ``timeout``), elsewhere ``timeout``.
    """
    if subgroup is not None:
        return as_timeout(subgroup, "subgroup_timeout")
    if backend is not None and "nccl" in backend:
        return min(NCCL_SUBGROUP_TIMEOUT, timeout)
    return timeout


def as_timeout(timeout: Any, name: str = "timeout") -> timedelta:
    """The process-group timeout: a ``timedelta``, or seconds as a number (what a YAML config can say).

    Args:
        timeout: the value given.
        name: the argument's name, for the error a bad value raises.
    """
    if isinstance(timeout, timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise ValueError(f"{name} must be a datetime.timedelta or a number of seconds, got {timeout!r}")
    if not seconds > 0:
        raise ValueError(f"{name} must be positive, got {timeout!r}")
    return timeout if isinstance(timeout, timedelta) else timedelta(seconds=seconds)
