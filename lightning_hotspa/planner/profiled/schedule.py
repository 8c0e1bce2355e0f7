"""Which coefficient version plans each step: the profiled planner's versions, shared with loader workers.

Plans are built AHEAD of the step that runs them: Lightning fetches the next batch before running the
current one, and DataLoader workers (their own processes, each with a pickled copy of the planner)
prefetch ``num_workers * prefetch_factor`` more. A refit happens in the main process, at the end of
a training step. So "use the newest coefficients" would make a plan depend on how far ahead it was
built: on timing, i.e. different on different ranks. The rule instead:

    the refit decided at step ``r`` (after observing steps <= r) applies to the plans of steps
    ``>= r + lag``; a plan of step ``s`` uses the newest version whose effective step is <= ``s``.

That is a pure function of ``s`` once every refit at steps ``<= s - lag`` has been decided, the same
on every rank and in every process. ``lag >= 2`` covers Lightning's own one-batch prefetch in the
main process (plan ``s`` is built after step ``s - 2`` finished); the DataModule raises it to
``num_workers * prefetch_factor + 2`` for a loader with workers (:meth:`ensure_lag`), so in steady
state nothing waits. The versions (and the lag) live in a small float64 tensor in shared memory, so
workers (fork or spawn: torch passes shared storage by handle) see refits as the main process
publishes them; a worker asked for step ``s`` before the refit of step ``s - lag`` is decided waits
for it (it is prefetching, the main process needs earlier plans first, so this cannot deadlock; a
worker still waiting when training ends is stopped by the DataLoader's shutdown). The main process
never waits: a plan requested too early there is an error naming the steps (raise ``plan_lag``).

Evaluation plans (validation, prediction: no training position) use the newest decided version:
they are built while training is paused, when every rank holds the same versions.

Row layout: row 0 is a header ``(entries, decided_through, generation, lag)``; entry rows are
``(effective_step, version, scale, then a, b, c, e per option key, NaN where not fitted)``. Writers
bump ``generation`` to odd before and to even after a change; readers retry until they read the
same even generation before and after (a seqlock), so a worker never sees half an entry.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ...activation_checkpointing import Checkpointing
from ...layout import Layout
from ...plan import PlanError

__all__ = ["CoefficientSchedule", "ScheduleEntry"]

OptionKey = tuple[Layout, Checkpointing]
_HEAD = 3  # leading columns of an entry row
_NEVER = -(2.0**62)  # effective step of the initial version


@dataclass(frozen=True)
class ScheduleEntry:
    """One coefficient version: effective from ``effective_step`` (plans of steps >= it)."""

    effective_step: int
    version: int
    scale: float
    fitted: dict[OptionKey, tuple[float, float, float, float]]


class CoefficientSchedule:
    """Coefficient versions by effective step, in shared memory (see the module docstring).

    ``keys``: the option keys whose fitted coefficients are stored (fixed order); ``refit_every``:
    the steps refits happen at; ``lag``: steps between a refit and the first plan it affects.
    """

    def __init__(self, keys: Sequence[OptionKey], refit_every: int, lag: int, capacity: int = 64,
                 wait_timeout_s: float = 600.0) -> None:
        if lag < 0 or refit_every < 1 or capacity < 2:
            raise ValueError(f"need lag >= 0, refit_every >= 1, capacity >= 2; got {lag}, {refit_every}, {capacity}")
        self.keys = tuple(keys)
        self.refit_every, self.capacity = int(refit_every), int(capacity)
        self.wait_timeout_s = float(wait_timeout_s)
        self._table = torch.zeros(capacity + 1, max(4, _HEAD + 4 * len(self.keys)), dtype=torch.float64).share_memory_()
        self._table[0, 3] = float(lag)
        self._write([ScheduleEntry(int(_NEVER), 0, 1.0, {})], -1)

    @property
    def lag(self) -> int:
        return int(self._table[0, 3])

    def ensure_lag(self, lag: int) -> None:
        """Raises the lag to at least ``lag`` (versions already published keep their steps)."""
        if lag > self.lag:
            self._table[0, 3] = float(lag)

    # ------------------------------------------------------------------ writing (main process)
    def _write(self, entries: Sequence[ScheduleEntry], decided_through: int) -> None:
        if len(entries) > self.capacity:
            raise PlanError(f"coefficient schedule holds at most {self.capacity} versions, got {len(entries)}")
        rows = torch.full((len(entries), self._table.shape[1]), math.nan, dtype=torch.float64)
        rows[:, _HEAD + 4 * len(self.keys):] = 0.0
        for i, e in enumerate(entries):
            rows[i, :3] = torch.tensor([float(e.effective_step), float(e.version), e.scale], dtype=torch.float64)
            for k, key in enumerate(self.keys):
                if key in e.fitted:
                    rows[i, 3 + 4 * k:7 + 4 * k] = torch.tensor(e.fitted[key], dtype=torch.float64)
        head = self._table[0]
        head[2] += 1  # odd: writing
        self._table[1:1 + len(entries)] = rows
        head[0] = float(len(entries))
        head[1] = float(decided_through)
        head[2] += 1  # even: consistent

    def publish(self, decided_at: int, version: int, scale: float,
                fitted: Mapping[OptionKey, tuple[float, float, float, float]]) -> ScheduleEntry:
        """Adds the version decided by the refit of step ``decided_at``; it plans steps >= decided_at + lag.
        Versions no pending plan can use any more (superseded before the first undecided step) are dropped."""
        entries, decided = self.read()
        entry = ScheduleEntry(int(decided_at) + self.lag, int(version), float(scale), dict(fitted))
        if entries and entry.effective_step < entries[-1].effective_step:
            raise PlanError(f"the refit of step {decided_at} would plan from step {entry.effective_step}, before the "
                            f"newest version (from step {entries[-1].effective_step}): refits must run in step order")
        first_pending = max(decided, int(decided_at)) + 1
        keep = [e for i, e in enumerate(entries)
                if i + 1 == len(entries) or entries[i + 1].effective_step > first_pending]
        self._write([*keep, entry][-self.capacity:], max(decided, int(decided_at)))
        return entry

    def mark_decided(self, step: int) -> None:
        """Every refit at steps <= ``step`` has been decided (changed or not)."""
        entries, decided = self.read()
        if step > decided:
            self._write(entries, int(step))

    def load(self, entries: Sequence[ScheduleEntry], decided_through: int, lag: int | None = None) -> None:
        if lag is not None:
            self.ensure_lag(lag)
        self._write(list(entries) or [ScheduleEntry(int(_NEVER), 0, 1.0, {})], decided_through)

    # ------------------------------------------------------------------ reading (any process)
    def _snapshot(self) -> torch.Tensor:
        while True:
            g1 = float(self._table[0, 2])
            if g1 % 2 == 0:
                snap = self._table.clone()
                if float(self._table[0, 2]) == g1:
                    return snap
            time.sleep(0)

    def read(self) -> tuple[list[ScheduleEntry], int]:
        """(entries oldest first, decided_through), consistent (retries while a write is under way)."""
        entries, decided, _ = self._read()
        return entries, decided

    def _read(self) -> tuple[list[ScheduleEntry], int, int]:
        snap = self._snapshot()
        count, decided = int(snap[0, 0]), int(snap[0, 1])
        entries = []
        for row in snap[1:1 + count].tolist():
            fitted = {key: tuple(row[3 + 4 * k:7 + 4 * k]) for k, key in enumerate(self.keys)
                      if not math.isnan(row[3 + 4 * k])}
            entries.append(ScheduleEntry(int(row[0]), int(row[1]), float(row[2]), fitted))  # type: ignore[arg-type]
        return entries, decided, int(snap[0, 3])

    def required_decision(self, step: int, lag: int | None = None) -> int:
        """The last refit step whose decision the plan of ``step`` depends on (-1: none)."""
        last = step - (self.lag if lag is None else lag)
        return -1 if last < 0 else last - last % self.refit_every

    def entry_for(self, step: int | None, wait: bool) -> ScheduleEntry:
        """The version that plans ``step`` (None: the newest decided one, for evaluation plans).
        ``wait``: block until the needed refit is decided (loader workers); otherwise raise."""
        deadline = None
        while True:
            entries, decided, lag = self._read()
            if step is None:
                return entries[-1]
            need = self.required_decision(step, lag)
            if decided >= need:
                return [e for e in entries if e.effective_step <= step][-1]
            if not wait:
                raise PlanError(
                    f"the plan of step {step} needs the coefficients decided at step {need}, but only steps <= "
                    f"{decided} are decided: plans are built more than plan_lag={lag} steps ahead "
                    f"of training; raise the planner's plan_lag")
            deadline = deadline or time.monotonic() + self.wait_timeout_s
            if time.monotonic() > deadline:
                raise PlanError(f"waited {self.wait_timeout_s:.0f} s for the refit of step {need} (needed by "
                                f"the plan of step {step}); steps <= {decided} are decided: is training stalled?")
            time.sleep(0.002)

    def state(self) -> dict[str, Any]:
        entries, decided = self.read()
        return {"decided_through": decided, "lag": self.lag,
                "entries": [[e.effective_step, e.version, e.scale,
                             [[k[0].to_state(), str(Checkpointing.parse(k[1])), list(v)] for k, v in sorted(
                                 e.fitted.items(), key=lambda kv: (kv[0][0].name, str(kv[0][1])))]] for e in entries]}

    @staticmethod
    def entries_from_state(state: Mapping[str, Any]) -> tuple[list[ScheduleEntry], int, int | None]:
        entries = [ScheduleEntry(int(eff), int(ver), float(scale),
                                 {(Layout.from_state(lay), Checkpointing.parse(ac)): tuple(float(x) for x in v)  # type: ignore[misc]
                                  for lay, ac, v in fitted})
                   for eff, ver, scale, fitted in state.get("entries", [])]
        return entries, int(state.get("decided_through", -1)), state.get("lag")
