"""Published measured training runs (dense decoders, A100 / H100) the cost model is held against.

Each row is the source's own stated configuration and measured throughput, cited by repository +
file + commit or paper + table; ``recipes/benchmark_published.py`` prices them. FP8 rows are priced
with their linears at their runtime's ``fp8_gemm_speedup`` (docs/cost-model.md). Rows that the cost
model cannot express (FP8 of a runtime without a stated rate, 405B-class pp rows with FP8) are kept with
``excluded`` saying why, outside the statistics (the only readable Ulysses table, the Hugging Face
blog's Qwen3-4B runs, among them: its CPU-offloaded optimizer). MPT models (llm-foundry) are priced as
FLOP-equivalent Llama shapes: multi-head attention, and a SwiGLU width of 8h/3 (three h x 8h/3
matrices = MPT's two h x 4h ones); their embedding is tied, as MPT's is.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...model_shape import ModelShape
from .pp_schedule import PipelineSchedule

__all__ = ["PublishedRun", "PUBLISHED_RUNS", "QWEN3_4B", "mpt_config", "megatron_flops_per_token",
           "megatron_gpt_config", "nemo_llama2_tokens_per_s"]

LLM_FOUNDRY = ("mosaicml/llm-foundry scripts/train/benchmarking/README.md @ 495218376830947dce625efabc4d86be7c47cc45, "
               "table '{table}'; model shape scripts/train/yamls/pretrain/mpt-{size}.yaml @ 8c8dd48f7216")
TORCHTITAN_2412 = ("pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md @ "
                   "820504e20d1149fbf0b98c567af24c4b0433b22d, {table}; seq_len 8192 from "
                   "train_configs/llama3_{size}.toml @ 9dec370ad26b")
TORCHTITAN_ASYNC_TP = ("pytorch/torchtitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md @ "
                       "4a61bd87d3c7e92bcfeb5d5464d9e6bd13ef440a, {table}, row 'None (bfloat16)', Vanilla TP; "
                       "seq_len 8192 from train_configs/llama3_{size}.toml @ 9dec370ad26b")
TORCHTITAN_H200 = ("pytorch/torchtitan benchmarks/llama3_8b_h200_2025-06_torchtitan.md @ "
                   "bcdeaa37c92d1eaceeec3351e7ac81be6a1488af, NUM_NODES 4 row (Trainy, 4 x 8 H200, local batch 2, "
                   "torch.compile, --model.converters float8)")
MEGATRON_22B = ("NVIDIA/Megatron-LM README.md @ 2e90a342f5006a3e4f8cacf44002dbae0e10aa17 (MFU table, 22B: 41.5 %, "
                "dp 1); configuration: Korthikanti et al. 2022, arXiv 2205.05198, Table 3 (22B: 64 heads, hidden 6144, "
                "48 layers, tp 8, pp 1, 8 GPUs, global batch 4, seq 2048, vocab 51200); tokens/s/GPU = MFU x 312e12 / "
                "(72 l h^2 (1 + s/6h + V/12lh)), the paper's model-FLOPs formula")

MEGATRON_H100 = ("NVIDIA/Megatron-LM README.md @ f2e5db402c44ae309aa6448bcb4ae87e8ae0f5f4, 'Training Speed and "
                 "Scalability', images/model_table.png row '{size}' ({heads} heads, hidden {h}, {layers} layers, tp "
                 "{tp}, pp 1, dp 48, {gpus} GPUs, batch size 192, {tflops} teraFLOP/s per GPU; vocab 131072, sequence "
                 "4096 in the text); tokens/s/GPU = teraFLOP/s / the model-FLOPs formula of megatron_flops_per_token "
                 "(Megatron's own: 72 l h^2 (1 + s/6h + V/12lh), causal attention counted whole)")

NEMO_LONG = ("NVIDIA/NeMo docs/source/performance/performance_long_sequence.md @ "
             "8cfedd7203462cb251a914e700e5605444277561, table 'LLAMA2-7B (FP8) - H100' (NeMo 24.03.01, DGX-H100), "
             "row SeqLen {k}K, 'With CP' columns (tp {tp}, pp 1, dp {dp}, cp {cp}, {tflops} TFLOPS/GPU; 'Batch Size' "
             "{gbs}); tokens/s/GPU = TFLOPS / the llama2 model-FLOPs formula of nemo/utils/flops_formulas.py at the "
             "same commit (causal attention counted as half)")
TORCHTITAN_CP = ("pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md @ "
                 "820504e20d1149fbf0b98c567af24c4b0433b22d, Table 2 row '{row}' (FSDP + CP + torch.compile + "
                 "Float8, 8 GPUs, local batch 1, full activation checkpointing)")

HF_ULYSSES = ("huggingface/blog ulysses-sp.md @ 01d33d5c4b3eef17ffb79275e339f6ecad6484a4, section 'Benchmarks', "
              "tables 'Setup' and 'Throughput', row '{row}' (Qwen3-4B, TRL SFTTrainer, H100 80GB, DeepSpeed ZeRO-3 "
              "with CPU optimizer offloading, gradient checkpointing, kernels-community/flash-attn2; global batch 8 "
              "= grad acc 8 x 1 sequence); tokens/s/GPU = the table's Tokens/s / {gpus} GPUs (ASSUMED: the figure is "
              "over all GPUs, its 'vs Baseline' column compares it with the 1-GPU run)")
#: Qwen3-4B: 36 layers, 32 / 8 heads, tied embeddings (Qwen3 Technical Report, arXiv 2505.09388, Table 1);
#: hidden 2560, ffn 9728, vocab 151936 and head_dim 128 as the model's config.json gives them (quoted by a
#: third-party table; config.json itself not readable here). Its attention width (32 x 128 = 4096) is not
#: its hidden size: a :class:`ModelShape` states head_dim.
QWEN3_4B = ModelShape(vocab_size=151936, hidden=2560, n_layers=36, n_heads=32, n_kv_heads=8, ffn_hidden=9728,
                      head_dim=128, tie_embeddings=True)
_HF_UNPRICED = ("the optimizer is offloaded to the CPU (DeepSpeed ZeRO-3 offload_optimizer): the host's Adam step "
                "and its PCIe traffic are not priced, and the table's own steps show them dominating (26.9 s for "
                "65,536 tokens on 1 GPU, 28.3 s on 4 GPUs at 8K; no constant overhead fits both the 8K and the 64K "
                "rows)")

#: Llama 2's vocabulary in NeMo's FLOPs formula (LLM_VOCAB_SIZE_MAP["llama2"], nemo/utils/flops_formulas.py)
_NEMO_LLAMA2_VOCAB = 32000


def nemo_llama2_tokens_per_s(tflops_per_gpu: float, seq_len: int, hidden: int = 4096, layers: int = 32,
                             heads: int = 32, kv_heads: int = 32, ffn: int = 11008) -> float:
    """Tokens/s/GPU a NeMo TFLOPS/GPU figure of a Llama 2 model stands for: NeMo's ``llama2`` model-FLOPs
    formula per token, ``l h^2 (12 + 12 g/a + 18 f/h + 6 s/h + 6 V/(l h))`` (causal attention half of
    ``12 s/h``). Args: the figure, the sequence length and the model's shape (default Llama 2 7B)."""
    per_token = layers * hidden * hidden * (12 + 12 * kv_heads / heads + 18 * ffn / hidden + 6 * seq_len / hidden
                                             + 6 * _NEMO_LLAMA2_VOCAB / (layers * hidden))
    return tflops_per_gpu * 1e12 / per_token


_MPT = {"1b": (2048, 24, 16), "3b": (2560, 32, 20), "7b": (4096, 32, 32), "13b": (5120, 40, 40),
        "30b": (7168, 48, 56), "70b": (8192, 80, 64)}


def mpt_config(size: str) -> ModelShape:
    """The FLOP-equivalent Llama shape of llm-foundry's ``mpt-<size>.yaml`` (vocab 50368, head dim 128)."""
    h, layers, heads = _MPT[size]
    return ModelShape(vocab_size=50368, hidden=h, n_layers=layers, n_heads=heads, n_kv_heads=heads,
                      ffn_hidden=round(8 * h / 3), tie_embeddings=True)


def megatron_gpt_config(hidden: int, layers: int, heads: int, vocab: int = 51200) -> ModelShape:
    """The FLOP-equivalent Llama shape of a Megatron GPT (4h GELU MLP -> SwiGLU 8h/3, rounded to 64)."""
    return ModelShape(vocab_size=vocab, hidden=hidden, n_layers=layers, n_heads=heads, n_kv_heads=heads,
                      ffn_hidden=64 * round(8 * hidden / 3 / 64))


def megatron_flops_per_token(hidden: int, layers: int, seq_len: int, vocab: int) -> float:
    """Megatron-LM's model FLOPs per token of a GPT (4h MLP, no GQA): ``72 l h^2 (1 + s/6h + V/12lh)``
    (Narayanan et al. 2021, arXiv 2104.04473, eq. 3 without recomputation; ``num_floating_point_operations``
    of megatron/training/training.py gives the same for such a model). Args: the model's width, depth,
    the sequence length and the vocabulary."""
    return 72.0 * layers * hidden ** 2 * (1 + seq_len / (6 * hidden) + vocab / (12 * layers * hidden))


MEGATRON_H100_PP = ("NVIDIA/Megatron-LM README.md @ f2e5db402c44ae309aa6448bcb4ae87e8ae0f5f4, 'Training Speed and "
                    "Scalability', images/model_table.png row '{size}' ({heads} heads, hidden {h}, {layers} layers, tp "
                    "8, pp {pp}, dp 48, {gpus} GPUs, batch size {batch}, {tflops} teraFLOP/s per GPU; vocab 131072, "
                    "sequence 4096 and 'pipeline-parallel communication (enabled by default)' overlapped with "
                    "computation in the text); tokens/s/GPU = teraFLOP/s / megatron_flops_per_token")

#: the schedule Megatron-LM's pp rows ran: ASSUMED its non-interleaved 1F1B (the README states no virtual-stage
#: count; without ``--num-layers-per-virtual-pipeline-stage`` Megatron runs 1F1B, and 92 layers over 4 stages
#: leave no interleaving but one layer per chunk), ``L / pp`` layers per stage (Megatron's default split, the
#: embedding and the loss head beside the first and last stages' layers), point-to-point overlapped (the README)
MEGATRON_PIPELINE = PipelineSchedule("1f1b", split="even", p2p_overlap=True)


def _megatron_h100_pp(size: str, heads: int, h: int, layers: int, pp: int, batch: int, tflops: float) -> PublishedRun:
    """A pp row of Megatron-LM's H100 scaling table (tp 8, dp 48; issue 56), priced with :data:`MEGATRON_PIPELINE`."""
    gpus = 48 * 8 * pp
    return PublishedRun(f"megatron-h100-{size.lower()}-tp8-pp{pp}",
                        MEGATRON_H100_PP.format(size=size, heads=heads, h=h, layers=layers, pp=pp, gpus=gpus,
                                                batch=batch, tflops=tflops),
                        "megatron-core", "H100", megatron_gpt_config(h, layers, heads, vocab=131072), gpus, 48, 8,
                        1, pp, "none", 4096, 1, batch // 48, "none", "bf16",
                        tflops * 1e12 / megatron_flops_per_token(h, layers, 4096, 131072),
                        note=f"micro-batch 1 x {batch // 48} per dp rank ASSUMED (batch {batch} over dp 48), no "
                        f"recompute ASSUMED, 1F1B ASSUMED", pipeline=MEGATRON_PIPELINE)


def _megatron_h100(size: str, heads: int, h: int, layers: int, tp: int, tflops: float) -> PublishedRun:
    """A pp-1 row of Megatron-LM's H100 scaling table (its pp rows: :func:`_megatron_h100_pp`)."""
    gpus = 48 * tp
    return PublishedRun(f"megatron-h100-tp{tp}", MEGATRON_H100.format(size=size, heads=heads, h=h, layers=layers,
                                                                      tp=tp, gpus=gpus, tflops=tflops),
                        "megatron-core", "H100", megatron_gpt_config(h, layers, heads, vocab=131072), gpus, 48, tp,
                        1, 1, "none", 4096, 1, 4, "none", "bf16",
                        tflops * 1e12 / megatron_flops_per_token(h, layers, 4096, 131072),
                        note="micro-batch 1 x 4 accumulation ASSUMED (batch 192 over dp 48), no recompute ASSUMED")


@dataclass(frozen=True)
class PublishedRun:
    """One published measured run.

    Args: ``id``; ``source`` (citation); ``system`` (a :data:`~.runtime_profile.RUNTIME_PROFILES` key: the
    runtime that produced it); ``gpu`` (a hardware profile name); ``model`` (a preset name or a config);
    ``world``, ``dp``, ``tp``, ``cp``, ``pp``; ``sharding`` (``"full"`` FSDP / ZeRO-3, ``"grad_op"``
    ZeRO-2, ``"none"`` replicated); ``seq_len``; ``micro_batch`` (sequences per micro-batch per dp
    rank); ``grad_accum``; ``checkpointing`` (``"full"``, ``"selective"``, ``"none"``); ``precision``;
    ``tokens_per_s_per_gpu`` (the published figure, or derived from its MFU / TFLOPS as ``source`` says);
    ``excluded`` (why it is outside the statistics, or ``""``); ``note``; ``cp_kv`` (how cp is done, as
    :class:`~lightning_hotspa.layout.Layout`'s: 1 Ulysses all-to-all, ``cp`` ring / all-gather of K and V);
    ``compiled`` (torch.compile'd: priced at its runtime's ``compile_speedup``); ``fp8_recipe`` (a torchao
    recipe an FP8 row names: priced at its runtime's rate for it; "": the runtime's own ``fp8_gemm_speedup``);
    ``pipeline`` (a pp row's schedule and layer split, :class:`~.pipeline.PipelineSchedule`)."""

    id: str
    source: str
    system: str
    gpu: str
    model: str | ModelShape
    world: int
    dp: int
    tp: int
    cp: int
    pp: int
    sharding: str
    seq_len: int
    micro_batch: int
    grad_accum: int
    checkpointing: str
    precision: str
    tokens_per_s_per_gpu: float
    excluded: str = ""
    note: str = ""
    cp_kv: int = 1
    compiled: bool = False
    fp8_recipe: str = ""
    pipeline: PipelineSchedule | None = None  # pp > 1: the schedule it ran (None: the cost model's default, 1F1B)


def _foundry(gpu: str, table: str, size: str, seq: int, world: int, mbs: int, ga: int, ac: bool,
             tps: float, sharding: str = "full", precision: str = "bf16", excluded: str = "",
             note: str = "") -> PublishedRun:
    tag = "a100" if gpu.startswith("A100") else "h100"
    suffix = "" if precision == "bf16" else "-" + precision
    return PublishedRun(id=f"foundry-{tag}-mpt{size}-{seq // 1024}k-{world}g" + suffix,
                        source=LLM_FOUNDRY.format(table=table, size=size),
                        system="llm-foundry", gpu=gpu, model=mpt_config(size), world=world, dp=world, tp=1, cp=1,
                        pp=1, sharding=sharding, seq_len=seq, micro_batch=mbs, grad_accum=ga,
                        checkpointing="full" if ac else "none", precision=precision, tokens_per_s_per_gpu=tps,
                        excluded=excluded, note=note)


def _nemo(k: int, gbs: int, tp: int, dp: int, cp: int, tflops: float, excluded: str = "") -> PublishedRun:
    """A row of NeMo's LLAMA2-7B (FP8) H100 long-sequence table: micro-batch 1 (ASSUMED: the table gives
    the global batch only), no recompute (ASSUMED), cp as Transformer Engine's ring (p2p) attention."""
    seq, world = k * 1024, tp * dp * cp
    return PublishedRun(id=f"nemo-llama2-7b-{k}k-tp{tp}-cp{cp}", source=NEMO_LONG.format(k=k, tp=tp, dp=dp, cp=cp,
                        tflops=tflops, gbs=gbs), system="nemo-te", gpu="H100", model="llama7b", world=world, dp=dp,
                        tp=tp, cp=cp, pp=1, sharding="none", seq_len=seq, micro_batch=1, grad_accum=gbs // dp,
                        checkpointing="none", precision="fp8", tokens_per_s_per_gpu=round(nemo_llama2_tokens_per_s(
                            tflops, seq), 1), excluded=excluded, cp_kv=cp,
                        note="micro-batch 1 and no recompute ASSUMED (not stated); TFLOPS converted by NeMo's formula")


def _titan_cp(fsdp: int, cp: int, seq: int, tps: float) -> PublishedRun:
    """A row of torchtitan's Table 2 (Llama 3.1 8B, 8 Grand Teton H100, Float8 linears, compiled)."""
    return PublishedRun(id=f"titan-8b-fsdp{fsdp}-cp{cp}-{seq // 1024}k", source=TORCHTITAN_CP.format(
                        row=f"FSDP {fsdp}, CP {cp}"), system="torchtitan", gpu="H100-GT500W", model="llama3-8b",
                        world=8, dp=fsdp, tp=1, cp=cp, pp=1, sharding="full", seq_len=seq, micro_batch=1, grad_accum=1,
                        checkpointing="full", precision="fp8", tokens_per_s_per_gpu=tps, cp_kv=cp, compiled=True,
                        note="cp: torch's ring attention with the default 'allgather' rotation (K/V all-gathered, "
                        "load-balanced causal chunks); compiled")


TORCHAO_FLOAT8 = ("pytorch/ao torchao/float8/README.md @ 9519bebbc397d60274982a74c084f9dff18e61a6, 'Training "
                  "benchmarks', NVIDIA H100 table, row Llama3-8b '{row}' (torchtitan 0.0.2, 8 H100, batch size 1, "
                  "sequence length 8192, torch.compile, FSDP2, per-op SAC; median tokens/second)")


def _torchao(recipe: str, tps: float) -> PublishedRun:
    """A row of torchao's float8 training table on H100 (Llama 3 8B; "" the bf16 row). The GPU is stated as
    '8xH100' only: ASSUMED the Grand Teton H100 at 500 W that the same team's torchtitan tables state (the SXM
    profile prices the bf16 row 1.25x the published figure, this one about 1.15x)."""
    row = {"": "none (bfloat16)", "tensorwise": "tensorwise with float8 all-gather",
           "rowwise": "rowwise with bfloat16 all-gather"}[recipe]
    return PublishedRun(id="torchao-8b-fsdp8" + (f"-{recipe}" if recipe else "-bf16"),
                        source=TORCHAO_FLOAT8.format(row=row), system="torchtitan", gpu="H100-GT500W",
                        model="llama3-8b",
                        world=8, dp=8, tp=1, cp=1, pp=1, sharding="full", seq_len=8192, micro_batch=1, grad_accum=1,
                        checkpointing="selective", precision="fp8" if recipe else "bf16", tokens_per_s_per_gpu=tps,
                        compiled=True, fp8_recipe=recipe,
                        note="the pair (bf16 row, recipe row) the recipe's GEMM rate is derived from" if recipe else
                        "the bf16 baseline of torchao's float8 recipes")


def _hf_ulysses(row: str, seq: int, gpus: int, tokens_per_s: float) -> PublishedRun:
    """A row of the Hugging Face Ulysses blog's benchmark (Qwen3-4B on H100s, SP = the GPU count, dp 1,
    bf16 ASSUMED: the blog's accelerate config says mixed_precision bf16); listed, not priced."""
    return PublishedRun(id=f"hf-qwen3-4b-{seq // 1024}k-sp{gpus}", source=HF_ULYSSES.format(row=row, gpus=gpus),
                        system="trl-deepspeed-ulysses", gpu="H100", model=QWEN3_4B, world=gpus, dp=1, tp=1,
                        cp=gpus, pp=1, sharding="full" if gpus > 1 else "none", seq_len=seq, micro_batch=1,
                        grad_accum=8, checkpointing="full", precision="bf16",
                        tokens_per_s_per_gpu=round(tokens_per_s / gpus, 2), excluded=_HF_UNPRICED, cp_kv=1,
                        note="cp = Ulysses (all-to-all of q, k, v and the output); bf16 and the per-GPU split ASSUMED")


_H = "H100 80GB BF16"
_HL = "H100 80GB BF16 (Large Scale, >= 128 GPUs)"
_A = "A100 80GB with 1600 Gbps node-node interconnect (RoCE)"
_F8 = "H100 80GB FP8"
_FP8 = "FP8 (amp_fp8): the cost model prices bf16 GEMMs only"
_GT = ("Grand Teton H100 (96 GB HBM2e, 500 W power limit; the source: peak between SXM and NVL)")

PUBLISHED_RUNS: tuple[PublishedRun, ...] = (
    # ---- llm-foundry (Composer, PyTorch FSDP1, flash attention), H100 80GB, bf16
    _foundry("H100", _H, "1b", 2048, 8, 14, 1, False, 45455),
    _foundry("H100", _H, "1b", 8192, 8, 3, 4, False, 29157),
    _foundry("H100", _H, "1b", 32768, 8, 1, 4, False, 12025),
    _foundry("H100", _H, "1b", 65536, 8, 1, 2, True, 5506),
    _foundry("H100", _H, "3b", 4096, 8, 5, 6, False, 20964),
    _foundry("H100", _H, "3b", 16384, 8, 1, 6, False, 11152),
    _foundry("H100", _H, "3b", 65536, 8, 1, 2, True, 3262),
    _foundry("H100", _H, "7b", 2048, 8, 6, 1, False, 10643),
    _foundry("H100", _H, "7b", 8192, 8, 8, 2, True, 6935),
    _foundry("H100", _H, "7b", 32768, 8, 2, 2, True, 3318),
    _foundry("H100", _H, "7b", 65536, 8, 1, 2, True, 1956),
    _foundry("H100", _H, "13b", 4096, 8, 10, 3, True, 4717),
    _foundry("H100", _H, "13b", 16384, 8, 3, 3, True, 2985),
    _foundry("H100", _H, "13b", 32768, 8, 1, 3, True, 1976),
    _foundry("H100", _H, "13b", 2048, 64, 2, 1, False, 4800),
    _foundry("H100", _H, "30b", 2048, 8, 3, 21, True, 2002),
    _foundry("H100", _H, "30b", 8192, 8, 1, 21, True, 1384),
    _foundry("H100", _H, "70b", 2048, 64, 8, 4, True, 1039),
    _foundry("H100", _HL, "1b", 2048, 512, 12, 1, False, 39837, sharding="grad_op"),
    _foundry("H100", _HL, "70b", 2048, 512, 8, 1, True, 1007),
    # ---- llm-foundry, A100 80GB, bf16
    _foundry("A100-80G", _A, "1b", 2048, 8, 14, 4, False, 20513),
    _foundry("A100-80G", _A, "1b", 16384, 8, 2, 4, False, 9956),
    _foundry("A100-80G", _A, "1b", 65536, 8, 1, 2, True, 3044),
    _foundry("A100-80G", _A, "3b", 8192, 8, 3, 6, False, 7695),
    _foundry("A100-80G", _A, "3b", 32768, 8, 3, 6, True, 3029),
    _foundry("A100-80G", _A, "7b", 2048, 8, 6, 2, False, 4641),
    _foundry("A100-80G", _A, "7b", 16384, 8, 4, 2, True, 2453),
    _foundry("A100-80G", _A, "7b", 65536, 8, 1, 2, True, 1013),
    _foundry("A100-80G", _A, "13b", 8192, 8, 5, 3, True, 1795),
    _foundry("A100-80G", _A, "13b", 32768, 8, 1, 3, True, 1016),
    _foundry("A100-80G", _A, "30b", 4096, 8, 1, 21, True, 814),
    _foundry("A100-80G", _A, "70b", 2048, 64, 8, 4, True, 410, note="mixed precision PURE (bf16 params)"),
    # ---- torchtitan (FSDP2, SDPA flash / cuDNN), Grand Teton H100 at 500 W, bf16 rows only
    PublishedRun("titan-8b-fsdp8", TORCHTITAN_2412.format(table="Table 1 row 'FSDP'", size="8b"), "torchtitan",
                 "H100-GT500W", "llama3-8b", 8, 8, 1, 1, 1, "full", 8192, 2, 1, "selective", "bf16", 5762,
                 note="eager; selective (op) AC priced as no recompute"),
    PublishedRun("titan-8b-fsdp8-compile",
                 TORCHTITAN_2412.format(table="Table 1 row 'FSDP + torch.compile'", size="8b"),
                 "torchtitan", "H100-GT500W", "llama3-8b", 8, 8, 1, 1, 1, "full", 8192, 2, 1, "selective", "bf16", 6667,
                 compiled=True, note="the compiled twin of titan-8b-fsdp8: the pair the compile rate is derived from"),
    PublishedRun("titan-8b-fsdp128", TORCHTITAN_2412.format(table="Table 3 row 'FSDP'", size="8b"), "torchtitan",
                 "H100-GT500W", "llama3-8b", 128, 128, 1, 1, 1, "full", 8192, 2, 1, "selective", "bf16", 5605,
                 note="eager; selective (op) AC priced as no recompute"),
    PublishedRun("titan-70b-fsdp32-tp8", TORCHTITAN_ASYNC_TP.format(table="Llama3 70b on 256 H100s table", size="70b"),
                 "torchtitan", "H100-GT500W", "llama3-70b", 256, 32, 8, 1, 1, "full", 8192, 16, 1, "full", "bf16",
                 597.3, compiled=True,
                 note="torch.compile; local batch 16 per dp rank"),
    PublishedRun("titan-8b-fsdp8-tp8", TORCHTITAN_ASYNC_TP.format(table="Llama3 8b on 64 H100s table", size="8b"),
                 "torchtitan", "H100-GT500W", "llama3-8b", 64, 8, 8, 1, 1, "full", 8192, 12, 1, "selective", "bf16",
                 4378, compiled=True,
                 note="torch.compile; per-op SAC"),
    # ---- Megatron-LM (tp 8 with sequence parallel, selective recompute), A100 80GB
    PublishedRun("megatron-22b-tp8", MEGATRON_22B, "megatron-2022", "A100-80G", megatron_gpt_config(6144, 48, 64),
                 8, 1, 8, 1, 1, "none", 2048, 1, 4, "selective", "bf16", 927.6,
                 note="micro-batch 1 x 4 ASSUMED (global batch 4); selective recompute priced as none"),
    # ---- Megatron-LM on H100 (Megatron-core, tp comm overlap, dp reduction overlapped): its scaling table's pp-1
    # rows (issue 52)
    _megatron_h100("1.7B", 16, 2048, 24, 1, 408.8),
    _megatron_h100("7.1B", 32, 4096, 30, 2, 465.9),
    _megatron_h100("16B", 48, 6144, 32, 4, 489.1),
    _megatron_h100("32B", 56, 7168, 48, 8, 459.6),
    # ... and its pp rows (issue 56), each priced with the schedule it ran (1F1B ASSUMED) and Megatron's even split
    _megatron_h100_pp("70B", 64, 8192, 84, 2, 384, 419.7),
    _megatron_h100_pp("119B", 80, 10240, 92, 4, 768, 420.5),
    _megatron_h100_pp("177B", 96, 12288, 96, 6, 1152, 432.8),
    _megatron_h100_pp("314B", 128, 16384, 96, 8, 1536, 474.4),
    _megatron_h100_pp("462B", 144, 18432, 112, 16, 3072, 459.9),
    # ---- context parallel (issue 39): FP8 linears priced at their runtime's fp8_gemm_speedup (torchtitan's
    # from its Table 1 pair, NeMo / TE's fitted on its own table); cp_kv = cp: ring / all-gather of K and V
    PublishedRun("titan-8b-fsdp8-compile-fp8",
                 TORCHTITAN_2412.format(table="Table 1 row 'FSDP + torch.compile + Float8'", size="8b"),
                 "torchtitan", "H100-GT500W", "llama3-8b", 8, 8, 1, 1, 1, "full", 8192, 2, 1, "selective", "fp8", 8532,
                 compiled=True,
                 note="the FP8 twin of titan-8b-fsdp8-compile: the pair the FP8 GEMM rate is derived from"),
    PublishedRun("titan-8b-fsdp128-compile-fp8",
                 TORCHTITAN_2412.format(table="Table 3 row 'FSDP + torch.compile + Float8'", size="8b"),
                 "torchtitan", "H100-GT500W", "llama3-8b", 128, 128, 1, 1, 1, "full", 8192, 2, 1, "selective", "fp8",
                 8380, compiled=True, note="held out from the FP8 rate's derivation"),
    # ---- torchao's own float8 training table (torchtitan runs, 8 H100, compiled): its recipes' GEMM rates
    *(_torchao(recipe, tps) for recipe, tps in (("", 6150), ("tensorwise", 7689.5), ("rowwise", 6768))),
    _titan_cp(8, 1, 32768, 3890),
    _titan_cp(4, 2, 65536, 2540),
    _titan_cp(2, 4, 131072, 1071),
    _titan_cp(1, 8, 262144, 548),
    _nemo(4, 1024, 1, 4, 1, 768),
    _nemo(16, 256, 2, 8, 1, 660),
    _nemo(32, 128, 2, 8, 2, 610),
    _nemo(64, 64, 4, 8, 2, 574),
    _nemo(128, 32, 4, 8, 4, 555),
    _nemo(256, 16, 4, 8, 8, 549),
    _nemo(512, 8, 8, 4, 16, 549),
    _nemo(1024, 4, 8, 4, 32, 536),
    # ---- listed, not in the statistics
    _foundry("H100", _F8, "3b", 8192, 8, 3, 6, False, 19146, precision="fp8", excluded=_FP8),
    _foundry("H100", _F8, "1b", 8192, 8, 2, 4, False, 32010, precision="fp8", excluded=_FP8),
    PublishedRun("titan-405b-fsdp8-tp8-pp8", TORCHTITAN_2412.format(table="Table 5 row '1F1B'", size="405b"),
                 "torchtitan", "H100-GT500W", "llama3-70b", 512, 8, 8, 1, 8, "full", 8192, 32, 1, "full", "fp8", 100,
                 excluded="405B, pipeline parallel (pp 8) and Float8: not expressible"),
    PublishedRun("titan-8b-h200-fsdp32-fp8", TORCHTITAN_H200, "torchtitan", "H200", "llama3-8b", 32, 32, 1, 1, 1,
                 "full",
                 8192, 2, 1, "selective", "fp8", 10938,
                 excluded="Float8 linears and Float8 FSDP all-gather (the only published H200 figures found)"),
    # ---- Ulysses (all-to-all) cp, the only readable training table with its configuration: listed, not priced
    _hf_ulysses("Baseline (1 GPU), 8K", 8192, 1, 2436),
    _hf_ulysses("SP=4 (4 GPU), 8K", 8192, 4, 2315),
    _hf_ulysses("SP=4 (4 GPU), 32K", 32768, 4, 7872),
    _hf_ulysses("SP=4 (4 GPU), 64K", 65536, 4, 13396),
    PublishedRun("nemo-llama3-70b-tp4-pp8", "NVIDIA-NeMo/Megatron-Bridge, file performance-summary-archive.md under "
                 "its docs folder, @ "
                 "4ab94dfad36641cabdeb96452b21bf676aac4772, 25.09 DGX-H100 table, LLAMA3_70B row", "megatron-2022",
                 "H100", "llama3-70b", 64, 2, 4, 1, 8, "none", 8192, 1, 64, "selective", "fp8", 1619,
                 excluded="pipeline parallel (pp 8, vp 5) and FP8 (the H100 Llama rows there are FP8)"),
)
