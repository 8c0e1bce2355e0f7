"""Analytic cost model: predicted seconds and memory of documents, micro-batches, stages and switches.

Everything the solver optimizes reduces to four numbers per *option* (a layout with activation
checkpointing on or off), collected in :class:`OptionCost`:

* ``quadratic`` and ``linear``: a document of cp-padded length ``s`` costs ``a*s^2 + b*s`` seconds on
  its tp x cp group (plus ``per_document``, zero analytically, fitted in profiled mode: the CPU
  attention backend runs one kernel per document). Why per document: with varlen attention
  (``cu_seqlens``) packed documents do not attend to each other, so a micro-batch's work is the sum
  over its documents. Why this form: dense FLOPs are linear in ``s`` and causal attention FLOPs are
  ``~s^2`` (Hydraulis' ``a s^2 + b s + c``).
* ``per_micro_batch``: fixed seconds per micro-batch (collective latencies, launches).
* ``stage_fixed``: seconds per stage: the dp gradient reduce-scatter into the world-sharded home state.
  Consecutive stages of one tp degree keep accumulating into the same working gradients and reduce
  once (:func:`shares_gradients`): a plan pays it once per such run (:mod:`.predict`).

How work divides over tp and cp. A tp x cp group owns one micro-batch. Tensor parallelism splits
every weight, so each tp rank does ``1/tp`` of every GEMM on its tokens; Ulysses context parallelism
gives each cp rank ``1/cp`` of the tokens for the GEMMs and, after its all-to-all, ``1/cp`` of the
heads over the whole sequence for attention. Both parts therefore divide by ``tp*cp`` (the 2*cp chunk
split of plan.py keeps causal work even, and is exact under Ulysses since attention runs on whole
rows); the cost is padding (``s`` rounded up to ``2*cp``) and communication:

* TP (Megatron-style): 2 all-reduces of ``[s/cp, h]`` per layer forward, 2 backward, 2 more when
  checkpointing recomputes the forward; ring cost ``2(tp-1)/tp * bytes / busbw``. Sequence
  parallelism replaces each by an all-gather + a reduce-scatter of the same bytes (priced as the
  all-reduce); a runtime that re-gathers the column-parallel inputs in backward
  (``RuntimeProfile.tp_regather``, ours) adds one all-reduce's bytes per layer, and 2 launches
  except on CPU without tp overlap (the region's input-gradient all-to-all carries it on gloo).
  The collectives beside a GEMM (the 4 per layer, and what recomputation reruns) cost
  ``1 - layer_comm_overlap`` of their time when the runtime overlaps them
  (``RuntimeProfile.tp_comm_overlap``; ours: fused symmetric-memory ops on NCCL, a ring of tp - 1
  steps on gloo, each step a launch); the re-gathers and the embedding's reduce-scatter stay exposed.
* CP (Ulysses): per layer one all-to-all of fused q/k/v and one of the output forward, the same
  backward (+ forward again with checkpointing); each moves ``(cp-1)/cp`` of its ``1/tp`` head slice.
* Attention kernels run below their long-sequence rate on short calls: a call of ``r`` query rows at
  ``e r / (r + r_half)`` (:mod:`.efficiency`), so a document pays ``a r_half cp_kv s`` more (the KV-gather
  part splits its rows ``cp_kv`` ways), in ``b`` and in ``OptionCost.attention_linear``.
* Local shapes are smaller than the unsharded ones, so a rank's kernels may run below the
  unsharded efficiency: compute divides by ``tp*cp * hardware.shard_efficiency(tp, cp)`` (a
  measured per-degree curve, recipes/gpu_check.py part (c); 1.0 when the profile has none).
* CP KV ring (``cp_kv``, :mod:`~lightning_hotspa.parallel.kv_ring`; the hybrid runs Ulysses over
  ``u = cp / cp_kv`` ranks first, priced as above with ``u``): per layer ``cp_kv - 1`` ring steps of the
  local K / V forward, as many of K / V and of dK / dV backward (+ a forward's with checkpointing), each
  ``s/cp`` tokens x ``2 kv_width/tp`` (the kv heads a rank holds after the Ulysses part repeats them),
  plus the last dK / dV shift, after the last kernel (exposed). Where the runtime overlaps it
  (``RuntimeProfile.cp_comm_overlap``, ours) each step's transfer runs under the step's attention, so a
  document of ``s`` tokens pays ``max(0, x s - h s^2)`` beyond ``a s^2 + b s`` (``OptionCost.ring_exchange``
  x, ``ring_hiding`` h: the attention of ``cp_kv - 1`` of its ``cp_kv`` steps, x ``hardware.layer_comm_overlap``;
  one launch per round exposed), as the Ring Attention paper states it (Liu, Zaharia, Abbeel, arXiv
  2310.01889, §3: the key-value transfer is fully overlapped while a block's compute takes at least as long
  as its transfer) and Transformer Engine's ``AttnFuncWithCP`` runs it (NeMo's long-sequence rows,
  priced within 0.97-1.05 of their published tokens/s, recipes/benchmark_published.py); otherwise all
  of it is in ``b`` and each step a launch. A runtime that gathers K / V without saving them re-runs the
  attention forward in backward: attention FLOPs x 4/3 (``RuntimeProfile.kv_gather_recomputes_attention``;
  ours no longer does: backward from the saved output and log-sum-exp). Each kind's collectives are data
  in its record (:mod:`lightning_hotspa.cp_kinds`, ``CpKind.exchanges``), which this model prices without
  asking which kind it is.
* Activation checkpointing (:class:`~lightning_hotspa.activation_checkpointing.Checkpointing`): full recomputes
  each layer's forward, +1/3 of the layers' training FLOPs (and its tp / cp collectives); selective
  recomputes the attention core (the q/k/v projections' GEMMs, rotary, the attention kernel's
  forward and its cp exchange; under sequence parallelism the attention input's tp all-gather), +1/3
  of the attention FLOPs and 2 x the q/k/v parameters per token. Not offered for sharded (``fsdp``)
  copies: the runtime does not build it.
* dp: one reduce-scatter of the stage's fp32 gradients per run of same-tp stages (docs/DESIGN.md §4,
  "Gradients live in the engine's store"); with ``RuntimeProfile.dp_reduce_overlap`` (ours: buckets
  launched inside the last micro-batch's backward) only the part that backward cannot hide
  (:mod:`.grad_exposure`: the last buckets, the embedding's at least).
* Switches (switch.py): a move from tp ``s`` to tp ``t < s`` all-gathers ``1/t - 1/s`` of the bf16
  weights over a group spanning ``s`` consecutive ranks; ``t >= s`` is a local slice (free). Home is
  sharded over the whole world. Group spans decide intra- (NVLink) vs inter-node bandwidth, nodes of
  ``devices_per_node``; the mesh puts tp on the most local dims, then cp, then dp.
* Sharded working copy (``fsdp``, :meth:`AnalyticCostModel.fsdp_exchange_seconds`): per micro-batch
  every unit gathered twice in the working dtype and reduce-scattered once in fp32 over the dp*cp
  ranks; its exposed part (GEMMs hide the parts the runtime overlaps, :mod:`.runtime_profile`, up to
  ``hardware.layer_comm_overlap``) goes into ``linear``
  and ``per_micro_batch``; no stage-end reduction (``stage_fixed`` 0); switches into it are local;
  its dp groups run in lockstep rounds (:meth:`OptionCost.stage_seconds`). HSDP (``:fsdp8``): the
  same over its ``fsdp_shard`` ranks (the span tp x shard: one node when it fits), a stage-end
  reduce-scatter of its fp32 shard over the replicas, and a switch in gathers over them.
* pp (:mod:`.pipeline`, the schedule ``AnalyticCostModel.pipeline``): a rank runs its stage's layers
  (:meth:`AnalyticCostModel.stage_layers`: balanced, or Megatron's even split), priced at the slowest
  stage's (the attention and the GEMM coefficients each at their largest stage's, the loss head's GEMMs
  on the last stage); a dp group's ``m`` micro-batches take ``sum * (1 + bubble(p, m))``, the bubble per
  schedule (GPipe / 1F1B ``(p-1)/m``, interleaved ``(p-1)/(v m)``, ZB-H1 a third of 1F1B's); per
  micro-batch ``v`` point-to-point sends of the stage's output and its gradient (``[s/(tp cp), h]`` each)
  between ranks ``world/p`` apart, exposed unless the schedule's runtime overlaps them. Per-stage memory:
  :mod:`.pp_memory`. A sharded copy (``:fsdp``) with pp shards each stage's weights over its dp x cp
  ranks (torchtitan's FSDP + PP) and gathers only its stage's units.

Memory per rank (:mod:`.memory_model`, :meth:`AnalyticCostModel.memory`, checked against the real
step by ``hotspa memory``): home state over the world (fp32 weights, Adam m and v, fp32 gradient
store: 16 B per parameter / world), bf16 working weights and their fp32 main-grad accumulators
(6 B / (tp*pp) for the tp-split parameters, norms in full; ``fsdp``: / (tp*fsdp_shard), plus
gathered units), and activations per token as the runtime saves them (norms and residual stream on
this rank's 1/tp of the tokens: sequence parallelism; attention per ``attention_backend``; SwiGLU;
the blocked loss head's transients, DESIGN §11) over cp: without checkpointing every layer's saved
tensors, with full checkpointing only each layer's input plus one layer being recomputed, with
selective each layer's saved tensors but q / k / v and the attention kernel's own, plus one layer's
attention recomputed. What is left decides the option's token capacity.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ...activation_checkpointing import Checkpointing
from ...checks import check_int
from ...cp_kinds import CP_KINDS
from ...layout import Layout
from ...model_shape import ModelShape
from ...models.attention_kernels import KERNELS, AttentionKernel, default_chunk_kernel
from ...pipeline_split import head_layers
from .efficiency import UNFUSED_KERNELS, unfused_attention_seconds
from .grad_exposure import REDUCE_BUCKET_BYTES, exposed_share, reduce_buckets
from .hardware import HardwareProfile, get_profile
from .memory_model import MemoryModel, MemoryUse
from .option_cost import OptionCost
from .pp_schedule import PipelineSchedule, get_schedule, stage_layers
from .runtime_profile import RuntimeProfile, get_runtime
from .terms import CostModelError, cheapest_per_kind, gradient_kind, resolve_model, shares_gradients

__all__ = ["AnalyticCostModel", "CostModelError", "MemoryUse", "OptionCost", "resolve_model", "shares_gradients"]


#: names this argument took before the attention-kernel registry (a clear error names the new one)
_RENAMED = {"flash": "flash_varlen", "math": "sdpa-math"}


def _registered(name: str, roles: tuple[str, ...], what: str) -> AttentionKernel:
    """The registry's record of ``name`` with one of ``roles``, or a CostModelError listing them."""
    record = KERNELS.get(name) if isinstance(name, str) else None
    if record is None or record.role not in roles:
        known = [k for k, r in KERNELS.items() if r.role in roles]
        hint = f" ({name!r} is now {_RENAMED[name]!r})" if name in _RENAMED else ""
        raise CostModelError(f"{what} must be a registered attention kernel, one of {known}; got {name!r}{hint}")
    return record


class AnalyticCostModel(MemoryModel):
    """Prices options, stages and switches of ``model`` on ``world_size`` devices of ``hardware``.

    ``grad_bytes``: bytes per gradient element in the stage reduction (fp32: our runtime sums in
    fp32). ``param_bytes``: working weights (bf16). ``capacity_multiple``: capacities are rounded
    down to it, so tables read cleanly. ``grad_accum_bytes``: working gradient accumulators (4: fp32
    main grads, the bf16-mixed default; 2: ``grad_accumulation="bf16"``). ``attention_backend``:
    the registered attention kernel (``models.attention_kernels``) whose memory terms price the core
    attention: ``"flash_varlen"`` (linear memory, the default; sdpa and torch_varlen keep the same) or
    ``"sdpa-math"`` (SDPA's fallback, quadratic in the document length). ``chunk_kernel``: the
    registered chunk kernel the all-gather-KV attention runs (its memory terms differ: the CPU flash
    chunks keep their output and log-sum-exp for backward); default: the one that runs on the hardware
    profile's ``device_type``.
    ``pipeline``: how pp layouts are scheduled and split (:mod:`.pipeline`; default 1F1B, balanced split).
    ``runtime``: what the runtime overlaps (:mod:`.runtime_profile`); OUR runtime, ``"hotspa"``, unless
    pricing another system's published run. GEMM and attention efficiencies come from the hardware
    profile's curves (:mod:`.efficiency`, fitted to published runs: docs/cost-model.md).
    """

    def __init__(self, model: ModelShape | str | Any, hardware: HardwareProfile | str, world_size: int, *,
                 grad_bytes: int = 4, param_bytes: int = 2, capacity_multiple: int = 128,
                 grad_accum_bytes: int = 4, attention_backend: str = "flash_varlen",
                 runtime: RuntimeProfile | str = "hotspa", chunk_kernel: str | None = None,
                 pipeline: PipelineSchedule | str | None = None) -> None:
        check_int(world_size, "world size", error=CostModelError)
        self.model = resolve_model(model)
        self.hardware = get_profile(hardware)
        self.runtime = get_runtime(runtime)  # what the runtime overlaps (ours unless pricing a published run)
        try:
            self.pipeline = get_schedule(pipeline)
        except ValueError as err:
            raise CostModelError(str(err)) from None
        self.world_size = world_size
        self.grad_bytes = grad_bytes
        self.param_bytes = param_bytes
        self.capacity_multiple = capacity_multiple
        self.grad_accum_bytes = grad_accum_bytes  # working gradient accumulators (fp32 main grads: 4)
        self.attention_backend = attention_backend
        self.attention = _registered(attention_backend, ("documents", "priced"), "attention_backend")
        self.chunk_kernel = default_chunk_kernel(self.hardware.device_type) if chunk_kernel is None else chunk_kernel
        self.chunks = _registered(self.chunk_kernel, ("chunks",), "chunk_kernel")
        m = self.model
        self.params = float(m.num_params())
        self.dense_params = float(m.num_params(include_embedding=False))
        self.layer_params = (self.dense_params - m.padded_vocab_size * m.hidden - m.hidden) / m.n_layers
        self.attn_width = m.n_heads * m.head_dim
        self.kv_width = m.n_kv_heads * m.head_dim

    # ------------------------------------------------------------------ validity
    def check(self, par: Layout) -> Layout:
        """The layout, or a :class:`CostModelError` saying why this model cannot run it."""
        m = self.model
        if par.world_size != self.world_size:
            raise CostModelError(f"{par} covers {par.world_size} devices, the world has {self.world_size}")
        if m.n_heads % (par.tp * par.cp_ulysses):
            raise CostModelError(f"{par}: tp*cp={par.tp * par.cp_ulysses} (the Ulysses part of cp) does not divide "
                                 f"the model's {m.n_heads} attention heads (tp splits heads, Ulysses cp scatters "
                                 f"them; all-gather-KV cp, ':kv', does not)")
        if m.n_kv_heads % par.tp and par.tp % m.n_kv_heads:
            raise CostModelError(f"{par}: tp={par.tp} and the model's {m.n_kv_heads} kv heads do not nest")
        if par.fsdp and par.dp * par.cp == 1:
            raise CostModelError(f"{par}: a sharded working copy (fsdp) needs dp*cp > 1")
        if par.pp > 1:
            try:
                self.stage_layers(par)
            except ValueError as err:
                raise CostModelError(f"{par}: {err}") from None
        if (m.ffn_hidden % par.tp) or (m.padded_vocab_size % par.tp):
            raise CostModelError(f"{par}: tp={par.tp} does not divide ffn {m.ffn_hidden} / vocab "
                                 f"{m.padded_vocab_size}")
        return par

    def stage_layers(self, par: Layout) -> tuple[int, ...]:
        """Transformer layers per pipeline stage of ``par`` (:func:`.pp_schedule.stage_layers`; the loss
        head counted as ``vocab x hidden / layer parameters`` layers of GEMM work on the last stage)."""
        s = self.pipeline
        return self._memoized(("stage_layers", par.pp), lambda: stage_layers(
            self.model.n_layers, par.pp, head_layers(self.model), s.split, s.virtual_stages))

    def stage_shares(self, par: Layout) -> tuple[float, float, int]:
        """(attention share, GEMM share, layers) of the slowest stage: the largest stage's layers over all
        layers, the largest stage's GEMM parameters (its layers, the loss head on the last) over all, and
        its layer count; ``(1/1, 1, L)`` without pp. Each share is the max over stages (an upper bound where
        different stages hold the most attention and the most GEMM work)."""
        m = self.model
        if par.pp == 1:
            return 1.0, 1.0, m.n_layers
        layers = self.stage_layers(par)
        head = self.dense_params - m.n_layers * self.layer_params
        dense = max(n * self.layer_params + (head if s == par.pp - 1 else 0.0) for s, n in enumerate(layers))
        return max(layers) / m.n_layers, dense / self.dense_params, max(layers)

    # ------------------------------------------------------------------ time
    def _coefficients(self, par: Layout, ac: Checkpointing | bool) -> tuple[float, float, float, float, float, float]:
        m, hw = self.model, self.hardware
        mode = Checkpointing.parse(ac)
        full = mode is Checkpointing.FULL
        # tp*cp ways, each at the measured efficiency of its smaller local shapes (1.0 by default); a pp
        # stage's share of the layers (the slowest stage's)
        attn_share, _, layers = self.stage_shares(par)
        div = par.tp * par.cp * hw.shard_efficiency(par.tp, par.cp) / attn_share
        # both modes recompute the attention kernel's forward; the GEMMs: :meth:`_dense_seconds_per_token`
        recompute = 1.0 + (1.0 / 3.0 if mode else 0.0)
        # compute: attention 6*L*H*hd*s*(s+1) (models/config.py), dense 6*P*s (+2*P_layers*s recompute)
        attn = self._attention_seconds(div) * recompute
        # a kernel call of r query rows runs at e(r) = e_inf r / (r + r_half): + attn * r_half * s / r per
        # document, r = s / cp_kv (the gather part splits a document's query rows; efficiency.py)
        attn_lin = attn * self._attention_half_length() * par.cp_kv
        a, b = attn, attn + attn_lin + self._dense_seconds_per_token(par, ac)
        # per-layer launches: full reruns a block's forward (1/3 of its passes), selective about half
        # of it (q/k/v projections, rotary, the kernel; not wo, the norms, the MLP)
        d = layers * hw.layer_overhead_s * (1.0 + (1.0 / 3.0 if full else 1.0 / 6.0 if mode else 0.0))
        if par.tp > 1:
            # in all-reduce volumes: full reruns the forward's collectives (2); selective the attention
            # input's all-gather of sequence parallelism (half of one); sequence parallelism's backward
            # re-gathers of the attention and MLP inputs (tp_regather: two halves)
            regather = 1.0 if self.runtime.tp_regather else 0.0
            paired = (4 + (2 if full else 0.5 * regather if mode else 0)) * layers  # each beside its GEMM
            alone = regather * layers + 1  # the re-gathers and the embedding's reduce-scatter: no GEMM to pair
            bw, lat = hw.bandwidth(par.tp), hw.latency(par.tp)
            overlap = self.runtime.tp_comm_overlap
            volume = 2.0 * (par.tp - 1) / par.tp * m.hidden * self.param_bytes / par.cp / bw
            b += (self._exposed(overlap) * paired + alone) * volume
            if overlap:  # fused ops on a GPU; on a CPU (gloo) each paired collective is a ring of tp - 1 steps
                d += (paired * (par.tp - 1 if hw.device_type == "cpu" else 1) + alone) * lat
            else:  # on a CPU (gloo) group the re-gathers ride in the input gradients' reduce-scatters
                d += (paired + alone - (regather * layers if hw.device_type == "cpu" else 0.0)) * lat
        # ---- context parallelism: the collectives its kind issues per layer (cp_kinds.py) ----
        ring_x = ring_h = 0.0
        for ex in CP_KINDS[par.cp_kind].exchanges(m, par.tp, par.cp, par.cp_kv):
            bw, lat = hw.bandwidth(ex.span, ex.stride), hw.latency(ex.span)
            per_token = ex.width / par.tp * self.param_bytes / par.cp  # this rank's tokens and head slice
            rounds = ex.rounds + (ex.recompute_rounds if mode else 0)  # (either checkpointing mode)
            seconds = rounds * layers * ex.steps / ex.per * per_token / bw
            b += ex.tail * layers * per_token / bw  # after the last kernel: exposed
            d += ex.tail * layers * lat
            hidden = ex.ring and self.runtime.cp_comm_overlap and hw.layer_comm_overlap > 0
            if hidden:  # each ring step's transfer runs under the step's attention: max(0, x s - h s^2)
                ring_x += seconds
                ring_h += hw.layer_comm_overlap * ex.steps / ex.ranks * attn
            else:
                b += seconds
            # launches: a hidden ring exposes one per round (the later ones are posted under attention)
            d += rounds * (ex.steps if ex.ring and not hidden else ex.calls) * layers * lat
            if ex.recomputes_attention and self.runtime.kv_gather_recomputes_attention:  # backward re-runs
                recompute_attn = 1.0 / 3.0  # the attention forward (K / V not saved)
                a += attn * recompute_attn / recompute
                b += (attn + attn_lin) * recompute_attn / recompute
                attn_lin *= 1.0 + recompute_attn / recompute
                ring_h += hw.layer_comm_overlap * attn * recompute_attn / recompute if hidden else 0.0
        # ---- end context parallelism ----
        if par.pp > 1:  # activations across each stage boundary, forward and backward (pp_schedule.py)
            gap = self.world_size // par.pp  # pp takes the outermost dims: the peer is world/pp ranks away
            bw, sends = hw.bandwidth(2 * gap, gap), 2.0 * self.pipeline.messages()
            b += self._exposed(self.pipeline.p2p_overlap) * sends * m.hidden * self.param_bytes / (par.tp * par.cp) / bw
            d += sends * hw.latency(2 * gap)
        return a, b, d, ring_x, ring_h, attn_lin

    def _attention_half_length(self) -> float:
        """Query rows per call at which the runtime's kernel reaches half its efficiency (0 for an unfused
        one, priced by its FLOPs and bytes)."""
        kernel = self.runtime.attention_kernel
        return 0.0 if kernel in UNFUSED_KERNELS else self.hardware.attention_half_length_for(kernel)

    def _attention_seconds(self, div: float) -> float:
        """Attention seconds per squared document length on one rank (fwd + bwd) with the runtime's
        kernel: causal FLOPs at the kernel's fraction of peak, or an unfused kernel's roofline sum."""
        m, hw, kernel = self.model, self.hardware, self.runtime.attention_kernel
        if kernel in UNFUSED_KERNELS:
            try:
                return unfused_attention_seconds(m.n_layers, m.n_heads / div, m.head_dim, hw.peak_flops,
                                                 hw.dense_efficiency, hw.hbm_bandwidth)
            except ValueError as err:
                raise CostModelError(f"{hw.name} with runtime {self.runtime.name!r}: {err}") from None
        attn_eff = hw.attention_efficiency_for(kernel, m.head_dim)
        return 6.0 * m.n_layers * self.attn_width / (div * hw.peak_flops * attn_eff)

    def attention_seconds_per_pair(self) -> float:
        """Predicted seconds of one visible (query, key) pair's attention, forward + backward, over all
        layers on one rank: what a causal chunk of ``r`` query rows at position ``p`` over its ``p + r``
        keys costs per pair (``r p + r (r + 1) / 2`` pairs; recipes/gpu_check_cp.py times it)."""
        return 2.0 * self._attention_seconds(1.0)

    def _dense_seconds_per_token(self, par: Layout, ac: Checkpointing | bool) -> float:
        """GEMM seconds per token of a micro-batch on one rank (recompute included: full reruns
        every block GEMM's forward, selective the q / k / v projections)."""
        m, hw = self.model, self.hardware
        mode = Checkpointing.parse(ac)
        div = par.tp * par.cp * hw.shard_efficiency(par.tp, par.cp) / self.stage_shares(par)[1]
        redo = {Checkpointing.NONE: 0.0, Checkpointing.FULL: self.layer_params,
                Checkpointing.SELECTIVE: m.hidden * (self.attn_width + 2.0 * self.kv_width)}[mode]
        dense_flops = 6.0 * self.dense_params + 2.0 * redo * m.n_layers
        return dense_flops / (div * hw.peak_flops * hw.gemm_efficiency(m.hidden))

    def _exposed(self, overlapped: bool) -> float:
        """Fraction of a collective the runtime leaves on the critical path: all of it unless the
        runtime overlaps it, then ``1 - hardware.layer_comm_overlap`` (cpu-gloo: 1, nothing hides)."""
        return 1.0 - self.hardware.layer_comm_overlap if overlapped else 1.0

    def fsdp_exchange_seconds(self, par: Layout) -> float:
        """Seconds per micro-batch of a sharded working copy's (``:fsdp``) traffic, before overlap:
        per gathered unit (each block, the embedding, the head) an all-gather of its tp shard in the
        working dtype over the layout's dp*cp ranks in forward and again in backward (not the
        embedding's: its backward needs no weight; with
        checkpointing ONE backward gather serves recompute and backward: an ASSUMPTION, the runtime
        keeps the block gathered through both), and a reduce-scatter of its gradient in fp32
        (``grad_bytes``). The ``fsdp_shard`` ranks of one tp shard are the next most local after tp,
        so the group spans tp x fsdp_shard consecutive ranks: the world for plain ``:fsdp``
        (inter-node once it spans nodes), one node for an HSDP copy that fits in it."""
        g = par.fsdp_shard
        if not par.fsdp or g == 1:
            return 0.0
        return sum(self.fsdp_exchange_parts(par))

    def fsdp_exchange_parts(self, par: Layout) -> tuple[float, float, float]:
        """(forward gathers, backward re-gathers, reduce-scatters) seconds per micro-batch of
        :meth:`fsdp_exchange_seconds`, each with its calls' latencies: the runtime description says
        which of them hide behind compute."""
        g = par.fsdp_shard
        if not par.fsdp or g == 1:
            return 0.0, 0.0, 0.0
        split, full = self._param_split(par.tp)
        units = split / par.tp + full
        embedding = self.model.padded_vocab_size * self.model.hidden / par.tp  # its backward needs no weight
        hw, span, n = self.hardware, par.tp * g, self.model.n_layers + 2
        if par.pp > 1:  # a stage gathers its own units: its layers and the embedding or the head
            layers = self.stage_shares(par)[2]
            units, embedding, n = units * (layers + 1) / n, embedding * (layers + 1) / n, layers + 1
        bw, lat = hw.bandwidth(span, par.tp), hw.latency(span)
        ring = (g - 1) / g * self.param_bytes / bw
        return (ring * units + n * lat, ring * (units - embedding) + (n - 1) * lat,
                (g - 1) / g * units * self.grad_bytes / bw + n * lat)

    def _fsdp_exposed(self, par: Layout, ac: Checkpointing, capacity: int, b: float, d: float) -> tuple[float, float]:
        """(linear, per_micro_batch) with the exposed part of the per-layer traffic ``C``: each layer's
        exchange overlaps its compute (``hardware.layer_comm_overlap`` of its GEMM time), so a
        micro-batch of ``T`` tokens exposes ``max(0, C - overlap * k * T)``. That is convex in ``T``;
        priced by its chord over ``[0, capacity]`` (exact for empty and full micro-batches, an upper
        bound between): ``C`` per micro-batch minus ``min(C, overlap * k * capacity) / capacity`` per
        token. On cpu-gloo (overlap 0) all of ``C`` is paid."""
        forward, backward, reduce = self.fsdp_exchange_parts(par)
        exchange = forward + backward + reduce
        rt = self.runtime  # what the runtime overlaps: prefetched gathers, a reduce-scatter on its own stream
        # with checkpointing the backward re-gather happens in the unit's recomputation
        regather = rt.fsdp_gather_prefetch and (rt.fsdp_recompute_gather_prefetch or not ac)
        hideable = ((forward if rt.fsdp_gather_prefetch else 0.0) + (backward if regather else 0.0)
                    + (reduce if rt.fsdp_reduce_scatter_overlap else 0.0))
        hide = self.hardware.layer_comm_overlap * self._dense_seconds_per_token(par, ac)
        credit = min(hideable, hide * capacity) / capacity if capacity > 0 else 0.0
        return b - credit, d + exchange

    def grad_reduce_seconds(self, par: Layout) -> float:
        """The part of the stage's gradient reduction left on the critical path (``stage_fixed``): all
        of :meth:`grad_reduce_full_seconds` unless the runtime overlaps a replicated copy's reduction
        with the last micro-batch's backward (``RuntimeProfile.dp_reduce_overlap``), then only what
        that backward cannot hide (:mod:`.grad_exposure`). An HSDP copy's reduction over its replicas
        runs at the stage end (ours: not overlapped). Memoized per layout."""
        return self._memoized(("reduce", par), lambda: self._grad_reduce_seconds(par))

    def _grad_reduce_seconds(self, par: Layout) -> float:
        full = self.grad_reduce_full_seconds(par)
        if full <= 0 or par.fsdp or not self.runtime.dp_reduce_overlap:
            return full
        m, hw = self.model, self.hardware
        buckets = reduce_buckets(m, par.tp, REDUCE_BUCKET_BYTES[hw.device_type], self.grad_bytes, m.n_layers // par.pp)
        # ASSUMPTION: the last micro-batch is a full one (the runtime runs the plan's costliest
        # last, engine/step_runner.py); its backward's GEMMs (2/3 of their FLOPs) hide the buckets
        try:
            capacity = self.capacity(par, Checkpointing.NONE)
        except CostModelError:
            capacity = 0
        backward = 2.0 / 3.0 * self._dense_seconds_per_token(par, Checkpointing.NONE) * max(capacity, 0)
        return full * exposed_share(buckets, hw.layer_comm_overlap * backward / full)

    def grad_reduce_full_seconds(self, par: Layout) -> float:
        """The stage's reduce-scatter of fp32 gradients over the ranks sharing a weight shard, all of
        it. A sharded working copy (``:fsdp``) reduce-scatters every block's gradient each micro-batch
        (:meth:`fsdp_exchange_seconds`): its stage end only folds the local shard into the store; an
        HSDP one (``:fsdp8``) reduce-scatters its shard over its replicas (the outer, inter-node dims)."""
        g = par.fsdp_replicas
        if g == 1:
            return 0.0
        nbytes = self.params / self._working_shards(par) * self.grad_bytes
        hw = self.hardware
        return (g - 1) / g * nbytes / hw.bandwidth(self.world_size, self.world_size // g) + hw.latency(self.world_size)

    def reductions_seconds(self, layouts: Sequence[Layout]) -> float:
        """The gradient reductions of a plan whose stages run ``layouts``: one per gradient kind
        (:func:`~.terms.gradient_kind`; a run of stages that share gradients reduces once),
        the cheapest of its layouts. A replicated and a sharded copy of one tp degree are two kinds."""
        return cheapest_per_kind((gradient_kind(lay), self.grad_reduce_seconds(lay)) for lay in layouts)

    def option(self, par: Layout, activation_checkpointing: Checkpointing | bool | str,
               capacity: int | None = None) -> OptionCost:
        """The priced option of ``par`` with ``activation_checkpointing`` (a mode, a bool or its name);
        ``capacity``: tokens per micro-batch (default: the memory model's, and the option memoized)."""
        if capacity is None:
            return self._memoized(("option", par, activation_checkpointing),
                                  lambda: self._option(par, activation_checkpointing, None))
        return self._option(par, activation_checkpointing, capacity)

    def _option(self, par: Layout, activation_checkpointing: Checkpointing | bool | str,
                capacity: int | None) -> OptionCost:
        par = self.check(par)
        activation_checkpointing = Checkpointing.parse(activation_checkpointing)
        if activation_checkpointing is Checkpointing.SELECTIVE and par.fsdp:
            raise CostModelError(f"{par}: selective checkpointing is not built for sharded working copies")
        a, b, d, ring_x, ring_h, attn_lin = self._coefficients(par, activation_checkpointing)
        cap = self.capacity(par, activation_checkpointing) if capacity is None else int(capacity)
        if par.fsdp:
            b, d = self._fsdp_exposed(par, activation_checkpointing, cap, b, d)
        return OptionCost(par, activation_checkpointing, cap, a, b, d, self.grad_reduce_seconds(par),
                          ring_exchange=ring_x, ring_hiding=ring_h, pipeline=self.pipeline, attention_linear=attn_lin)

    # ------------------------------------------------------------------ switches
    def _working_shards(self, par: Layout | None) -> int:
        """How many ways a rank's working copy splits the weights: home and ``:fsdp`` copies over
        the whole world (an fsdp working copy is the home shard in the working dtype), an HSDP one
        (``:fsdp8``) over tp x its shard."""
        if par is None:
            return self.world_size
        return par.shards * par.fsdp_shard if par.fsdp else par.shards

    def switch_bytes(self, source: Layout | None, target: Layout) -> float:
        """Bytes each rank receives to hold ``target``'s working weights (``source`` None: home). Into
        a sharded working copy (``:fsdp``) it is a local slice (+ cast): 0 bytes; into an HSDP one
        (``:fsdp8``) a gather over its replicas."""
        dst = self._working_shards(target)
        src = self._working_shards(source)
        return self.params * self.param_bytes * max(0.0, 1.0 / dst - 1.0 / src)

    def switch_seconds(self, source: Layout | None, target: Layout) -> float:
        nbytes = self.switch_bytes(source, target)
        if nbytes <= 0:
            return 0.0
        span = self._working_shards(source)
        hw = self.hardware
        return nbytes / hw.bandwidth(span) + hw.latency(span)

    def switch_sequence_seconds(self, order: Sequence[Layout]) -> float:
        """Home to the first stage's layout, then each next one (the step's switches)."""
        total, prev = 0.0, None
        for par in order:
            total += self.switch_seconds(prev, par)
            prev = par
        return total

    def shared_reduction_seconds(self, order: Sequence[Layout]) -> float:
        """Gradient reductions a stage order saves against one per stage: a stage followed by one
        that :func:`shares_gradients` with it does not reduce (the run's last stage does)."""
        return sum(self.grad_reduce_seconds(a) for a, b in zip(order, order[1:]) if shares_gradients(a, b))

    def summary(self) -> dict[str, float]:
        return {"params": self.params, "world_size": self.world_size,
                "flops_per_token_4k": self.model.flops_per_token(4096)}

