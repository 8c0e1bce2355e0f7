"""What a training runtime overlaps: a small typed description the cost model prices.

The hardware profile (:mod:`.hardware`) says how fast a GPU computes and moves bytes; a runtime
profile says which of those moves hide behind which compute. :data:`HOTSPA` describes OUR runtime as
it is on this commit (the planner and the simulator price it, never an idealized one); the others
describe the systems whose published runs ``recipes/benchmark_published.py`` prices
(:mod:`.published_runs`), and are used only for those rows. A hardware profile's
``layer_comm_overlap`` caps every overlap here (cpu-gloo: 0.0, its ranks' collectives and compute
share the same cores), so on cpu-gloo every description prices as fully exposed.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ATTENTION_KERNELS", "HOTSPA", "RUNTIME_PROFILES", "RuntimeProfile", "UnknownRuntimeError",
           "get_runtime"]

#: attention kernel families a hardware profile may rate (``HardwareProfile.attention_kernels``)
ATTENTION_KERNELS = ("fa2", "fa3", "cudnn", "flex", "sdpa-math", "cpu")


class UnknownRuntimeError(ValueError):
    """A runtime profile name that is not in :data:`RUNTIME_PROFILES`; the message lists the known ones."""


@dataclass(frozen=True, kw_only=True)
class RuntimeProfile:
    """Which communication of one runtime overlaps which compute.

    Args: ``name``; ``fsdp_gather_prefetch`` (a sharded working copy's unit all-gathers, forward and
    backward re-gather, are started while the previous unit computes: hidden behind GEMMs);
    ``fsdp_recompute_gather_prefetch`` (with activation checkpointing the backward re-gather happens
    in the unit's recomputation: prefetched there too; False: it waits);
    ``fsdp_reduce_scatter_overlap`` (a unit's gradient reduce-scatter runs while the next unit's
    backward computes; False: the backward waits for it); ``dp_reduce_overlap`` (the replicated
    gradient reduction runs inside the last micro-batch's backward, bucket by bucket);
    ``tp_comm_overlap`` (tensor-parallel collectives overlapped with GEMMs, async TP);
    ``cp_comm_overlap`` (context-parallel exchanges overlapped with attention, as ring attention);
    ``attention_kernel`` (one of :data:`ATTENTION_KERNELS`, the kernel its GPU rows run);
    ``source`` (where each field comes from); ``tp_regather`` (sequence parallelism keeps only each
    rank's token shard of a column-parallel input and all-gathers it again in backward, as Megatron-LM
    does: one more all-gather per shared input per layer)."""

    name: str
    fsdp_gather_prefetch: bool
    fsdp_recompute_gather_prefetch: bool
    fsdp_reduce_scatter_overlap: bool
    dp_reduce_overlap: bool
    tp_comm_overlap: bool
    cp_comm_overlap: bool
    attention_kernel: str
    source: str
    tp_regather: bool = False

    def __post_init__(self) -> None:
        for f in ("fsdp_gather_prefetch", "fsdp_recompute_gather_prefetch", "fsdp_reduce_scatter_overlap",
                  "dp_reduce_overlap", "tp_comm_overlap", "cp_comm_overlap", "tp_regather"):
            if not isinstance(getattr(self, f), bool):
                raise ValueError(f"RuntimeProfile {self.name!r}: {f} must be True or False, got {getattr(self, f)!r}")
        if self.attention_kernel not in ATTENTION_KERNELS:
            raise ValueError(f"RuntimeProfile {self.name!r}: attention_kernel must be one of {ATTENTION_KERNELS}, "
                             f"got {self.attention_kernel!r}")


#: OUR runtime on this commit (engine/fsdp.py, engine/switch.py, parallel/*); update it with the runtime.
HOTSPA = RuntimeProfile(
    name="hotspa", fsdp_gather_prefetch=True, fsdp_recompute_gather_prefetch=False,
    fsdp_reduce_scatter_overlap=False, dp_reduce_overlap=True, tp_comm_overlap=False, cp_comm_overlap=False, attention_kernel="fa2",
    source="engine/fsdp.py: a unit's forward starts the next unit's all-gather asynchronously and each "
    "backward re-gather starts the previous one's (one in flight); a checkpointed unit's recompute gathers "
    "synchronously; the per-unit fp32 reduce-scatter is waited for at once (pending.result()). "
    "engine/switch.py overlap_next_backward: the stage's last micro-batch starts the replicated gradient "
    "reductions bucket by bucket inside its backward (2 in flight). parallel/collectives.py: tp all-reduces "
    "and Ulysses / KV-gather exchanges run synchronously between the GEMMs. models/attention.py: 'auto' on "
    "CUDA bf16 takes flash-attn's varlen kernel (FlashAttention-2). parallel/sequence_parallel.py: tp is "
    "sequence parallel; q/k/v and w1/w3 keep their input's token shard and all-gather it again in backward.",
    tp_regather=True,
)

RUNTIME_PROFILES: dict[str, RuntimeProfile] = {
    "hotspa": HOTSPA,
    "llm-foundry": RuntimeProfile(
        name="llm-foundry", fsdp_gather_prefetch=True, fsdp_recompute_gather_prefetch=True,
        fsdp_reduce_scatter_overlap=True, dp_reduce_overlap=True,
        tp_comm_overlap=False, cp_comm_overlap=False, attention_kernel="fa2",
        source="Composer + PyTorch FSDP1 (backward_prefetch BACKWARD_PRE, also ahead of a checkpointed unit's "
        "recomputation, whose forward pre-hook unshards; reduce-scatter on its own stream: FSDP1's design); MPT attn_impl 'flash' (flash-attn) in scripts/train/yamls/pretrain/mpt-*.yaml; no tp/cp.",
    ),
    "torchtitan": RuntimeProfile(
        name="torchtitan", fsdp_gather_prefetch=True, fsdp_recompute_gather_prefetch=True,
        fsdp_reduce_scatter_overlap=True, dp_reduce_overlap=True,
        tp_comm_overlap=False, cp_comm_overlap=True, attention_kernel="fa2",
        source="FSDP2 (implicit one-unit prefetch, in a checkpointed unit's recomputation too; reduce-scatter on "
        "a separate stream); the bf16 rows use "
        "vanilla TP (AsyncTP off: the asyncTP benchmark's 'Vanilla TP' column); CP is ring attention "
        "(overlapped; its rows are Float8, outside the statistics); attention: SDPA's flash kernel (FA2).",
    ),
    "megatron-2022": RuntimeProfile(
        name="megatron-2022", fsdp_gather_prefetch=False, fsdp_recompute_gather_prefetch=False,
        fsdp_reduce_scatter_overlap=False, dp_reduce_overlap=True,
        tp_comm_overlap=False, cp_comm_overlap=False, attention_kernel="fa2",
        source="Megatron-LM as in arXiv 2205.05198: tp all-gathers / reduce-scatters (sequence parallel) on the "
        "critical path, dp gradient all-reduce overlapped with backward (its README), no FSDP; its 2022 attention "
        "was the fused-softmax path, priced as FA2 (ASSUMED; 2K sequences, attention ~5 % of the step).",
    ),
}


def get_runtime(runtime: str | RuntimeProfile) -> RuntimeProfile:
    """The runtime profile of that name, or the object itself."""
    if isinstance(runtime, RuntimeProfile):
        return runtime
    if isinstance(runtime, str) and runtime in RUNTIME_PROFILES:
        return RUNTIME_PROFILES[runtime]
    raise UnknownRuntimeError(f"unknown runtime profile {runtime!r}; known: {', '.join(RUNTIME_PROFILES)}")
