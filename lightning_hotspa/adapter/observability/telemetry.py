"""Model FLOPs, hardware peaks and the end-of-run summary table, over the step runner's records.

Pure functions over numbers (no Lightning, no collectives) so the monitor callback stays thin and
all of this is testable on its own. Measured numbers are the step's :class:`StageRecord` s (slowest
rank of each part, device time); FLOPs are *model* FLOPs of the documents
(``LlamaConfig.flops_per_token``), the usual MFU numerator: padding and recomputation do not count.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from ...engine.records import StageRecord

__all__ = [
    "RunSummary",
    "StageRecord",
    "detect_hardware",
    "records_as_rows",
    "stage_flops",
]

FlopsPerToken = Callable[[int], float]


def stage_flops(doc_lengths: Sequence[int], stage_doc_ids: Sequence[Sequence[int]],
                flops_per_token: FlopsPerToken) -> list[float]:
    """Model FLOPs of each stage: sum over its documents of ``length * flops_per_token(length)``."""
    cache: dict[int, float] = {}

    def doc(n: int) -> float:
        if n not in cache:
            cache[n] = n * flops_per_token(n)
        return cache[n]

    return [sum(doc(int(doc_lengths[d])) for d in ids) for ids in stage_doc_ids]


# --------------------------------------------------------------------------- hardware
def detect_hardware(profile: str | None, peak_flops_per_device: float | None,
                    device_type: str, device_name: str = "") -> tuple[str | None, float | None]:
    """(profile name, peak FLOP/s per device) for MFU and the cost model.

    An explicit ``profile`` wins; otherwise a CUDA device name picks one and CPU gets ``cpu-gloo``.
    ``peak_flops_per_device`` overrides the profile's peak. Unknown hardware: (None, override).
    """
    from ...planner.cost.hardware import get_profile, profile_for_device

    if profile is None:
        profile = profile_for_device(device_type, device_name)
    peak = peak_flops_per_device
    if profile is not None and peak is None:
        peak = get_profile(profile).peak_flops
    return profile, (float(peak) if peak else None)


# --------------------------------------------------------------------------- summary
@dataclass
class _Totals:
    steps: int = 0
    tokens: float = 0.0
    documents: float = 0.0
    micro_batches: float = 0.0
    seconds: float = 0.0
    switch_s: float = 0.0
    switch_mb: float = 0.0
    flops: float = 0.0
    flops_seconds: float = 0.0  # seconds of the stages whose FLOPs are known
    predicted_s: float = 0.0
    predicted_measured_s: float = 0.0  # measured seconds of the stages with a prediction


@dataclass
class RunSummary:
    """Accumulates stage records and step losses; formats the end-of-run table.

    The first ``skip_first`` steps are left out of the throughput numbers (start-up: allocation,
    first materialization of working weights), but their losses are kept.
    """

    skip_first: int = 1
    peak_flops_total: float | None = None
    losses: list[float] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    buckets: dict[tuple[str, str], _Totals] = field(default_factory=dict)
    _seen_steps: set[int] = field(default_factory=set)

    def add_loss(self, loss: float) -> None:
        self.losses.append(float(loss))

    def add(self, step: int, records: Sequence[StageRecord], step_s: float | None = None) -> None:
        self._seen_steps.add(step)
        if len(self._seen_steps) <= self.skip_first:
            return
        if step_s is not None:
            self.step_seconds.append(float(step_s))
        for r in records:
            t = self.buckets.setdefault((r.name, r.label), _Totals())  # a table row per stage kind
            t.steps += 1
            t.tokens += r.tokens
            t.documents += r.documents
            t.micro_batches += r.micro_batches
            t.seconds += r.seconds
            t.switch_s += r.switch_s
            t.switch_mb += r.switch_mb
            if r.flops is not None:
                t.flops += r.flops
                t.flops_seconds += r.seconds
            if r.predicted_s is not None:
                t.predicted_s += r.predicted_s
                t.predicted_measured_s += r.seconds

    def loss_ratio(self, last: int = 10) -> tuple[float, float, float] | None:
        """(first-step loss, mean of the last ``last`` steps, their ratio), or None without losses."""
        if not self.losses:
            return None
        first = self.losses[0]
        tail = self.losses[-last:]
        mean = sum(tail) / len(tail)
        return first, mean, (mean / first if first else math.nan)

    def rows(self) -> list[dict[str, Any]]:
        total_seconds = sum(t.seconds for t in self.buckets.values())
        out = []
        for (layout, label), t in self.buckets.items():
            mfu = (t.flops / (t.flops_seconds * self.peak_flops_total)
                   if self.peak_flops_total and t.flops_seconds > 0 else None)
            out.append({
                "layout": layout, "bucket": label, "steps": t.steps, "tokens": t.tokens,
                "documents": t.documents, "micro_batches": t.micro_batches,
                "tokens_per_s": t.tokens / t.seconds if t.seconds > 0 else 0.0,
                "time_share": t.seconds / total_seconds if total_seconds > 0 else 0.0,
                "switch_s_per_step": t.switch_s / t.steps if t.steps else 0.0,
                "switch_MB_per_step": t.switch_mb / t.steps if t.steps else 0.0,
                "switch_fraction": t.switch_s / t.seconds if t.seconds > 0 else 0.0,
                "mfu": mfu,
                "predicted_over_measured": (t.predicted_s / t.predicted_measured_s
                                            if t.predicted_measured_s > 0 else None),
            })
        return out

    def totals(self) -> dict[str, Any]:
        tokens = sum(t.tokens for t in self.buckets.values())
        seconds = sum(t.seconds for t in self.buckets.values())
        switch = sum(t.switch_s for t in self.buckets.values())
        flops = sum(t.flops for t in self.buckets.values())
        flops_s = sum(t.flops_seconds for t in self.buckets.values())
        return {
            "steps_measured": len(self.step_seconds),
            "tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
            "mean_step_s": sum(self.step_seconds) / len(self.step_seconds) if self.step_seconds else None,
            "switch_fraction": switch / seconds if seconds > 0 else 0.0,
            "mfu": flops / (flops_s * self.peak_flops_total) if self.peak_flops_total and flops_s > 0 else None,
        }

    def as_dict(self) -> dict[str, Any]:
        ratio = self.loss_ratio()
        return {
            "buckets": self.rows(), "totals": self.totals(), "losses": self.losses,
            "loss_first": ratio[0] if ratio else None, "loss_last10_mean": ratio[1] if ratio else None,
            "loss_ratio": ratio[2] if ratio else None,
        }

    def format_table(self) -> str:
        """A fixed-width table: one row per (layout, bucket), then the totals and the loss line."""
        head = ("layout", "bucket", "steps", "tokens", "docs", "tok/s", "time%", "switch s", "switch MB",
                "switch%", "MFU", "pred/meas")
        lines = []
        for r in sorted(self.rows(), key=lambda r: -r["time_share"]):
            lines.append((r["layout"], r["bucket"] or "-", str(r["steps"]), f"{r['tokens']:.0f}",
                          f"{r['documents']:.0f}", f"{r['tokens_per_s']:.0f}", f"{100 * r['time_share']:.1f}",
                          f"{r['switch_s_per_step']:.3f}", f"{r['switch_MB_per_step']:.2f}",
                          f"{100 * r['switch_fraction']:.1f}", _pct(r["mfu"]), _ratio(r["predicted_over_measured"])))
        widths = [max(len(h), *(len(row[i]) for row in lines)) if lines else len(h) for i, h in enumerate(head)]

        def fmt(row: Sequence[str]) -> str:
            cells = enumerate(zip(row, widths, strict=True))
            return "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in cells)

        out = [f"HotSPa summary (steps after the first {self.skip_first}; times are the slowest rank's; "
               f"switch s / MB per step)", fmt(head), fmt(["-" * w for w in widths])]
        out += [fmt(row) for row in lines]
        out.append("  tok/s: tokens / stage seconds; time%: share of all stage seconds; switch%: switch / stage s")
        out.append("  MFU: model FLOPs / (stage seconds x peak FLOP/s); pred/meas: the cost model's predicted "
                   "seconds / the measured ones (1 = exact)")
        tot = self.totals()
        step_s = f"{tot['mean_step_s']:.2f} s/step" if tot["mean_step_s"] is not None else "no steps measured"
        out.append(f"all buckets: {tot['tokens_per_s']:.0f} tokens/s, {step_s}, switching "
                   f"{100 * tot['switch_fraction']:.1f}% of stage time, MFU {_pct(tot['mfu'])}")
        ratio = self.loss_ratio()
        if ratio:
            out.append(f"loss: first step {ratio[0]:.4f}, mean of last {min(10, len(self.losses))} steps "
                       f"{ratio[1]:.4f} ({ratio[2]:.3f}x) over {len(self.losses)} steps")
        return "\n".join(out)


def _pct(x: float | None) -> str:
    return "-" if x is None else (f"{100 * x:.2f}%" if x < 0.1 else f"{100 * x:.1f}%")


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def records_as_rows(records: Sequence[StageRecord], peak_flops_total: float | None) -> list[dict[str, Any]]:
    """Table rows (the W&B plan table and plan_table.csv)."""
    rows = []
    for r in records:
        d = {k: (r.name if k == "layout" else v) for k, v in asdict(r).items() if k not in ("plan", "stage_s")}
        d.update(seconds=r.seconds, tokens_per_s=r.tokens_per_s, mfu=r.mfu(peak_flops_total))
        for key in ("fill", "padding", "imbalance"):
            d[key] = r.plan.get(key)
        rows.append(d)
    return rows
