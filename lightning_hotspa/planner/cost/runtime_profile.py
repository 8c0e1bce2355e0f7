"""What a training runtime overlaps: a small typed description the cost model prices.

The hardware profile (:mod:`.hardware`) says how fast a GPU computes and moves bytes; a runtime
profile says which of those moves hide behind which compute. :data:`HOTSPA` describes OUR runtime as
it is on this commit (the planner and the simulator price it, never an idealized one); the others
describe the systems whose published runs ``recipes/benchmark_published.py`` prices
(:mod:`.published_runs`), and are used only for those rows (``trl-deepspeed-ulysses`` describes
rows that are listed, not priced: its optimizer runs on the CPU). A hardware profile's
``layer_comm_overlap`` caps every overlap here (cpu-gloo: 0.0, its ranks' collectives and compute
share the same cores), so on cpu-gloo every description prices as fully exposed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ...models.attention_kernels import PRICED_KERNELS

__all__ = ["ATTENTION_KERNELS", "FP8_RECIPES", "HOTSPA", "HOTSPA_OPTIONS_NOTE", "RUNTIME_PROFILES", "RuntimeProfile",
           "SELECTIVE_POLICIES", "TORCHAO_FP8_RATES", "TORCHTITAN_COMPILE_SPEEDUP",
           "UnknownRuntimeError", "get_runtime"]

#: attention kernel families a hardware profile may rate (``HardwareProfile.attention_kernels``): the
#: ``priced`` records of the attention-kernel registry (``models/attention_kernels.py``)
ATTENTION_KERNELS = PRICED_KERNELS

#: what a runtime's "selective" activation checkpointing recomputes (``RuntimeProfile.selective_recompute``):
#: nothing; the core attention (scores, softmax, dropout, context: Megatron-LM's selective recompute);
#: every second matmul of a block (torchtitan's per-op policy, which saves attention's output)
SELECTIVE_POLICIES = ("none", "core-attention", "every-other-mm")


#: NeMo / Transformer Engine FP8 linears over bf16 on H100: the fit of recipes/benchmark_published.py
NEMO_TE_FP8_GEMM_SPEEDUP = 1.734

#: torchao.float8's training recipes (``Float8LinearConfig.from_recipe_name``; dynamic scaling)
FP8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")

#: torch.compile (inductor, per transformer block) over eager, as a GEMM-side rate: DERIVED by
#: recipes/benchmark_published.py from torchtitan's Table 1 pair (FSDP 5,762 -> FSDP + torch.compile 6,667
#: tokens/s/GPU, +15.7 %; published_pricing.derive_rate): the step's non-attention part runs that much faster
TORCHTITAN_COMPILE_SPEEDUP = 1.227

#: torchao.float8 per recipe over bf16 (both compiled), as GEMM rates on H100: DERIVED by
#: recipes/benchmark_published.py from torchao's own training table (pytorch/ao torchao/float8/README.md @
#: 9519bebbc397d60274982a74c084f9dff18e61a6, 'Training benchmarks', NVIDIA H100: Llama3-8b, 8 GPUs, batch 1,
#: seq 8192, torch.compile, FSDP2, per-op SAC: bf16 6,150; tensorwise with float8 all-gather 7,689.5 (+25.03 %);
#: rowwise with bf16 all-gather 6,768 (+10.05 %)). rowwise_with_gw_hp has no H100 row there: ASSUMED rowwise's
#: rate (its MI300X rows put it above rowwise, +13.46 % vs +9.57 %: the assumption under-credits it)
TORCHAO_FP8_RATES: tuple[tuple[str, float], ...] = (("tensorwise", 1.411), ("rowwise", 1.153),
                                                    ("rowwise_with_gw_hp", 1.153))


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
    ``cp_comm_overlap`` (a ring cp exchange's steps hidden behind each ring step's attention, as ring
    attention runs them: ``Exchange.ring``; Ulysses all-to-alls are never overlapped);
    ``attention_kernel`` (one of :data:`ATTENTION_KERNELS`, the kernel its GPU rows run);
    ``selective_recompute`` (one of :data:`SELECTIVE_POLICIES`: what its selective checkpointing
    recomputes); ``optimizer_bytes_per_param`` (HBM bytes its optimizer step moves per parameter a
    rank holds: state reads and writes, the gradient-norm read; 0: not priced); ``tp_regather``
    (sequence parallelism keeps only each rank's token shard of a column-parallel input and
    all-gathers it again in backward, as Megatron-LM does: one more all-gather per shared input per
    layer; on gloo ours sends it with the output gradient's all-gather, priced without a launch);
    ``kv_gather_recomputes_attention`` (all-gather-KV cp does not save the gathered K / V, so its backward
    re-runs the attention forward of each chunk: attention FLOPs x 4/3; False: the kernel's backward
    needs only the saved output and log-sum-exp, as ring attention's);
    ``compile_speedup`` (the GEMM-side rate of its torch.compile'd runs over eager, applied where a run is
    compiled: published rows marked so, ours where the user turns on ``strategy.runtime.compile_blocks``; 0: none);
    ``fp8_recipe_speedups`` (``((recipe, GEMM rate), ...)`` per torchao.float8 recipe of :data:`FP8_RECIPES`,
    applied where a run names its recipe; ours where the user turns FP8 on);
    ``fp8_gemm_speedup`` (how much faster its Float8 linear layers run than bf16 ones on the GPU its FP8
    rows ran on, as its own published figures imply: docs/cost-model.md; 0: it has no FP8 rows);
    ``source`` (where each field comes from)."""

    name: str
    fsdp_gather_prefetch: bool
    fsdp_recompute_gather_prefetch: bool
    fsdp_reduce_scatter_overlap: bool
    dp_reduce_overlap: bool
    tp_comm_overlap: bool
    cp_comm_overlap: bool
    attention_kernel: str
    source: str
    selective_recompute: str = "none"
    optimizer_bytes_per_param: float = 0.0
    tp_regather: bool = False
    kv_gather_recomputes_attention: bool = False
    fp8_gemm_speedup: float = 0.0
    compile_speedup: float = 0.0
    fp8_recipe_speedups: tuple[tuple[str, float], ...] = ()

    def fp8_rate(self, recipe: str = "") -> float:
        """The FP8 GEMM rate of ``recipe`` (a torchao recipe of :data:`FP8_RECIPES`; "": its own FP8 rows'
        ``fp8_gemm_speedup``); a clear error when it states none."""
        if not recipe:
            rate = self.fp8_gemm_speedup
        elif recipe not in FP8_RECIPES:
            raise ValueError(f"RuntimeProfile {self.name!r}: unknown FP8 recipe {recipe!r}; torchao's: {FP8_RECIPES}")
        else:
            rate = dict(self.fp8_recipe_speedups).get(recipe, 0.0)
        if not rate:
            raise ValueError(f"runtime {self.name!r} states no FP8 GEMM rate for recipe {recipe or 'its own'!r}: "
                             f"its FP8 runs cannot be priced")
        return rate

    def __post_init__(self) -> None:
        for f in ("fsdp_gather_prefetch", "fsdp_recompute_gather_prefetch", "fsdp_reduce_scatter_overlap",
                  "dp_reduce_overlap", "tp_comm_overlap", "cp_comm_overlap", "tp_regather",
                  "kv_gather_recomputes_attention"):
            if not isinstance(getattr(self, f), bool):
                raise ValueError(f"RuntimeProfile {self.name!r}: {f} must be True or False, got {getattr(self, f)!r}")
        if self.attention_kernel not in ATTENTION_KERNELS:
            raise ValueError(f"RuntimeProfile {self.name!r}: attention_kernel must be one of {ATTENTION_KERNELS}, "
                             f"got {self.attention_kernel!r}")
        if self.selective_recompute not in SELECTIVE_POLICIES:
            raise ValueError(f"RuntimeProfile {self.name!r}: selective_recompute must be one of {SELECTIVE_POLICIES}, "
                             f"got {self.selective_recompute!r}")
        fp8 = self.fp8_gemm_speedup
        if isinstance(fp8, bool) or not isinstance(fp8, (int, float)) or not (fp8 == 0 or 1 <= fp8 <= 4):
            raise ValueError(f"RuntimeProfile {self.name!r}: fp8_gemm_speedup must be 0 (no FP8 rows) or in [1, 4], "
                             f"got {fp8!r}")
        for what, rate in (("compile_speedup", self.compile_speedup),
                           *((f"fp8_recipe_speedups[{r!r}]", v) for r, v in self.fp8_recipe_speedups)):
            if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not (rate == 0 or 1 <= rate <= 4):
                raise ValueError(f"RuntimeProfile {self.name!r}: {what} must be 0 (none) or in [1, 4], got {rate!r}")
        unknown = [r for r, _ in self.fp8_recipe_speedups if r not in FP8_RECIPES]
        if unknown:
            raise ValueError(f"RuntimeProfile {self.name!r}: fp8_recipe_speedups names unknown recipes {unknown}; "
                             f"torchao's: {FP8_RECIPES}")
        opt = self.optimizer_bytes_per_param
        if isinstance(opt, bool) or not isinstance(opt, (int, float)) or not opt >= 0:
            raise ValueError(f"RuntimeProfile {self.name!r}: optimizer_bytes_per_param must be a number >= 0, "
                             f"got {opt!r}")


#: OUR runtime on this commit (engine/fsdp.py, engine/switch.py, parallel/*); update it with the runtime.
HOTSPA = RuntimeProfile(
    name="hotspa", fsdp_gather_prefetch=True, fsdp_recompute_gather_prefetch=False,
    fsdp_reduce_scatter_overlap=True, dp_reduce_overlap=True, tp_comm_overlap=True, cp_comm_overlap=True,
    attention_kernel="fa2", selective_recompute="none", optimizer_bytes_per_param=28.0,
    source="engine/fsdp.py: a unit's forward starts the next unit's all-gather asynchronously and each "
    "backward re-gather starts the previous one's (one in flight); a checkpointed unit's recompute gathers "
    "synchronously; a unit's reduce-scatter starts asynchronously and lands when the next unit's starts (one "
    "unit in flight, FsdpUnit.reduce_scatter / land_reduce_scatter), so backward goes on while it runs. "
    "engine/switch.py overlap_next_backward: the stage's last micro-batch (the plan's costliest, run last) "
    "starts the replicated gradient reductions bucket by bucket, as they fill, inside its backward (4 in "
    "flight on NCCL; planner/cost/grad_exposure.py prices what it leaves exposed). tp overlap "
    "(parallel/regions.py, parallel/row_scatter.py, group_collectives.py; on by default): a column region's "
    "token all-gather runs with its readers' GEMMs and a row-parallel output's reduce-scatter with its GEMM "
    "(torch.ops.symm_mem fused_all_gather_matmul / fused_matmul_reduce_scatter on NCCL, never run on a GPU "
    "yet; a ring of tp - 1 send / receive steps on gloo), backward the conjugates; Ulysses all-to-alls "
    "run synchronously between the kernels. models/attention.py: 'auto' on "
    "CUDA bf16 takes flash-attn's varlen kernel (FlashAttention-2; FA3 / FA4 first where installed, "
    "models/attention_kernels.py, priced only as an option a user turns on). parallel/sequence_parallel.py: tp is "
    "sequence parallel; q/k/v and w1/w3 keep their input's token shard and all-gather it again in backward "
    "(exposed: no GEMM beside it; with tp overlap off, on gloo in the same collective as the region's "
    "input-gradient reduce-scatter). "
    "No selective checkpointing. Optimizer: torch Adam on the fp32 home shard (reads gradient, weight, m, v; "
    "writes weight, m, v: 28 B per parameter; not in the planner's prices: the same for every plan). "
    "parallel/kv_ring.py: the KV kinds pass K / V around the KV group's ring, each step's transfer posted "
    "(batch_isend_irecv) before the step's block attention and waited after it, dK / dV passed around the ring "
    "the same way in backward (cp_comm_overlap); backward runs from the saved output and log-sum-exp, no "
    "attention forward again (kv_gather_recomputes_attention False).",
    tp_regather=True, kv_gather_recomputes_attention=False,
    # FP8 linears exist (parallel/fp8.py, strategy.runtime.fp8) but are the user's option: the rates join only
    # through hotspa_runtime(fp8=...), never the planner's default prices
    compile_speedup=TORCHTITAN_COMPILE_SPEEDUP, fp8_recipe_speedups=(),
)


def hotspa_runtime(fp8: str | None = None) -> RuntimeProfile:
    """Our runtime description as a user runs it: :data:`HOTSPA`, plus torchao's FP8 rates
    (:data:`TORCHAO_FP8_RATES`) when ``strategy.runtime.fp8`` names a recipe (parallel/fp8.py; it has no FP8
    all-gather of ``:fsdp`` shards, which torchao's tensorwise row used: that rate over-credits ours a little).

    Args:
        fp8: None (bf16) or one of :data:`FP8_RECIPES`.
    """
    if fp8 is None or fp8 == "":
        return HOTSPA
    if fp8 not in FP8_RECIPES:
        raise ValueError(f"hotspa_runtime: fp8={fp8!r} is not one of {list(FP8_RECIPES)}")
    return dataclasses.replace(HOTSPA, fp8_recipe_speedups=TORCHAO_FP8_RATES)
HOTSPA_OPTIONS_NOTE = (
    "Priced only where the user turns them on (not in the planner's default prices): "
    "strategy.runtime.compile_blocks (inductor per transformer block) at torchtitan's compile rate (the same "
    "per-block inductor compile, TORCHTITAN_COMPILE_SPEEDUP: ASSUMED equal, never run on a GPU here); "
    "strategy.runtime.fp8 (torchao recipes through parallel/fp8.py, hotspa_runtime(fp8=...)) at torchao's published "
    "rates, TORCHAO_FP8_RATES (never run on a GPU here; no FP8 all-gather of :fsdp shards); attention_backend "
    "fa3_varlen / fa4_varlen / cudnn_varlen at the hardware profile's efficiency of that kernel "
    "(planner/cost/hardware.py).")

RUNTIME_PROFILES: dict[str, RuntimeProfile] = {
    "hotspa": HOTSPA,
    "llm-foundry": RuntimeProfile(
        name="llm-foundry", fsdp_gather_prefetch=True, fsdp_recompute_gather_prefetch=True,
        fsdp_reduce_scatter_overlap=True, dp_reduce_overlap=True,
        tp_comm_overlap=False, cp_comm_overlap=False, attention_kernel="fa2", optimizer_bytes_per_param=32.0,
        source="Composer + PyTorch FSDP1 (backward_prefetch BACKWARD_PRE, also ahead of a checkpointed unit's "
        "recomputation, whose forward pre-hook unshards; reduce-scatter on its own stream: FSDP1's design); "
        "MPT attn_impl 'flash' (flash-attn) "
        "in scripts/train/yamls/pretrain/mpt-*.yaml; no tp/cp. "
        "Optimizer (the same yamls): decoupled_adamw on fp32 sharded weights with norm gradient clipping: "
        "reads gradient, weight, m, v, writes weight, m, v, reads the gradient for its norm: 32 B per parameter.",
    ),
    "torchtitan": RuntimeProfile(
        name="torchtitan", fsdp_gather_prefetch=True, fsdp_recompute_gather_prefetch=True,
        fsdp_reduce_scatter_overlap=True, dp_reduce_overlap=True,
        tp_comm_overlap=False, cp_comm_overlap=True, attention_kernel="fa2",
        selective_recompute="every-other-mm", optimizer_bytes_per_param=32.0, fp8_gemm_speedup=1.461,
        compile_speedup=TORCHTITAN_COMPILE_SPEEDUP, fp8_recipe_speedups=TORCHAO_FP8_RATES,
        source="FSDP2 (implicit one-unit prefetch, in a checkpointed unit's recomputation too; reduce-scatter on "
        "a separate stream); the bf16 rows use "
        "vanilla TP (AsyncTP off: the asyncTP benchmark's 'Vanilla TP' column); CP is torch's ring attention "
        "(torch/distributed/tensor/experimental/_attention.py, December 2024) with torchtitan's default "
        "rotate method 'allgather' (torchtitan/config_manager.py @ 9dec370ad26b: 'all-gather all kv shards on "
        "ranks after the first sub-SDPA computation', so overlapped with that chunk), dK / dV "
        "reduce-scattered in backward, the kernel's backward from the saved output and log-sum-exp (no "
        "forward re-run), causal chunks load-balanced; attention: SDPA's flash kernel (FA2). Selective "
        "'op' checkpointing (torchtitan/models/llama/parallelize_llama.py @ 82010c7934150aaa55e5b8ee0aa03f372ec90cc2, "
        "_custom_policy): saves every compute op's output (matmuls, SDPA) 'except every second mm' of a block, "
        "whose forward the backward re-runs. Optimizer: AdamW on the fp32 FSDP2 shards with gradient-norm "
        "clipping: 32 B per parameter (as llm-foundry's). Float8 (torchao, dynamic scaling) linears: 1.450 x the "
        "bf16 GEMM rate, derived from its Table 1 pair (FSDP + torch.compile 6,667 vs + Float8 8,532 tokens/s/GPU, "
        "published_pricing.derive_fp8_speedup). torch.compile: its Table 1 pair (FSDP 5,762 vs + torch.compile "
        "6,667) as a GEMM-side rate (TORCHTITAN_COMPILE_SPEEDUP); torchao recipes: TORCHAO_FP8_RATES.",
    ),
    "megatron-2022": RuntimeProfile(
        name="megatron-2022", fsdp_gather_prefetch=False, fsdp_recompute_gather_prefetch=False,
        fsdp_reduce_scatter_overlap=False, dp_reduce_overlap=True,
        tp_comm_overlap=False, cp_comm_overlap=False, attention_kernel="unfused",
        selective_recompute="core-attention", optimizer_bytes_per_param=42.0,
        source="Megatron-LM as in arXiv 2205.05198: tp all-gathers / reduce-scatters (sequence parallel) on the "
        "critical path, dp gradient all-reduce overlapped with backward (its README), no FSDP. Attention: its "
        "CoreAttention materializes the scores: baddbmm into [b*np, sq, sk], FusedScaleMaskSoftmax, dropout, "
        "bmm (megatron/model/transformer.py @ b35d061efc6e88dc656c42ba328728679c2e3e02; flash-attn came to "
        "Megatron-LM only in 2023), priced as 'unfused' (planner/cost/efficiency.py). Selective recompute = that core "
        "attention, re-run in backward (the paper's definition). Optimizer: apex FusedAdam on fp32 main weights "
        "and main grads: norm read 4, Adam reads 16 and writes 12, copy to the bf16 weights 6, zeroing the "
        "main grads 4: 42 B per parameter; the README: its FLOPs are 'measured for end-to-end training, i.e., "
        "includes all operations including data loading, optimization'.",
    ),
    "nemo-te": RuntimeProfile(
        name="nemo-te", fsdp_gather_prefetch=False, fsdp_recompute_gather_prefetch=False,
        fsdp_reduce_scatter_overlap=False, dp_reduce_overlap=True,
        tp_comm_overlap=False, cp_comm_overlap=True, attention_kernel="cudnn", optimizer_bytes_per_param=42.0,
        tp_regather=True, fp8_gemm_speedup=NEMO_TE_FP8_GEMM_SPEEDUP,
        source="NeMo 24.03 on Megatron-core with Transformer Engine (the long-sequence table's container): tp "
        "with sequence parallelism, its collectives on the critical path (tp comm overlap ASSUMED off: the "
        "table does not say), the column-parallel inputs re-gathered in backward (Megatron-core); cp is TE's "
        "ring attention (AttnFuncWithCP, p2p): each step's K / V send / receive runs while the previous chunk's "
        "attention computes (overlapped), causal chunks load-balanced (2 cp chunks per sequence), backward "
        "from the saved output and softmax statistics; attention: TE's cuDNN fused attention; dp: the "
        "distributed optimizer's gradient reduction overlapped with backward; optimizer as megatron-2022 "
        "(fp32 main params and grads, 42 B per parameter). TE FP8 linears (delayed scaling): their rate over bf16 "
        "fitted with the H100's cuDNN attention efficiency on every other row of its long-sequence table "
        "(published_fit.fit_fp8_and_attention; the table has no bf16 twin).",
    ),
    "megatron-core": RuntimeProfile(
        name="megatron-core", fsdp_gather_prefetch=False, fsdp_recompute_gather_prefetch=False,
        fsdp_reduce_scatter_overlap=False, dp_reduce_overlap=True,
        tp_comm_overlap=True, cp_comm_overlap=True, attention_kernel="cudnn", optimizer_bytes_per_param=42.0,
        tp_regather=True,
        source="Megatron-LM README's H100 scaling runs (NVIDIA/Megatron-LM README.md, 'Training Speed and "
        "Scalability', images/model_table.png @ f2e5db402c44ae309aa6448bcb4ae87e8ae0f5f4): Megatron-core with "
        "'--overlap-grad-reduce --overlap-param-gather' (dp reduction in backward) and '--tp-comm-overlap' (the "
        "sequence-parallel all-gather / reduce-scatter overlapped with their GEMMs, Transformer Engine userbuffers); "
        "the column-parallel inputs re-gathered in backward (ASSUMED, Megatron-core's default); attention: "
        "Transformer Engine's fused attention, priced as cuDNN (ASSUMED: the README does not say); optimizer as "
        "megatron-2022 (42 B per parameter, priced over tp x pp: its distributed optimizer shards it further, "
        "an overestimate of ~1-4 % of these rows' steps).",
    ),
    "trl-deepspeed-ulysses": RuntimeProfile(
        name="trl-deepspeed-ulysses", fsdp_gather_prefetch=True, fsdp_recompute_gather_prefetch=True,
        fsdp_reduce_scatter_overlap=True, dp_reduce_overlap=True,
        tp_comm_overlap=False, cp_comm_overlap=False, attention_kernel="fa2", optimizer_bytes_per_param=0.0,
        source="Hugging Face TRL SFTTrainer on DeepSpeed ZeRO-3 with Ulysses sequence parallelism (the ulysses-sp "
        "blog's benchmark, huggingface/blog ulysses-sp.md): the working copy sharded over every rank, its gathers "
        "prefetched and its gradient reduce-scatters overlapped (ZeRO-3's prefetch and overlap_comm: ASSUMED, the "
        "blog does not say); Ulysses (DeepSpeed UlyssesSPAttentionHF): two all-to-alls per layer around the "
        "attention kernel, on the critical path (not overlapped); attention: flash-attn 2 (kernels-community/"
        "flash-attn2); HF gradient checkpointing: every decoder layer's forward re-run. The optimizer is "
        "offloaded to the CPU (its Adam step on the host, gradients and weights over PCIe): not priced "
        "(optimizer_bytes_per_param 0), which is why its rows are listed, not priced.",
    ),
}


def get_runtime(runtime: str | RuntimeProfile) -> RuntimeProfile:
    """The runtime profile of that name, or the object itself."""
    if isinstance(runtime, RuntimeProfile):
        return runtime
    if isinstance(runtime, str) and runtime in RUNTIME_PROFILES:
        return RUNTIME_PROFILES[runtime]
    raise UnknownRuntimeError(f"unknown runtime profile {runtime!r}; known: {', '.join(RUNTIME_PROFILES)}")
