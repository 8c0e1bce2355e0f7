"""Bucket sizes of the switch engine's collectives, by process-group backend.

Why two sets: on gloo (CPU CI, the development box) one 150 MB fused all-gather is much slower than
4 MB calls and reordering a huge buffer costs as much as the transfer (docs/DESIGN.md §9, "One big
buffer"); on NCCL a 4 MiB bucket leaves the links idle between thousands of launches (llama7b on 8
ranks: ~290 reduce-scatters per reducing stage at 4 MiB where each weight already exceeds a bucket, more with
smaller tensors) and each launch pays the latency of a ring. The NCCL sizes follow what the large
trainers use: PyTorch DDP's ``bucket_cap_mb`` = 25 MB, Megatron-LM's DDP bucket of max(40M, 1M x dp)
parameters (160 MB of fp32 gradients at dp <= 40), FSDP2's one all-gather per transformer block
(~400 MB of bf16 at 7B). We take 100 MB for both a switch's gathers and the gradient reductions (4x
DDP's, below Megatron's), 2 switch buckets in flight (the next gather runs while the last one's
shards are copied into place) and 4 reduction buckets in flight (landed as backward goes on, not
at its end). docs/DESIGN.md §9 and docs/gpu-runtime.md say more.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..checks import check_int

__all__ = ["BucketSizes", "bucket_defaults"]

MB = 2**20


@dataclass(frozen=True)
class BucketSizes:
    """How the switch engine cuts and overlaps its collectives.

    Args:
        bucket_mb: the most MiB (per rank) one fused all-gather of a switch or one gradient-reduction
            bucket carries (a larger tensor goes alone).
        switch_in_flight: switch all-gathers launched before the oldest is waited on.
        reduce_in_flight: gradient-reduction buckets pending at once during backward.
    """

    bucket_mb: float
    switch_in_flight: int
    reduce_in_flight: int

    def __post_init__(self) -> None:
        if not (isinstance(self.bucket_mb, (int, float)) and self.bucket_mb > 0):
            raise ValueError(f"bucket_mb must be a positive number of MiB, got {self.bucket_mb!r}")
        for name in ("switch_in_flight", "reduce_in_flight"):
            value = getattr(self, name)
            check_int(value, name)

    def engine_kwargs(self) -> dict:
        """The :class:`~.switch.SwitchEngine` keyword arguments these sizes stand for."""
        return {"bucket_bytes": int(self.bucket_mb * MB), "max_buckets_in_flight": self.reduce_in_flight,
                "switch_buckets_in_flight": self.switch_in_flight}


_DEFAULTS = {"gloo": BucketSizes(4, 1, 2), "nccl": BucketSizes(100, 2, 4)}


def bucket_defaults(backend: str | None, bucket_mb: float | None = None, switch_in_flight: int | None = None,
                    reduce_in_flight: int | None = None) -> BucketSizes:
    """The sizes for ``backend`` ("nccl" and anything else on a GPU: the NCCL set; "gloo" and unknown
    CPU backends: the gloo set), each one replaced by the caller's value where given.

    Args:
        backend: the process group's backend name (None: gloo's sizes).
        bucket_mb, switch_in_flight, reduce_in_flight: the user's overrides (None: the default).
    """
    base = _DEFAULTS["nccl" if backend in ("nccl", "xccl", "hccl") else "gloo"]
    return BucketSizes(base.bucket_mb if bucket_mb is None else bucket_mb,
                       base.switch_in_flight if switch_in_flight is None else switch_in_flight,
                       base.reduce_in_flight if reduce_in_flight is None else reduce_in_flight)
