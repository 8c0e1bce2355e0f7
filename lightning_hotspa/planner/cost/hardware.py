"""Hardware profiles: the few rates the analytic cost model needs, kept as data with their sources.

A profile is per device (one GPU, or one CPU rank): dense bf16 peak, the fraction of it that dense
GEMMs and attention kernels reach in training, memory, and the bus bandwidth of collectives inside a
node and between nodes (per device, in the ``busbw`` sense of nccl-tests, so a ring all-reduce of B
bytes over g devices takes ``2 (g-1)/g * B / bw``). Vendor peaks are from the data sheets; the
efficiencies and inter-node links are ASSUMPTIONS typical of published runs, named as such. The
``cpu-gloo`` profile was measured on the development machine with ``hotspa calibrate``
(:mod:`lightning_hotspa.tools.measure_hardware`).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...checks import check_number
from .efficiency import (
    attention_efficiency,
    attention_half_length,
    check_attention_table,
    check_half_length_table,
    gemm_efficiency,
)

__all__ = ["CPU_GLOO_CALIBRATION", "DEVICE_TYPES", "FA3_OVER_FA2", "HardwareProfile", "PROFILES", "UnknownProfileError",
           "get_profile",
           "profile_for_device", "UPDATABLE_FIELDS", "ProfileUpdateError",
           "apply_profile_update", "load_updated_profile"]

GiB = 2**30
#: what ``HardwareProfile.device_type`` may name
DEVICE_TYPES = ("cuda", "cpu")


class UnknownProfileError(ValueError):
    """A hardware profile name that is not in :data:`PROFILES`; the message lists the known ones."""


@dataclass(frozen=True, kw_only=True)
class HardwareProfile:
    """Rates of one device. ``peak_flops`` in FLOP/s, bandwidths in bytes/s per device."""

    name: str
    peak_flops: float
    dense_efficiency: float  # fraction of peak reached by the dense (GEMM) part of training
    attention_efficiency: float  # fraction of peak reached by (flash) attention, fwd + bwd
    memory_bytes: float
    memory_usable_fraction: float = 0.92  # allocator fragmentation / caching headroom
    memory_reserved_bytes: float = 4 * GiB  # context, communicator buffers, kernel workspaces
    devices_per_node: int = 8
    intra_node_bw: float  # collective bus bandwidth inside a node
    inter_node_bw: float  # collective bus bandwidth across nodes of ONE rank per node (its NIC), see bandwidth()
    intra_node_latency_s: float = 10e-6  # per collective call
    inter_node_latency_s: float = 25e-6
    layer_overhead_s: float = 30e-6  # per layer and micro-batch (launches, small kernels), exposed part
    # Fraction of a layer's compute behind which its per-layer collectives on a side stream hide (the
    # all-gathers and reduce-scatters of a sharded working copy, ``:fsdp``). 1.0 ASSUMED on GPUs
    # (NCCL on its own CUDA stream, the next layer prefetched, as FSDP2 does); 0.0 on cpu-gloo (the
    # ranks' collectives and compute share the same few cores: nothing hides).
    layer_comm_overlap: float = 1.0
    source: str = ""
    # Per-degree efficiency of a rank's local (sharded) compute against 1/degree of the unsharded
    # compute, as ((degree, efficiency), ...) pairs, measured by recipes/gpu_check.py part (c).
    # Empty (the default): 1.0 at every degree, i.e. work divides perfectly by tp*cp.
    tp_efficiency: tuple[tuple[int, float], ...] = ()
    cp_efficiency: tuple[tuple[int, float], ...] = ()
    # GEMM efficiency by model width h: dense_efficiency * h / (h + gemm_half_width) (planner/cost/efficiency.py);
    # 0: the constant dense_efficiency
    gemm_half_width: float = 0.0
    # attention efficiency per (kernel family, head dim): ((kernel, head_dim, efficiency), ...); a kernel
    # without an entry takes attention_efficiency
    attention_kernels: tuple[tuple[str, int, float], ...] = ()
    # query rows per kernel call at which a kernel family reaches half its long-sequence efficiency (the
    # efficiencies above are its long-sequence values): ((kernel, rows), ...); a kernel without an entry takes
    # attention_half_length; 0: flat in the length (planner/cost/efficiency.py)
    attention_half_lengths: tuple[tuple[str, float], ...] = ()
    attention_half_length: float = 0.0
    # HBM bytes/s that memory-bound kernels reach (an unfused attention's score passes, an optimizer step);
    # 0: unknown (nothing that needs it can be priced on this profile)
    hbm_bandwidth: float = 0.0
    # whose kernels a rank runs: "cuda", or "cpu" (the CPU attention kernels keep other tensors for
    # backward: models/chunk_attention.py; the memory model counts them, planner/cost/memory_model.py)
    device_type: str = "cuda"

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in _CURVES:
                object.__setattr__(self, f.name, _check_curve(self.name, f.name, value))
                continue
            if f.name == "attention_kernels":
                object.__setattr__(self, f.name, check_attention_table(self.name, value))
                continue
            if f.name == "attention_half_lengths":
                object.__setattr__(self, f.name, check_half_length_table(self.name, value))
                continue
            if f.name == "device_type":
                if value not in DEVICE_TYPES:
                    raise ValueError(f"HardwareProfile {self.name!r}: device_type must be one of {DEVICE_TYPES}, "
                                     f"got {value!r}")
                continue
            if f.name in ("name", "source"):
                continue
            check_number(value, f"HardwareProfile {self.name!r}: {f.name}", strict=False)
        for f in ("peak_flops", "dense_efficiency", "attention_efficiency", "memory_bytes", "intra_node_bw",
                  "inter_node_bw", "devices_per_node"):
            if not getattr(self, f) > 0:
                raise ValueError(f"HardwareProfile {self.name!r}: {f} must be > 0")
        if self.layer_comm_overlap > 1:
            raise ValueError(f"HardwareProfile {self.name!r}: layer_comm_overlap must be in [0, 1], got "
                             f"{self.layer_comm_overlap!r}")

    def shard_efficiency(self, tp: int = 1, cp: int = 1) -> float:
        """Fraction of ideal speed-up a rank's local compute reaches at these degrees: the product of
        the tp and cp curves, each interpolated linearly in log2(degree) and held flat past its ends."""
        return _interpolate(self.tp_efficiency, tp) * _interpolate(self.cp_efficiency, cp)

    def gemm_efficiency(self, width: float) -> float:
        """Fraction of peak the dense GEMMs of a model of this width reach (planner/cost/efficiency.py)."""
        return gemm_efficiency(self.dense_efficiency, self.gemm_half_width, width)

    def attention_efficiency_for(self, kernel: str, head_dim: int) -> float:
        """Fraction of peak an attention kernel family reaches at this head dim, fwd + bwd."""
        return attention_efficiency(self.attention_kernels, self.attention_efficiency, kernel, head_dim)

    def attention_half_length_for(self, kernel: str) -> float:
        """Query rows per call at which an attention kernel family reaches half its long-sequence efficiency."""
        return attention_half_length(self.attention_half_lengths, self.attention_half_length, kernel)

    def bandwidth(self, span: int, stride: int = 1) -> float:
        """Bus bandwidth of a collective whose ranks lie within ``span`` consecutive devices, every
        ``stride``-th one. Across nodes each member rank drives its own NIC and NCCL runs one ring per
        NIC, so a group with ``k = devices_per_node / stride`` ranks per node moves ``k *
        inter_node_bw`` (nccl-tests' busbw: ~8 NICs' worth for a whole-node group), capped by the
        intra-node bandwidth its rings also cross."""
        if span <= self.devices_per_node:
            return self.intra_node_bw
        per_node = max(1, self.devices_per_node // max(1, stride))
        return min(self.intra_node_bw, self.inter_node_bw * per_node)

    def latency(self, span: int) -> float:
        return self.intra_node_latency_s if span <= self.devices_per_node else self.inter_node_latency_s

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_CURVES = ("tp_efficiency", "cp_efficiency")


def _check_curve(profile: str, field: str, value: Any) -> tuple[tuple[int, float], ...]:
    """((degree, efficiency), ...) sorted by degree; a clear error for anything else."""
    try:
        pairs = tuple((d, e) for d, e in value)
    except (TypeError, ValueError):
        raise ValueError(f"HardwareProfile {profile!r}: {field} must be (degree, efficiency) pairs, "
                         f"got {value!r}") from None
    for d, e in pairs:
        if isinstance(d, bool) or not isinstance(d, int) or d < 1:
            raise ValueError(f"HardwareProfile {profile!r}: {field} degree must be an int >= 1, got {d!r}")
        if isinstance(e, bool) or not isinstance(e, (int, float)) or not 0 < e <= 2:
            raise ValueError(f"HardwareProfile {profile!r}: {field} efficiency at degree {d} must be in "
                             f"(0, 2], got {e!r}")
    degrees = [d for d, _ in pairs]
    if len(set(degrees)) != len(degrees):
        raise ValueError(f"HardwareProfile {profile!r}: {field} repeats a degree: {degrees}")
    return tuple(sorted((int(d), float(e)) for d, e in pairs))


def _interpolate(curve: tuple[tuple[int, float], ...], degree: int) -> float:
    if degree <= 1 or not curve:
        return 1.0
    points = ((1, 1.0),) + tuple(p for p in curve if p[0] > 1)
    x = math.log2(degree)
    for (d0, e0), (d1, e1) in zip(points, points[1:]):
        if degree <= d1:
            x0, x1 = math.log2(d0), math.log2(d1)
            return e0 + (e1 - e0) * (x - x0) / (x1 - x0)
    return points[-1][1]


_FIT = ("FITTED by recipes/benchmark_published.py on every other llm-foundry bf16 row of this GPU "
        "(planner/cost/published_runs.py; residuals printed there): GEMMs e(h) = {e} * h / (h + {hh}) of peak "
        "by model width h (planner/cost/efficiency.py), FlashAttention-2 (fa2) fwd+bwd at head dim 128: {a} of "
        "peak on long sequences, e(r) = {a} * r / (r + 314) for calls of r query rows (the half length of FA2's "
        "H100 curve, planner/cost/attention_curves.py{a100}); other kernel families and head dims: not measured, "
        "they take the fa2 values (ASSUMED). ")
#: the half lengths (query rows per call at half the long-sequence rate) planner/cost/attention_curves.py fits
#: to the FA3 paper's H100 curves (FA2 314, cuDNN 392, FA3 493 rows; within 1.2 / 2.9 / 3.4 % of its six lengths)
_HALF_LENGTHS = (("fa2", 314.0), ("cudnn", 392.0), ("fa3", 493.0))
_AMPERE = dict(peak_flops=312e12, dense_efficiency=0.825, gemm_half_width=685.0, attention_efficiency=0.31,
               attention_kernels=(("fa2", 128, 0.31),), attention_half_lengths=_HALF_LENGTHS[:1],
               attention_half_length=314.0)
_AMPERE_NOTE = "bf16 dense peak 312 TFLOP/s (NVIDIA A100 data sheet). " + _FIT.format(
    e=0.825, hh=685, a=0.31, a100=": ASSUMED on the A100, whose FA2 curve was not found in stored material")
_HOPPER = dict(peak_flops=989e12, dense_efficiency=0.508, gemm_half_width=409.0, attention_efficiency=0.175,
               attention_kernels=(("fa2", 128, 0.175), ("cudnn", 128, 0.591), ("fa3", 128, 0.656)),
               attention_half_lengths=_HALF_LENGTHS, attention_half_length=314.0)
_HOPPER_NOTE = ("bf16 dense peak 989 TFLOP/s (NVIDIA H100 SXM data sheet). " + _FIT.format(e=0.508, hh=409, a=0.175,
                                                                                            a100="")
                + "cuDNN fused attention (Transformer Engine) at head dim 128: 0.591 of peak on long sequences (half "
                "length 392 rows), fitted with TE's FP8 GEMM rate on every other row of NeMo's LLAMA2-7B H100 "
                "long-sequence table (4K-512K tokens, local chunks 4K-32K query rows; recipes/benchmark_published.py). "
                "FlashAttention-3 at head dim 128: 0.656 = the cuDNN value x 1.11 (half length 493 rows), FA3 over "
                "cuDNN on long sequences in the FA3 paper (Shah et al. 2024, arXiv 2407.08608, Figures 5 and 6, H100 "
                "SXM5, head dim 128, causal forward and backward at 512-16K tokens, backward counted 2.5x the forward "
                "FLOPs: the curves of planner/cost/attention_curves.py reach 613 and 551 TFLOP/s). FlashAttention-4 on "
                "H100: no published training figures found: no entry (priced at the fa2 values, ASSUMED). ")
#: FlashAttention-3 over FlashAttention-2 on long sequences at head dim 128 on H100 SXM5: the long-sequence rates
#: (613 / 336 TFLOP/s) of the FA3 paper's curves as planner/cost/attention_curves.py fits them. The conservative
#: price of ours' FA3 beside the fitted FA2 value (recipes/benchmark_peers.py ``ours_over_peer_conservative``):
#: the fitted fa2 and cudnn entries are 3.4x apart where the kernels' own benchmarks put them 1.6x apart
FA3_OVER_FA2 = 1.83
#: fraction of the data-sheet HBM bandwidth memory-bound kernels reach: ASSUMED (STREAM-style copies
#: reach roughly 80-90 % on A100 / H100)
HBM_FRACTION = 0.8
_HBM = " HBM: {tb} TB/s ({sheet}) x {f} reached (ASSUMED) = hbm_bandwidth."
_LINKS = (" Across nodes a group with k ranks per node drives k NICs (NCCL: one ring per NIC), so its busbw is "
          "k x the per-NIC rate, capped by the intra-node busbw (HardwareProfile.bandwidth).")

#: The known profiles. Add one by adding an entry here (or pass a HardwareProfile object).
PROFILES: dict[str, HardwareProfile] = {
    "A100-80G": HardwareProfile(
        name="A100-80G", **_AMPERE, memory_bytes=80 * GiB, intra_node_bw=230e9, inter_node_bw=22e9,
        hbm_bandwidth=2.039e12 * HBM_FRACTION,
        source=_AMPERE_NOTE + _HBM.format(tb=2.039, sheet="A100 80GB SXM data sheet", f=HBM_FRACTION)
        + "NVLink3 600 GB/s bidirectional, ~230 GB/s all-reduce busbw (nccl-tests on "
        "DGX A100); one 200 Gb/s HDR NIC per GPU (~22 GB/s effective; llm-foundry's A100 table states 1600 "
        "Gbps per node)." + _LINKS,
    ),
    "A800-80G": HardwareProfile(
        name="A800-80G", **_AMPERE, memory_bytes=80 * GiB, intra_node_bw=155e9, inter_node_bw=22e9,
        hbm_bandwidth=2.039e12 * HBM_FRACTION,
        source=_AMPERE_NOTE + _HBM.format(tb=2.039, sheet="as the A100 80GB", f=HBM_FRACTION)
        + "The A800 is an A100 (same compute constants) with NVLink capped at 400 GB/s "
        "bidirectional: ASSUMED ~155 GB/s busbw. The HotSPa paper's cluster (nodes of 8, InfiniBand between): "
        "ASSUMED one 200 Gb/s NIC per GPU (~22 GB/s effective); the paper does not state it." + _LINKS,
    ),
    "H100": HardwareProfile(
        name="H100", **_HOPPER, memory_bytes=80 * GiB, intra_node_bw=360e9, inter_node_bw=45e9,
        hbm_bandwidth=3.35e12 * HBM_FRACTION,
        source=_HOPPER_NOTE + _HBM.format(tb=3.35, sheet="H100 SXM data sheet", f=HBM_FRACTION)
        + "NVLink4 900 GB/s bidirectional, ASSUMED ~360 GB/s busbw; ASSUMED one "
        "400 Gb/s NDR NIC per GPU (~45 GB/s)." + _LINKS,
    ),
    "H100-GT500W": HardwareProfile(
        name="H100-GT500W", **{**_HOPPER, "peak_flops": 912e12},
        memory_bytes=96 * GiB, intra_node_bw=360e9, inter_node_bw=45e9, hbm_bandwidth=2.4e12 * HBM_FRACTION,
        source="Meta's Grand Teton H100 (96 GB HBM2e, 500 W power limit) that torchtitan's benchmarks ran on: "
        "its peak is 'between SXM and NVL' (torchtitan benchmarks/llama3_h100_202412_torchtitan.md): ASSUMED "
        "the midpoint of 989 (SXM) and 835 (NVL) TFLOP/s; efficiencies (fractions of that peak) and links as "
        "the H100's; 400 Gb/s RDMA per GPU (the same file); HBM2e at 2.4 TB/s peak (torchtitan's performance.md "
        "in its docs folder) x "
        "0.8 reached (ASSUMED, as every profile). Prices only those published rows." + _LINKS,
    ),
    "H200": HardwareProfile(
        name="H200", **_HOPPER, memory_bytes=141e9, intra_node_bw=360e9, inter_node_bw=45e9,
        hbm_bandwidth=4.8e12 * HBM_FRACTION,
        source="DERIVED from the H100 profile: no published dense bf16 training figures were found for it. The "
        "H200 is the H100's GH100 chip with 141 GB HBM3e at 4.8 TB/s (vs 80 GB at 3.35 TB/s; H200 data sheet): "
        "same peak, NVLink and efficiencies, its memory size and HBM bandwidth (x the same reached fraction; "
        "only unfused attention and an optimizer step are priced by it, so our runtime's prices do not credit "
        "it). " + _HOPPER_NOTE + "ASSUMED one 400 Gb/s NDR NIC per GPU." + _LINKS,
    ),
    # Measured once on the development machine (2 shared cores, 4 gloo ranks, 1 thread each):
    # see CPU_GLOO_CALIBRATION for the raw numbers and the command.
    "cpu-gloo": HardwareProfile(
        name="cpu-gloo", peak_flops=2.22e10, dense_efficiency=1.0, attention_efficiency=0.5,
        memory_bytes=5 * GiB, memory_usable_fraction=0.9, memory_reserved_bytes=0.5 * GiB,
        devices_per_node=64, intra_node_bw=3.0e8, inter_node_bw=3.0e8,
        intra_node_latency_s=5.8e-3, inter_node_latency_s=5.8e-3, layer_overhead_s=1.0e-3,
        layer_comm_overlap=0.0, device_type="cpu",
        source="measured on the development machine, see CPU_GLOO_CALIBRATION; memory_bytes is 1/4 of "
        "its 23 GiB RAM (4 ranks); attention_efficiency and layer_overhead_s are ASSUMED starting points",
    ),
}

#: What ``hotspa calibrate --ranks 4 --repeats 15`` printed when the cpu-gloo profile was made (median
#: over ranks of per-rank figures, all 4 ranks busy at once on the 2 shared cores, load average ~5).
#: The profile takes peak_flops from the slower GEMM shape, bus bandwidth from the 16 MiB all-reduce
#: and latency from the 1 KiB one. An earlier run under heavier load (load average ~10) measured
#: 9.3e9 / 3.8e10 FLOP/s, 1.3e8 / 3.5e8 B/s and 12 ms: on a shared machine these rates move by 2x,
#: which is what profiled mode (``CostModelPlanner(profiled=True)``) is for.
CPU_GLOO_CALIBRATION: dict[str, Any] = {
    "date": "2026-11-29T08:58Z",
    "command": "hotspa calibrate --ranks 4 --repeats 15",
    "matmul_1024x384x1024_flops": 2.2234e10,
    "matmul_2048x64x176_flops": 5.0051e10,
    "allreduce_4MiB_busbw": 3.9146e8,
    "allreduce_16MiB_busbw": 3.0037e8,
    "allreduce_1KiB_s": 5.8187e-3,
}


def get_profile(profile: str | HardwareProfile) -> HardwareProfile:
    """The profile of that name (case-insensitive), the object itself, or a profile-update JSON file
    (``*.json``, e.g. ``h200_profile_update.json`` from recipes/gpu_check.py) applied to its base."""
    if isinstance(profile, HardwareProfile):
        return profile
    if isinstance(profile, str) and profile.strip().endswith(".json"):
        return load_updated_profile(profile.strip())
    if isinstance(profile, str):
        for name, value in PROFILES.items():
            if name.lower() == profile.strip().lower():
                return value
    raise UnknownProfileError(f"unknown hardware profile {profile!r}; known profiles: {', '.join(PROFILES)}")


#: a CUDA device name containing the key -> its profile (checked in this order)
_CUDA_NAMES = (("H200", "H200"), ("H100", "H100"), ("A800", "A800-80G"), ("A100", "A100-80G"))


def profile_for_device(device_type: str, device_name: str = "") -> str | None:
    """The profile of the device a rank runs on: ``cpu-gloo`` on CPU, a known CUDA GPU by its name
    (``torch.cuda.get_device_name``); None for anything else (pass ``hardware=`` then)."""
    if device_type == "cpu":
        return "cpu-gloo"
    if device_type == "cuda":
        return next((p for key, p in _CUDA_NAMES if key in device_name.upper()), None)
    return None


# ----------------------------------------------------------------- measured updates (gpu_check)
#: the fields a measurement may set; the rest of a profile (links, memory) stays as written
UPDATABLE_FIELDS = ("peak_flops", "dense_efficiency", "attention_efficiency", "layer_overhead_s",
                    "tp_efficiency", "cp_efficiency")


class ProfileUpdateError(ValueError):
    """A profile-update file or mapping that cannot be applied; the message names the bad part."""


def apply_profile_update(profile: str | HardwareProfile, update: Mapping[str, Any]) -> HardwareProfile:
    """``profile`` with the ``update["set"]`` fields replaced (validated as any profile is), its
    ``source`` saying where the new figures came from."""
    base = get_profile(profile)
    if not isinstance(update, Mapping) or not isinstance(update.get("set"), Mapping):
        raise ProfileUpdateError(f"a profile update needs a 'set' mapping of fields, got {update!r}")
    fields = dict(update["set"])
    unknown = sorted(set(fields) - set(UPDATABLE_FIELDS))
    if unknown:
        raise ProfileUpdateError(f"profile update sets unknown or fixed fields {unknown}; "
                                 f"updatable: {list(UPDATABLE_FIELDS)}")
    for key in ("tp_efficiency", "cp_efficiency"):
        if key in fields:
            try:
                fields[key] = tuple((int(d), float(e)) for d, e in fields[key])
            except (TypeError, ValueError):
                raise ProfileUpdateError(f"{key} must be [[degree, efficiency], ...], got {fields[key]!r}") from None
    measured = update.get("measured") or {}
    note = " MEASURED " + ", ".join(f"{k}={v}" for k, v in sorted(measured.items())) if measured else ""
    try:
        return dataclasses.replace(base, **fields, source=base.source + f" UPDATED: {sorted(fields)}" + note)
    except ValueError as err:
        raise ProfileUpdateError(f"profile update for {base.name}: {err}") from None


def load_updated_profile(path: str | Path) -> HardwareProfile:
    """The profile a profile-update JSON file names, with the file's fields applied."""
    path = Path(path)
    try:
        update = json.loads(path.read_text())
    except OSError as err:
        raise ProfileUpdateError(f"cannot read profile update {str(path)!r}: {err}") from None
    except json.JSONDecodeError as err:
        raise ProfileUpdateError(f"profile update {str(path)!r} is not JSON: {err}") from None
    if not isinstance(update, Mapping) or not isinstance(update.get("profile"), str):
        raise ProfileUpdateError(f"profile update {str(path)!r} must name its base 'profile' (e.g. \"H200\")")
    return apply_profile_update(update["profile"], update)
